"""The merged timeline: one Chrome trace of every rank's spans, on rank 0's clock."""
import json
import os
import subprocess
import sys
from collections import defaultdict

import numpy as np
import pytest

from conftest import REPO, venv_bin
from hpcpar.runtime import Communicator
from hpcpar.runtime.trace import Tracer, measure_offset


@pytest.mark.mpi(min_size=1)
def test_clock_offsets_are_measured_against_rank_0(world):
    offset, error = measure_offset(world)
    if world.Get_rank() == 0:
        assert (offset, error) == (0.0, 0.0)
    else:  # one machine, one monotonic clock: the measured offset is within the measured error
        assert 0 < error < 1.0 and abs(offset) <= error + 1e-6


@pytest.mark.mpi(min_size=1)
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


# ----- the trace of a training job: dp 2 x pp 2 x tp 1 (world ranks 0, 1 are stage 0; 2, 3 stage 1) -----
ONE_F_ONE_B = {0: ["F0", "F1", "B0", "F2", "B1", "F3", "B2", "B3"],  # 2 stages, 4 micro-batches
               1: ["F0", "B0", "F1", "B1", "F2", "B2", "F3", "B3"]}
ROWS, BLOCK, WIDTH = 1, 64, 32  # a micro-batch: 8 rows / 2 replicas / 4 micro-batches, of 64 tokens x 32


@pytest.fixture(scope="module")
def job_trace(tmp_path_factory, token_file):
    tmp = tmp_path_factory.mktemp("trace-2x2x1")
    overrides = ["parallel.dp=2", "parallel.pp=2", "parallel.tp=1", "parallel.micro_batches=4", "model.n_layer=2",
                 f"model.n_embd={WIDTH}", f"model.block_size={BLOCK}", "data.batch_size=8", "train.steps=6",
                 "train.eval_interval=0", "train.trace_steps=2", "checkpoint.interval=0",
                 f'checkpoint.dir="{tmp}/ckpt"', f'train.metrics="{tmp}/metrics.jsonl"', f'data.path="{token_file}"']
    args = [venv_bin("mpiexec"), "-n", "4", sys.executable, "-m", "hpcpar", "train",
            os.path.join(REPO, "jobs", "gpt-pp.toml"), "--trace", str(tmp / "trace.json"), "--progress", "none"]
    for item in overrides:
        args += ["--set", item]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=240,
                          env={**os.environ, "OPENBLAS_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"trace of every rank: {tmp / 'trace.json'}" in proc.stdout
    return json.load(open(tmp / "trace.json"))


def steps_of(spans, rank):
    """{step number: (the step's span, the spans inside it sorted by start)} of one rank."""
    mine = sorted((e for e in spans if e["pid"] == rank), key=lambda e: e["ts"])
    return {e["args"]["step"]: (e, [i for i in mine if i is not e and e["ts"] <= i["ts"] <= e["ts"] + e["dur"]])
            for e in mine if e["cat"] == "step"}


def test_each_rank_of_a_2x2x1_job_records_its_schedule(job_trace):
    spans = [e for e in job_trace["traceEvents"] if e["ph"] == "X"]
    for rank in range(4):
        stage = rank // 2
        steps = steps_of(spans, rank)
        assert sorted(steps) == [1, 2, 5, 6]  # the first 2 and the last 2 of 6
        for step, inside in steps.values():
            assert all(e["ts"] + e["dur"] <= step["ts"] + step["dur"] + 1 for e in inside)  # nested in the step
            names = [e["name"] for e in inside]
            compute = [e["name"] for e in inside if e["cat"] in ("forward", "backward")]
            assert compute == [f"{action}@s{stage}" for action in ONE_F_ONE_B[stage]]
            assert all(e["cat"] == ("forward" if e["name"][0] == "F" else "backward")
                       for e in inside if e["name"] in compute)
            # after the last backward: the gradient sync (dp all-reduce inside it), then the optimizer
            sync, optimizer = (next(e for e in inside if e["name"] == n) for n in ("SYNC", "optimizer"))
            last_backward = max(e["ts"] + e["dur"] for e in inside if e["cat"] == "backward")
            assert last_backward <= sync["ts"] and sync["ts"] + sync["dur"] <= optimizer["ts"]
            reduce = [e for e in inside if e["name"] == "iallreduce"]
            assert len(reduce) >= 1 and all(e["args"]["comm"] == "dp" and sync["ts"] <= e["ts"] for e in reduce)
            assert all(e["args"]["wire_bytes"] == e["args"]["bytes"] for e in reduce)  # 2(n-1)/n = 1 at n = 2
            comm = [e for e in inside if e["cat"] == "comm"]
            # the world: the step's finiteness flag, agreed over every rank; pp-tied: the tied embedding's sum
            assert all(e["args"]["comm"] in ("dp", "pp", "tp", "world", "pp-tied") and e["args"]["bytes"] >= 0
                       for e in comm)
            # activations go down (stage 0 sends, stage 1 receives), gradients up, one per micro-batch
            sent = [e for e in comm if e["name"] == "isend" and e["args"]["bytes"] == ROWS * BLOCK * WIDTH * 4]
            received = [e for e in comm if e["name"] == "irecv wait"]
            # a send that completed by the time the engine looked (after the next action) is
            # released without a wait: only those still in flight at the step's end show one
            assert len(sent) == 4 and len(received) == 4 and names.count("isend wait") <= len(sent) + (stage == 0)
            assert {e["args"]["peer"] for e in sent + received} == {(rank + 2) % 4}


def test_the_ranks_of_a_2x2x1_job_are_aligned(job_trace):
    spans = [e for e in job_trace["traceEvents"] if e["ph"] == "X"]
    error = job_trace["otherData"]["clock_error_us"]
    assert len(error) == 4 and error[0] == 0 and all(0 < e < 1e5 for e in error[1:])
    steps = {rank: steps_of(spans, rank) for rank in range(4)}
    for number in (1, 2, 5, 6):
        # a message's receive ends after its send started (MPI keeps the order per sender, receiver, tag)
        sends, receives = defaultdict(list), defaultdict(list)
        for rank in range(4):
            for e in steps[rank][number][1]:
                if e["name"] in ("isend", "send"):
                    sends[(rank, e["args"]["peer"], e["args"]["tag"])].append(e)
                elif e["name"] in ("irecv wait", "recv"):
                    receives[(e["args"]["peer"], rank, e["args"]["tag"])].append(e)
        assert sorted(sends) == sorted(receives) and len(sends) == 6  # header, activations, gradients x 2 pairs
        for channel, sent in sends.items():
            assert len(sent) == len(receives[channel])
            slack = error[channel[0]] + error[channel[1]]
            for send, receive in zip(sent, receives[channel]):
                assert receive["ts"] + receive["dur"] >= send["ts"] - slack, (number, channel)
        # a collective ends on each rank after every rank of it started: the dp pairs' all-reduce
        for pair in ((0, 1), (2, 3)):
            calls = {r: [e for e in steps[r][number][1] if e["name"] == "iallreduce"] for r in pair}
            waits = {r: [e for e in steps[r][number][1] if e["name"] == "iallreduce wait"] for r in pair}
            for a, b in (pair, pair[::-1]):
                for wait, other in zip(waits[a], calls[b]):
                    assert wait["ts"] + wait["dur"] >= other["ts"] - error[a] - error[b]
