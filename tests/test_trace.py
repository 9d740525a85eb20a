"""The merged timeline: one Chrome trace of every rank's spans, on rank 0's clock."""
import json

import numpy as np
import pytest

from hpcpar.dist import Communicator
from hpcpar.dist.trace import Tracer, measure_offset

pytestmark = pytest.mark.mpi(min_size=1)


def test_clock_offsets_are_measured_against_rank_0(world):
    offset, error = measure_offset(world)
    if world.Get_rank() == 0:
        assert (offset, error) == (0.0, 0.0)
    else:  # one machine, one monotonic clock: the measured offset is within the measured error
        assert 0 < error < 1.0 and abs(offset) <= error + 1e-6


def test_spans_and_communication_of_the_kept_steps(world, tmp_path_factory):
    comm = Communicator(world, "world")
    path = str(tmp_path_factory.getbasetemp() / "unit-trace.json") if world.Get_rank() == 0 else None
    path = world.bcast(path, root=0)
    tracer = Tracer(comm, steps=2)
    tracer.watch([comm])
    for step in range(6):
        with tracer.step(step):
            with tracer.span("forward", micro=0):
                comm.allreduce(np.ones(10))
            if comm.size > 1:  # a ring of messages: each rank sends right, receives from the left
                handle = comm.irecv(np.empty(3), (comm.rank - 1) % comm.size, tag=step)
                comm.send(np.ones(3), (comm.rank + 1) % comm.size, tag=step)
                handle.wait()
    comm.barrier()  # outside any step: not recorded
    written = tracer.write(path)
    tracer.close()
    assert comm.stats.listener is None
    if world.Get_rank() != 0:
        assert written is None
        return
    data = json.load(open(path))
    spans = [e for e in data["traceEvents"] if e["ph"] == "X"]
    assert {e["args"]["name"] for e in data["traceEvents"] if e["name"] == "process_name"} == \
        {f"rank {r}" for r in range(comm.size)}
    for rank in range(comm.size):
        mine = [e for e in spans if e["pid"] == rank]
        assert [e["args"]["step"] for e in mine if e["cat"] == "step"] == [0, 1, 4, 5]  # first 2 and last 2
        assert sum(e["name"] == "forward" for e in mine) == 4 and "barrier" not in {e["name"] for e in mine}
        reduce = [e for e in mine if e["name"] == "allreduce"]
        assert len(reduce) == 4 and all(e["args"]["comm"] == "world" and e["args"]["bytes"] == 80 and
                                        e["args"]["wire_bytes"] == 2 * (comm.size - 1) * 80 // comm.size
                                        for e in reduce)
        for step in (e for e in mine if e["cat"] == "step"):  # every span nests inside its step
            inside = [e for e in mine if e is not step and step["ts"] <= e["ts"] <= step["ts"] + step["dur"]]
            assert all(e["ts"] + e["dur"] <= step["ts"] + step["dur"] + 1 for e in inside)
    if comm.size > 1:
        error = data["otherData"]["clock_error_us"]
        sends = {(e["pid"], e["args"]["peer"], e["args"]["tag"]): e for e in spans if e["name"] == "send"}
        waits = [e for e in spans if e["name"] == "irecv wait"]
        assert len(waits) == 4 * comm.size and all(e["args"]["bytes"] == 24 for e in waits)
        for wait in waits:  # a message arrives after it was sent, within the clocks' errors
            send = sends[(wait["args"]["peer"], wait["pid"], wait["args"]["tag"])]
            slack = error[wait["pid"]] + error[send["pid"]]
            assert wait["ts"] + wait["dur"] >= send["ts"] - slack
