"""One pipeline training step's state, made afresh by every ``train_step``: the micro-batches,
what F saved for B, the tensors in transit, the step's stage channel, and its timings."""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from .channel import StageChannel
from .schedules import theoretical_bubble


@dataclass
class StepState:
    channel: StageChannel
    inputs: list | None  # micro-batches (first stage)
    targets: list | None  # micro-batches (last stage)
    saved: dict = field(default_factory=dict)  # (micro-batch, stage) -> (input Tensor, output Tensor or loss)
    weights: dict = field(default_factory=dict)  # (micro-batch, stage) -> weight gradients its W computes (zb1)
    # Tensors from one stage to the next, keyed (direction "F" or "B", micro-batch, receiving stage):
    # handed over in memory when both stages are on this rank, else waiting for their SEND.
    handover: dict = field(default_factory=dict)
    recvs: dict = field(default_factory=dict)  # (direction, micro-batch, receiving stage) -> (handle, dtype)
    loss: object = 0.0  # the last stage's loss, summed on the device
    idle: float = 0.0  # seconds waiting for a neighbour (the bubble)
    peak: int = 0  # most micro-batches saved for backward at once
    by_kind: dict = field(default_factory=lambda: {kind: 0.0 for kind in ("F", "B", "W")})  # compute seconds
    trace: list = field(default_factory=list)  # (action, start, end)
    start: float = field(default_factory=time.perf_counter)
    stats: dict = field(default_factory=dict)

    def take(self, key):
        """Wait for the receive feeding ``key`` (timed as idle: the bubble) and return the array."""
        handle, dtype = self.recvs.pop(key)
        start = time.perf_counter()
        array = handle.wait()
        self.idle += time.perf_counter() - start
        return array.astype(dtype, copy=False)

    def record(self, action, start: float, end: float, idle_before: float) -> None:
        """An action's span; a compute's seconds less its wait for input, which is idle time."""
        if action.kind in self.by_kind:
            self.by_kind[action.kind] += end - start - (self.idle - idle_before)
        self.trace.append((str(action), start, end))
        self.peak = max(self.peak, len(self.saved))

    def finish(self, comm_start: float, send_wait: float, p2p_seconds: float, p: int, m: int, v: int) -> None:
        """Close the trace with the step's SYNC span and fill ``stats``."""
        end = time.perf_counter()
        self.trace.append(("SYNC", comm_start, end))
        step = end - self.start
        communication = (end - comm_start) + (comm_start - send_wait) + p2p_seconds - self.idle
        self.stats = {"step_s": step, "compute_s": sum(self.by_kind.values()), "idle_s": self.idle,
                      "comm_s": max(0.0, communication), "bubble": self.idle / step if step else 0.0,
                      "theoretical_bubble": theoretical_bubble(p, m, v), "peak_activations": self.peak,
                      "step_start": self.start, "compute_by_kind": self.by_kind}


def share_loss(ctx, loss, xp):
    """The last stage's loss on every pipeline rank: a 0-d array on the device (all-reduced over
    pp, a one-element buffer, when there are several stages)."""
    value = xp.zeros(1, dtype=np.float64)
    if ctx.is_last_stage:
        value += loss
    return (ctx.pp.allreduce(value, "sum") if ctx.pp_size > 1 else value)[0]


def split(batch, m: int, what: str) -> list:
    if batch is None:
        raise ValueError(f"train_step: {what} are needed on this stage")
    if len(batch) % m:
        raise ValueError(f"train_step: a batch of {len(batch)} {what} does not split into {m} micro-batches")
    size = len(batch) // m
    return [batch[k * size: (k + 1) * size] for k in range(m)]
