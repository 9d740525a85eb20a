"""The pipeline schedules the planner reads, built once per (name, p, m, v): planning tries many
layouts, and a schedule of hundreds of micro-batches takes milliseconds to build. Built by the
engine's own ``make_schedule``, so the planner sees the actions each rank runs."""
from __future__ import annotations

import functools

from ..parallel.pipeline.schedules import make_schedule, peak_activations


@functools.lru_cache(maxsize=256)
def schedule_of(name: str, p: int, m: int, v: int) -> tuple:
    """The schedule's action lists, one tuple per pipeline rank."""
    return tuple(tuple(actions) for actions in make_schedule(name, p, m, v))


@functools.lru_cache(maxsize=256)
def peaks_of(name: str, p: int, m: int, v: int) -> tuple:
    """Per pipeline rank, the (micro-batch, virtual stage) activations it holds at once (to W for ZB-H1)."""
    return tuple(peak_activations([list(a) for a in schedule_of(name, p, m, v)], held_until="W"))


def in_flight(plan) -> list[int]:
    """Per pipeline rank of ``plan`` (a StepPlan), the (micro-batch, virtual stage) activations held
    at once under the schedule."""
    lay = plan.layout
    if lay.pp == 1:
        return [1]
    return list(peaks_of(lay.schedule, lay.pp, lay.micro_batches, lay.chunks))
