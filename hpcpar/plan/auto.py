"""``parallel.layout = "auto"``: the planner picks the layout a job trains in.

    job, lines = choose(job, world, machine)   # the fastest fitting layout; why, in a few lines
    job = planned_job(job, world, "dgx-a100")  # the same from a machine file's path or name, printed

Every layout key the job gives (in its file or by ``--set``) is kept; the planner chooses the
others among the candidates ``hpcpar plan`` ranks (``layouts``), the fastest one that fits the
machine's memory per rank, with its recomputation. Every rank plans alike (the same job, machine
file and code), so they agree without a message.
"""
from __future__ import annotations

import os
from dataclasses import replace

from .. import log
from ..tables import human_bytes
from ..train.config import JobError
from ..train.validate import validate
from .layouts import plan_layouts
from .machine import DEFAULT_MACHINE, MachineError, load_machine, shipped
from .predict import unmodelled

LAYOUT_KEYS = ("dp", "pp", "tp", "cp", "ep", "schedule", "micro_batches", "chunks", "partition", "sequence_parallel",
               "zero")


def choose(job, world: int, machine) -> tuple:
    """(the job in the layout the planner picks, the lines that say which and why); JobError when
    the job is one the planner does not model or no layout fits."""
    why = unmodelled(job)
    if why:
        raise JobError(job.source, [("parallel.layout", f"layout = \"auto\" plans with hpcpar plan, which "
                                                        f"cannot: {why}")])
    fixed = [key for key in LAYOUT_KEYS if f"parallel.{key}" in job.given]
    ranked = plan_layouts(job, world, machine, fixed=fixed, keep_recompute="model.recompute" in job.given)
    fitting = [q for q in ranked.predictions if ranked.fits[id(q)]]
    if not fitting:
        limit = machine.memory_per_rank(min(world, machine.ranks_per_node)) / 2**30
        raise JobError(job.source, [("parallel.layout", f"no layout of {world} ranks fits {limit:.1f} GiB per rank "
                                                        f"on {machine.name} (keeping {', '.join(fixed) or 'nothing'})")])
    best = fitting[0]
    chosen = replace(best.job, parallel=replace(best.job.parallel, layout="auto"))
    return chosen, _lines(best, fitting[1] if len(fitting) > 1 else None, len(ranked.predictions), fixed, machine)


def _lines(best, runner_up, planned: int, fixed: list, machine) -> list[str]:
    kept = f", keeping {', '.join(fixed)}" if fixed else ""
    lines = [f"layout auto: {best.label} of {planned} layouts planned on {machine.name}{kept}: "
             f"predicted step {best.step_s * 1e3:.2f} ms, {human_bytes(best.memory.total)} per rank"]
    lines.append(f"  its step: exposed communication {best.comm_share:.0%}, bubble {best.bubble_share:.0%}, "
                 f"the rest compute")
    if runner_up is not None:
        lines.append(f"  runner-up: {runner_up.label}, predicted {runner_up.step_s * 1e3:.2f} ms "
                     f"({runner_up.step_s / best.step_s - 1:+.1%})")
    return lines


def planned_job(job, world: int, machine_path: str | None):
    """``job`` (``parallel.layout = "auto"``) in the layout ``choose`` picks on the machine file
    ``machine_path`` (a path or a shipped name; None: ``runs/plan/machine.toml``), validated; rank 0
    prints why. JobError when there is no machine file or it is unreadable."""
    path = machine_path or DEFAULT_MACHINE
    if path not in shipped() and not os.path.exists(path):
        raise JobError(job.source, [("parallel.layout", f"layout = \"auto\" needs a machine file: there is no {path}; "
                                                        f"run `hpcpar plan calibrate` first, or pass --machine "
                                                        f"({', '.join(shipped())} or a file)")])
    try:
        machine = load_machine(path)
    except MachineError as error:
        raise JobError(job.source, [("parallel.layout", str(error))]) from None
    chosen, lines = choose(job, world, machine)
    if log.world_rank() == 0:
        print("\n".join(lines), flush=True)
    return validate(chosen, world)
