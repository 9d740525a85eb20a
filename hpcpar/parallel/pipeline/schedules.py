"""Pipeline schedules as data: per-rank lists of actions, a printable grid and a simulator.

A schedule is ``list[list[Action]]``, one ordered list per pipeline rank, built by a pure function
of (p ranks, m micro-batches, v chunks); the engine only executes it, the simulator here checks it
without MPI (modelled on torch.distributed.pipelining ``schedules.py``).

Stages are *virtual*: the model is cut into ``p * v`` consecutive pieces and rank ``r`` holds
virtual stages ``r, r + p, r + 2p, ...`` (Megatron's interleaving; ``v = 1`` is a plain pipeline).
Micro-batch ``i`` flows ``F(i, 0) -> F(i, 1) -> ...`` and its gradient flows back
``B(i, last) -> ... -> B(i, 0)``. Zero-bubble schedules split the backward into ``B`` (gradient
of the stage input, which the previous stage is waiting for) and ``W`` (weight gradients, which
nobody waits for and so can fill bubbles). ``simulate`` runs all lists together under the
execution contract (docs/architecture.md) and raises ``DeadlockError``, with the grid and each
rank's stuck action, when a wait can never end.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import NamedTuple

COMPUTE = ("F", "B", "W")
SENDS = {"SEND_F": "F", "SEND_B": "B"}
RECVS = {"RECV_F": "F", "RECV_B": "B"}
KINDS = COMPUTE + tuple(SENDS) + tuple(RECVS)


class Action(NamedTuple):
    """One step of one rank: compute (F, B, W) or communication of one micro-batch.

    ``stage`` is the virtual stage the action belongs to (the sender for SEND, the receiver for
    RECV); ``peer_stage`` is the virtual stage on the other side of a SEND/RECV, else None.
    """
    kind: str
    microbatch: int
    stage: int
    peer_stage: int | None = None

    def __str__(self) -> str:
        base = f"{self.kind}{self.microbatch}@s{self.stage}"
        if self.kind in SENDS:
            return f"{base}->s{self.peer_stage}"
        if self.kind in RECVS:
            return f"{base}<-s{self.peer_stage}"
        return base

    @property
    def is_compute(self) -> bool:
        return self.kind in COMPUTE


class ScheduleError(RuntimeError):
    """A schedule that cannot be executed: a receive matching the wrong message, a duplicate or
    missing compute, a send nobody receives."""


class DeadlockError(ScheduleError):
    """No rank can make progress: each one waits for something no other rank will ever do."""


# ----------------------------------------------------------------------------------------------
# Building schedules


def _check(p: int, m: int, v: int = 1) -> None:
    for name, value in (("num_stages", p), ("num_microbatches", m), ("chunks", v)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {value!r}")


def _with_comms(rank: int, p: int, v: int, compute: list[Action]) -> list[Action]:
    """Wrap each compute action in the communication it needs: its RECV right before it, its SEND
    right after it. Neighbours on the same rank (p == 1) hand tensors over in memory."""
    last = p * v - 1
    out: list[Action] = []
    for a in compute:
        i, s = a.microbatch, a.stage
        before = after = None
        if a.kind == "F":
            if s > 0 and (s - 1) % p != rank:
                before = Action("RECV_F", i, s, s - 1)
            if s < last and (s + 1) % p != rank:
                after = Action("SEND_F", i, s, s + 1)
        elif a.kind == "B":
            if s < last and (s + 1) % p != rank:
                before = Action("RECV_B", i, s, s + 1)
            if s > 0 and (s - 1) % p != rank:
                after = Action("SEND_B", i, s, s - 1)
        out += [x for x in (before, a, after) if x is not None]
    return out


def _one_f_one_b_order(forwards: list[Action], backwards: list[Action], warmup: int,
                       deferred_weights: int | None = None) -> list[Action]:
    """``warmup`` forwards, then pairs (next forward, next backward), then the remaining
    backwards. With ``deferred_weights = d`` (zero bubble) each backward is B (input gradient)
    and the W of the oldest waiting backward follows every backward from the (d+1)-th on; the
    d deferred W fill the cool-down."""
    order = forwards[:warmup]
    pending_w: deque[Action] = deque()
    for j, b in enumerate(backwards):
        if warmup + j < len(forwards):
            order.append(forwards[warmup + j])
        order.append(b)
        if deferred_weights is not None:
            pending_w.append(Action("W", b.microbatch, b.stage))
            if j >= deferred_weights:
                order.append(pending_w.popleft())
    return order + list(pending_w)


def _plain(p: int, m: int, warmup, deferred_weights=None) -> list[list[Action]]:
    """The single-chunk schedules: every rank does micro-batches 0..m-1 in order."""
    _check(p, m)
    schedule = []
    for r in range(p):
        forwards = [Action("F", i, r) for i in range(m)]
        backwards = [Action("B", i, r) for i in range(m)]
        d = None if deferred_weights is None else deferred_weights(r)
        schedule.append(_with_comms(r, p, 1, _one_f_one_b_order(forwards, backwards, warmup(r), d)))
    return schedule


def gpipe(num_stages: int, num_microbatches: int) -> list[list[Action]]:
    """GPipe: all forwards, then all backwards. Holds all m micro-batches' activations."""
    return _plain(num_stages, num_microbatches, warmup=lambda r: num_microbatches)


def one_f_one_b(num_stages: int, num_microbatches: int) -> list[list[Action]]:
    """1F1B (PipeDream-flush, Megatron): rank r runs min(p - r - 1, m) warm-up forwards, then
    alternates one forward / one backward, then drains the backwards. Rank r holds at most
    min(m, p - r) micro-batches' activations; the bubble is the same as GPipe's."""
    p, m = num_stages, num_microbatches
    return _plain(p, m, warmup=lambda r: min(p - r - 1, m))


def zero_bubble_h1(num_stages: int, num_microbatches: int) -> list[list[Action]]:
    """ZB-H1 (Qi et al. 2023, "Zero Bubble Pipeline Parallelism"): 1F1B's order of F and B, with
    B computing only the input gradient, so the gradient reaches the previous stage sooner. Rank
    r defers its first r weight-gradient passes W (as torch's ZB schedules do) and runs them in
    the cool-down, where 1F1B would idle. In-flight activations (F done, B not) stay 1F1B's
    p - r; counting until W, at most p on every rank, 1F1B's peak on rank 0."""
    p, m = num_stages, num_microbatches
    return _plain(p, m, warmup=lambda r: min(p - r - 1, m), deferred_weights=lambda r: r)


def interleaved_fit(num_stages: int, num_microbatches: int) -> int | None:
    """The interleaved schedule's rule, in one place (the schedule, job validation and ``hpcpar
    compare`` ask here): micro-batches pass the ranks in groups of ``num_stages``, so their number
    must divide by it. None when it does, else the next count that would."""
    p, m = num_stages, num_microbatches
    return None if m % p == 0 else (m // p + 1) * p


def interleaved_1f1b(num_stages: int, num_microbatches: int, chunks: int) -> list[list[Action]]:
    """Megatron's interleaved 1F1B (Narayanan et al. 2021): v = ``chunks`` model chunks per rank.

    The forward order on every rank goes through micro-batches in groups of p: micro-batches
    0..p-1 on chunk 0, the same on chunk 1, ..., then the next group (backwards the same with the
    chunks reversed), hence Megatron's requirement m % p == 0. Rank r runs
    ``(v - 1) * p + 2 * (p - r - 1)`` warm-up forwards (Megatron's count, filling the time the
    first gradient needs to come back) for v > 1; with v == 1 the warm-up is 1F1B's p - r - 1, so
    the schedule is exactly 1F1B.
    """
    p, m, v = num_stages, num_microbatches, chunks
    _check(p, m, v)
    fit = interleaved_fit(p, m)
    if fit is not None:
        raise ValueError(f"interleaved schedule needs num_microbatches divisible by num_stages "
                         f"(as Megatron does): got m={m}, p={p}; use m = {fit}")
    group = p * v

    def micro_and_chunk(k: int, forward: bool) -> tuple[int, int]:
        chunk = (k % group) // p
        return (k // group) * p + k % p, chunk if forward else v - 1 - chunk

    schedule = []
    for r in range(p):
        fwd, bwd = ([Action(kind, i, c * p + r) for i, c in
                     (micro_and_chunk(k, kind == "F") for k in range(m * v))] for kind in "FB")
        # Megatron's 2 * (p - r - 1) (not 1F1B's p - r - 1) keeps ranks busy while activations
        # and gradients are in flight: with 1F1B's count the simulator finds the same bubble at
        # zero latency but a longer step once messages take time.
        warmup = (v - 1) * p + 2 * (p - r - 1) if v > 1 else p - r - 1
        schedule.append(_with_comms(r, p, v, _one_f_one_b_order(fwd, bwd, min(warmup, m * v))))
    return schedule


SCHEDULES = {
    "gpipe": gpipe,
    "1f1b": one_f_one_b,
    "interleaved": interleaved_1f1b,
    "zb1": zero_bubble_h1,
}


def make_schedule(name: str, num_stages: int, num_microbatches: int, chunks: int = 1) -> list[list[Action]]:
    """The schedule ``name`` (a key of SCHEDULES) for p ranks, m micro-batches, v chunks per rank."""
    if name not in SCHEDULES:
        raise ValueError(f"unknown pipeline schedule {name!r}; known: {', '.join(SCHEDULES)}")
    _check(num_stages, num_microbatches, chunks)
    if name == "interleaved":
        return interleaved_1f1b(num_stages, num_microbatches, chunks)
    if chunks != 1:
        raise ValueError(f"schedule {name!r} has one chunk per rank; chunks={chunks} needs 'interleaved'")
    return SCHEDULES[name](num_stages, num_microbatches)


def theoretical_bubble(num_stages: int, num_microbatches: int, chunks: int = 1) -> float:
    """Idle share of a pipeline step: ``(p - 1) / (m + p - 1)``, divided by v when interleaved.

    Megatron (Narayanan et al. 2021): the bubble lasts (p - 1) forward+backward times, i.e.
    (p - 1) / m of the ideal compute time; as a share of the whole step that is
    (p - 1) / (m + p - 1), exact for GPipe and 1F1B with uniform stage costs. Interleaving
    shrinks the bubble time by v, and this function follows the project's spec in dividing the
    share by v; the exact share under that model is (p - 1) / (v * m + p - 1), slightly larger,
    which is what ``simulate`` measures for the interleaved schedule.
    """
    _check(num_stages, num_microbatches, chunks)
    return (num_stages - 1) / (num_microbatches + num_stages - 1) / chunks


# ----------------------------------------------------------------------------------------------
# Looking at schedules


def format_grid(schedule: list[list[Action]], comms: bool = False,
                marks: dict[int, int] | None = None) -> str:
    """A step x rank table: row k holds each rank's k-th action (compute only unless ``comms``).

    ``marks`` maps rank -> index into that rank's full action list; the marked cell gets ``>>``
    (the simulator marks where each rank is stuck). Rows are steps of each rank's own list, not
    times: the same row on two ranks need not run at the same time.
    """
    marks = marks or {}
    columns = []
    for r, actions in enumerate(schedule):
        shown = [(f">>{a}" if marks.get(r) == j else str(a))
                 for j, a in enumerate(actions) if comms or a.is_compute or marks.get(r) == j]
        columns.append([f"rank {r}"] + shown)
    rows = max(len(c) for c in columns)
    width = max(len(cell) for c in columns for cell in c) + 2
    lines = []
    for k in range(rows):
        label = "step" if k == 0 else str(k - 1)
        lines.append(f"{label:>5} " + "".join(
            (c[k] if k < len(c) else "").ljust(width) for c in columns).rstrip())
    return "\n".join(lines)


def peak_activations(schedule: list[list[Action]], held_until: str = "B") -> list[int]:
    """Per rank, the most (micro-batch, virtual stage) activations held at once: forward done,
    backward not yet; counted per virtual stage, so under interleaving each is 1/v of a rank's
    share of the model. With ``held_until="W"`` an activation of a split schedule is held until
    its W (weight gradients need the stage inputs); schedules without W free it at B anyway."""
    if held_until not in ("B", "W"):
        raise ValueError(f"held_until must be 'B' or 'W', got {held_until!r}")
    peaks = []
    for actions in schedule:
        release = held_until if any(a.kind == "W" for a in actions) else "B"
        held = peak = 0
        for a in actions:
            held += (a.kind == "F") - (a.kind == release)
            peak = max(peak, held)
        peaks.append(peak)
    return peaks


# ----------------------------------------------------------------------------------------------
# Simulating schedules


@dataclass
class SimResult:
    timelines: list[list[tuple[float, float, Action]]]  # per rank: (start, end, compute action)
    makespan: float
    busy: list[float]  # per rank: total compute time

    @property
    def bubble(self) -> float:
        """Idle share of all ranks over the whole step: 1 - busy / (ranks * makespan)."""
        return 1.0 - sum(self.busy) / (len(self.busy) * self.makespan) if self.makespan else 0.0


def simulate(schedule: list[list[Action]], forward_time: float = 1.0, backward_time: float = 2.0,
             weight_time: float | None = None, comm_time: float = 0.0, stage_times: dict | None = None) -> SimResult:
    """Execute all ranks' lists together under the module's execution contract.

    Times are for one micro-batch through a whole rank's share of the model; an action of one of
    v chunks takes 1/v of it. ``backward_time`` is the full backward: in a schedule with W
    actions, B takes ``backward_time - weight_time`` and W ``weight_time`` (default half), so
    split and unsplit schedules are compared at equal work. Sends cost the sender nothing and
    arrive ``comm_time`` later; a RECV blocks its rank until its message has arrived.
    ``stage_times`` ({(kind, virtual stage): seconds}, optional) gives an action its own duration
    instead (stages of unequal cost: the planner's predicted times, ``hpcpar.plan``).

    Raises ScheduleError when a receive gets a different micro-batch than it expects (channels
    are FIFO), a compute runs twice or on the wrong rank, or something is left unreceived or
    uncomputed; DeadlockError when no rank can move, with the grid and every stuck action.
    """
    return _Simulation(schedule, forward_time, backward_time, weight_time, comm_time, stage_times).run()


class _Simulation:
    """The state of ``simulate``: each rank's clock and position, what is done, what is in flight."""

    def __init__(self, schedule, forward_time, backward_time, weight_time, comm_time, stage_times=None):
        self.schedule, self.comm_time, self.stage_times = schedule, comm_time, stage_times or {}
        p = self.p = len(schedule)
        self.stages = 1 + max((a.stage for actions in schedule for a in actions), default=0)
        v = max(1, self.stages // p)
        self.split = any(a.kind == "W" for actions in schedule for a in actions)
        if weight_time is None:
            weight_time = backward_time / 2 if self.split else 0.0
        self.duration = {"F": forward_time / v, "W": weight_time / v,
                         "B": (backward_time - weight_time if self.split else backward_time) / v}
        self.clock = [0.0] * p
        self.position = [0] * p
        self.done: dict[tuple[str, int, int], float] = {}  # (kind, microbatch, stage) -> end time
        self.received: dict[tuple[str, int, int], float] = {}  # (F|B, microbatch, receiving stage) -> arrival
        self.channels: dict[tuple[int, int], deque] = {}  # (from stage, to stage) -> (kind, mb, arrival)
        self.timelines: list[list[tuple[float, float, Action]]] = [[] for _ in range(p)]

    def fail(self, cls, message: str):
        marks = {q: self.position[q] for q in range(self.p) if self.position[q] < len(self.schedule[q])}
        raise cls(f"{message}\n{format_grid(self.schedule, comms=True, marks=marks)}")

    def run(self) -> SimResult:
        schedule, position = self.schedule, self.position
        while True:
            progressed = False
            for r in range(self.p):
                while position[r] < len(schedule[r]) and self.step(r):
                    progressed = True
            if all(position[r] == len(schedule[r]) for r in range(self.p)):
                break
            if not progressed:
                stuck = "; ".join(f"rank {r} waits at {schedule[r][j]} (action {j} of its list)"
                                  for r, j in enumerate(position) if j < len(schedule[r]))
                self.fail(DeadlockError, f"pipeline schedule deadlocks: {stuck}")
        self.check_complete()
        busy = [sum(end - start for start, end, _ in line) for line in self.timelines]
        return SimResult(self.timelines, max(self.clock), busy)

    def step(self, r: int) -> bool:
        """Execute rank r's next action if it can run now; report whether it did."""
        a = self.schedule[r][self.position[r]]
        if a.kind not in KINDS:
            self.fail(ScheduleError, f"rank {r}: unknown action kind in {a}")
        if a.stage % self.p != r:
            self.fail(ScheduleError, f"rank {r}: {a} belongs to stage {a.stage}, held by rank {a.stage % self.p}")
        moved = self.compute(r, a) if a.is_compute else self.send(r, a) if a.kind in SENDS else self.receive(r, a)
        if moved:
            self.position[r] += 1
        return moved

    def input_ready(self, r: int, a: Action) -> float | None:
        """When the tensor that compute action ``a`` needs is available on rank r, or None."""
        i, s = a.microbatch, a.stage
        if a.kind == "W":
            return self.done.get(("B", i, s))
        own = self.done.get(("F", i, s)) if a.kind == "B" else 0.0
        source = s - 1 if a.kind == "F" else s + 1
        if own is None:
            return None
        if source < 0 or source >= self.stages:  # first stage's input / last stage's loss: local
            return own
        arrived = self.done.get((a.kind, i, source)) if source % self.p == r else self.received.get((a.kind, i, s))
        return None if arrived is None else max(own, arrived)

    def compute(self, r: int, a: Action) -> bool:
        ready = self.input_ready(r, a)
        if ready is None:
            return False
        if (a.kind, a.microbatch, a.stage) in self.done:
            self.fail(ScheduleError, f"rank {r}: {a} runs a second time")
        start = max(self.clock[r], ready)
        self.clock[r] = start + self.stage_times.get((a.kind, a.stage), self.duration[a.kind])
        self.done[(a.kind, a.microbatch, a.stage)] = self.clock[r]
        self.timelines[r].append((start, self.clock[r], a))
        return True

    def send(self, r: int, a: Action) -> bool:
        kind = SENDS[a.kind]
        if a.peer_stage != a.stage + (1 if kind == "F" else -1):
            self.fail(ScheduleError, f"rank {r}: {a} does not go to the neighbouring stage")
        if (kind, a.microbatch, a.stage) not in self.done:
            return False  # sends an output not computed yet: waits (a deadlock if never)
        self.channels.setdefault((a.stage, a.peer_stage), deque()).append(
            (kind, a.microbatch, self.clock[r] + self.comm_time))
        return True

    def receive(self, r: int, a: Action) -> bool:
        queue = self.channels.get((a.peer_stage, a.stage))
        if not queue:
            return False
        kind, microbatch, arrival = queue.popleft()
        if (kind, microbatch) != (RECVS[a.kind], a.microbatch):
            self.fail(ScheduleError, f"rank {r}: {a} does not match the send order; the next message "
                                     f"on channel s{a.peer_stage}->s{a.stage} is {kind}{microbatch}")
        self.received[(kind, a.microbatch, a.stage)] = arrival
        self.clock[r] = max(self.clock[r], arrival)
        return True

    def check_complete(self) -> None:
        leftover = [f"s{src}->s{dst}: {[f'{k}{i}' for k, i, _ in q]}" for (src, dst), q in self.channels.items() if q]
        if leftover:
            self.fail(ScheduleError, f"sends that no rank receives: {'; '.join(leftover)}")
        microbatches = 1 + max((i for _, i, _ in self.done), default=-1)
        needed = [(k, i, s) for k in ("F", "B", "W")[:2 + self.split]
                  for i in range(microbatches) for s in range(self.stages)]
        missing = [f"{k}{i}@s{s}" for k, i, s in needed if (k, i, s) not in self.done]
        if missing:
            self.fail(ScheduleError, f"compute actions missing from the schedule: {', '.join(missing)}")
