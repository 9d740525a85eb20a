"""One timeline of a whole job: a Chrome / Perfetto trace-event JSON with a track per rank.

    tracer = Tracer(ctx.world, steps=5)               # collective: measures the clocks against rank 0
    tracer.watch(ctx.communicators().values())         # every call on them becomes a span
    for step in range(steps):
        with tracer.step(step):
            with tracer.span("forward"):
                ...
    tracer.write("runs/job/trace.json")               # collective: rank 0 writes the file

Open the file in https://ui.perfetto.dev or chrome://tracing; docs/architecture.md ("Traces")
says what a rank's track holds. Timestamps are on rank 0's clock (``measure_offset``), in
microseconds since the tracer started. Only the first and the last ``steps`` steps are kept.
"""
from __future__ import annotations

import contextlib
import json
import os
import time
from collections import deque

import numpy as np
from mpi4py import MPI

PING_ROUNDS = 8
# A pipeline's actions: F is a forward, B and W backward; the others (SEND_F, RECV_B, SYNC, ...)
# are the schedule's communication steps, "pipeline" spans around the calls ("comm" spans) they make.
ACTION_CATEGORIES = {"F": "forward", "B": "backward", "W": "backward"}
BLOCKING = ("send", "recv")  # posted and waited for by the Communicator: one span in the trace


def measure_offset(world, rounds: int = PING_ROUNDS) -> tuple[float, float]:
    """(offset, error) of this rank's perf_counter against rank 0's: rank 0's clock = ours + offset.

    Collective over the mpi4py communicator ``world``; rank 0 gets (0, 0). Ranks are measured one
    at a time so that rank 0 answers at once, on a duplicate of ``world`` (no message of the job's
    own can match).

    Every rank stamps spans with its own ``time.perf_counter()``. Each rank plays ping-pong with
    rank 0 ``rounds`` times; the round trip with the smallest delay gives the offset to rank 0's
    clock (rank 0's reading minus the midpoint of the round trip) and bounds its error by half
    that round trip. Each rank's error bound goes into the file's ``otherData``.
    """
    world = world.Dup()
    rank, size = world.Get_rank(), world.Get_size()
    ping, pong = np.zeros(1), np.zeros(1)
    best = (0.0, 0.0)
    if rank == 0:
        for peer in range(1, size):
            for _ in range(rounds):
                world.Recv(ping, source=peer, tag=0)
                pong[0] = time.perf_counter()
                world.Send(pong, dest=peer, tag=0)
    else:
        best = (0.0, float("inf"))
        for _ in range(rounds):
            sent = time.perf_counter()
            world.Send(ping, dest=0, tag=0)
            world.Recv(pong, source=0, tag=0)
            back = time.perf_counter()
            error = (back - sent) / 2
            if error < best[1]:
                best = (pong[0] - (sent + back) / 2, error)
    world.Barrier()
    world.Free()
    return best


class Tracer:
    """Spans of this rank's steps, on rank 0's clock; ``write`` merges every rank's into one file."""

    def __init__(self, world, steps: int = 5):
        """``world``: an hpcpar Communicator over every rank of the job (collective)."""
        if steps < 1:
            raise ValueError(f"steps must be >= 1, got {steps}")
        self.world, self.keep = world, steps
        self.rank = world.rank
        self.offset, self.error = measure_offset(world.mpi)
        self.zero = world.mpi.bcast(time.perf_counter() + self.offset if self.rank == 0 else None, root=0)
        self._first: list[list[dict]] = []
        self._last: deque = deque(maxlen=steps)
        self._current: list[dict] | None = None
        self._world_rank_of: dict = {}
        self._watched: list = []

    # ----- recording ------------------------------------------------------------------
    def _micros(self, local_time: float) -> float:
        return round((local_time + self.offset - self.zero) * 1e6, 3)

    def add(self, name: str, start: float, end: float, category: str = "compute", **args) -> None:
        """A span from ``start`` to ``end`` (this rank's perf_counter), kept when inside a step."""
        if self._current is None:
            return
        self._current.append({"name": name, "cat": category, "ph": "X", "pid": self.rank, "tid": 0,
                              "ts": self._micros(start), "dur": round((end - start) * 1e6, 3), "args": args})

    @contextlib.contextmanager
    def span(self, name: str, category: str = "compute", **args):
        start = time.perf_counter()
        try:
            yield
        finally:
            self.add(name, start, time.perf_counter(), category, **args)

    @contextlib.contextmanager
    def step(self, number: int, label: str = "step"):
        """Everything recorded inside belongs to step ``number`` (kept if among the first or last);
        the span is named "``label`` ``number``" (a parameter server's steps are its rounds)."""
        self._current = []
        start = time.perf_counter()
        try:
            yield
        finally:
            self._close_step(number, start, time.perf_counter(), label)

    def add_recorded_step(self, number: int, start: float, end: float, actions) -> None:
        """A step recorded earlier as (name, start, end) actions (``PipelineParallel.trace``)."""
        self._current = []
        self.add_actions(actions)
        self._close_step(number, start, end)

    def _close_step(self, number: int, start: float, end: float, label: str = "step") -> None:
        spans, self._current = self._current, None
        spans.insert(0, {"name": f"{label} {number}", "cat": "step", "ph": "X", "pid": self.rank, "tid": 0,
                         "ts": self._micros(start), "dur": round((end - start) * 1e6, 3), "args": {"step": number}})
        (self._first if len(self._first) < self.keep else self._last).append(spans)

    def add_actions(self, actions) -> None:
        """A pipeline's (name, start, end) actions: F forward, B and W backward, the others "pipeline"."""
        for name, start, end in actions:  # "F3@s1", "SEND_F3@s1->s2", "SYNC"
            self.add(name, start, end, ACTION_CATEGORIES.get(name.split("@")[0].rstrip("0123456789"), "pipeline"))

    def watch(self, communicators) -> None:
        """Record every call on these hpcpar Communicators as a communication span."""
        world_group = MPI.COMM_WORLD.Get_group()
        for comm in communicators:
            if comm.stats.listener is not None:
                continue  # watched already (the same communicator under two names)
            group = comm.mpi.Get_group()
            self._world_rank_of[comm.name] = group.Translate_ranks(list(range(comm.size)), world_group)
            group.Free()
            comm.stats.listener = self._record_call
            self._watched.append(comm)
        world_group.Free()

    def _record_call(self, call) -> None:
        if self._current is None:
            return
        args = {"comm": call.comm, "bytes": call.nbytes, "wire_bytes": call.wire_bytes}
        if call.peer >= 0:
            ranks = self._world_rank_of.get(call.comm)
            args.update(peer=int(ranks[call.peer]) if ranks is not None else call.peer, tag=call.tag)
        posted = self._current[-1] if self._current else None
        if call.wait and call.op in BLOCKING and posted is not None and posted["name"] == call.op \
                and posted["args"].get("tag") == args.get("tag") and posted["args"].get("peer") == args.get("peer"):
            posted["dur"] = round(self._micros(call.end) - posted["ts"], 3)  # a blocking call: one span, post to end
            return
        self.add(call.op + (" wait" if call.wait else ""), call.start, call.end, "comm", **args)

    def close(self) -> None:
        """Stop listening to the communicators."""
        for comm in self._watched:
            comm.stats.listener = None
        self._watched = []

    # ----- the file ---------------------------------------------------------------------
    def events(self) -> list[dict]:
        return [event for spans in [*self._first, *self._last] for event in spans]

    def write(self, path: str) -> str | None:
        """Gather every rank's spans to rank 0, which writes ``path`` (collective); returns it on rank 0."""
        everyone = self.world.mpi.gather((self.events(), self.error), root=0)
        if self.rank != 0:
            return None
        events = [{"name": "process_name", "ph": "M", "pid": r, "tid": 0, "args": {"name": f"rank {r}"}}
                  for r in range(len(everyone))]
        events += [{"name": "process_sort_index", "ph": "M", "pid": r, "tid": 0, "args": {"sort_index": r}}
                   for r in range(len(everyone))]
        events += [event for rank_events, _ in everyone for event in rank_events]
        other = {"clock": "rank 0's time.perf_counter, microseconds since the trace started",
                 "clock_error_us": [round(error * 1e6, 3) for _, error in everyone],
                 "steps_kept": f"the first {self.keep} and the last {self.keep}"}
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path + ".tmp", "w") as f:
            json.dump({"traceEvents": events, "displayTimeUnit": "ms", "otherData": other}, f)
        os.replace(path + ".tmp", path)
        return path


class NoTrace:
    """What a strategy calls when the job writes no trace: every recording call does nothing."""

    def add(self, *args, **kwargs) -> None:
        pass

    def add_actions(self, actions) -> None:
        pass

    def span(self, *args, **kwargs):
        return contextlib.nullcontext()

    def step(self, number: int, label: str = "step"):
        return contextlib.nullcontext()


NO_TRACE = NoTrace()
