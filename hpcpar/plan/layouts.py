"""Every layout of a world for a job, predicted and ranked; and why the others are excluded.

A candidate is a factorisation of the world into the grid's axes (cp included: valid where the
block size divides by 2 cp) with, for pp > 1, each schedule hpcpar has (``gpipe``, ``1f1b``,
``interleaved`` with each chunk count that splits the layers evenly, ``zb1``), the job's stage
cut and Megatron's (``blocks``, a GPT), a few micro-batch counts, with and without sequence
parallelism when tp > 1, each ZeRO stage 0-3 when dp x cp > 1 (without compression), and for an
MoE GPT each ep dividing dp and the experts; the job's own checks (``train.validate``) decide
what is valid. Recomputation and, without a pipeline, accumulation only buy memory: a layout is
predicted with the first that fits of no recomputation, selective, full (GPT), each with 1, 2,
4 ... micro-batches (labelled ``rc=...``, ``m...``); one that fits in none is kept, marked as not
fitting, ranked last.
"""
from __future__ import annotations

import difflib
import itertools
import time
from dataclasses import dataclass, replace

from ..nn.gpt import RECOMPUTE
from ..runtime.grid import GRID
from ..train.config import JobError
from ..train.validate import validate
from .machine import Machine
from .predict import Prediction, StepPlan

SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb1")


@dataclass
class Ranked:
    predictions: list  # fitting first, each group by step time
    excluded: list  # [(label, reason)]
    seconds: float  # how long planning took
    fits: dict  # id(prediction) -> bool


def candidates(job, world: int) -> list:
    """A job for every layout tried."""
    p = job.parallel
    out = []
    for mesh in GRID.factorisations(world):
        pp, tp = mesh.size("pp"), mesh.size("tp")
        # ZeRO's stages where there are dp x cp ranks to shard over and no compressor (validation drops
        # the modes that have no ZeRO)
        zeros = (0, 1, 2, 3) if mesh.size("dp") * mesh.size("cp") > 1 and p.compression == "none" else (p.zero,)
        cuts = [p.partition] + (["blocks"] if pp > 1 and job.model.kind == "gpt" and p.partition != "blocks" else [])
        for (schedule, chunks), m, sp, zero, ep, cut in itertools.product(
                schedules_of(job, pp), micro_batch_counts(job, mesh), (False, True) if tp > 1 else (False,), zeros,
                expert_parallelisms(job, mesh), cuts):
            parallel = replace(p, **mesh.by_name(), schedule=schedule, micro_batches=m, chunks=chunks,
                               sequence_parallel=sp, zero=zero, ep=ep, partition=cut)
            out.append(replace(job, parallel=parallel))
    return out


def schedules_of(job, pp: int) -> list[tuple[str, int]]:
    """(schedule, chunks) tried at ``pp``: each schedule, the interleaved one with every chunk count
    v >= 2 whose pp x v stages split the model's layers evenly (Megatron's virtual stages)."""
    if pp == 1:
        return [("1f1b", 1)]
    layers = getattr(job.model, "n_layer", 0)
    chunks = [v for v in range(2, layers // pp + 1) if layers % (pp * v) == 0] or [2]
    return [(schedule, v) for schedule in SCHEDULES for v in (chunks if schedule == "interleaved" else [1])]


def micro_batch_counts(job, mesh) -> list[int]:
    """Micro-batch counts tried on ``mesh``. With a pipeline: the job's (at least pp), 2 pp and 4 pp,
    enough to see the bubble shrink, the last two where they divide a replica's share of the global
    batch. Without one: 1, which ``_fitting`` raises where memory asks (there accumulation, like
    recomputation, only trades time for activation memory)."""
    pp = mesh.size("pp")
    if pp == 1:
        return [1]
    share = share_of(job, mesh.size("dp"))
    return sorted({max(job.parallel.micro_batches, pp)} | {m for m in (2 * pp, 4 * pp) if share % m == 0})


def share_of(job, replicas: int) -> int:
    """Sequences each of ``replicas`` gets of the global batch (0 when it does not split evenly)."""
    return job.data.batch_size // replicas if job.data.batch_size % replicas == 0 else 0


def expert_parallelisms(job, mesh) -> tuple:
    """The ep tried on ``mesh``: for an MoE GPT every divisor of dp that divides the experts (ep = 1
    alone under cp > 1, which MoE refuses: the ep = 1 variants say so); else the job's."""
    experts, dp = job.moe.experts if job.model.kind == "gpt" else 0, mesh.size("dp")
    if not experts:
        return (job.parallel.ep,)
    return tuple(ep for ep in range(1, dp + 1)
                 if dp % ep == 0 and experts % ep == 0 and (ep == 1 or mesh.size("cp") == 1))


def label_of(job) -> str:
    from .predict import Layout

    text = Layout.of(job).label()
    recompute = getattr(job.model, "recompute", "none")
    return text + (f" rc={recompute}" if recompute != "none" else "")


def plan_layouts(job, world: int, machine: Machine, fixed=(), keep_recompute: bool = False) -> Ranked:
    """Predict every valid candidate layout of ``world`` ranks; rank them. ``fixed``: ``parallel``
    keys whose values the candidates keep from ``job``; ``keep_recompute``: ``model.recompute`` too."""
    start = time.perf_counter()
    predictions, excluded, fits = [], [], {}
    seen = set()
    for variant in candidates(job, world):
        if any(getattr(variant.parallel, key) != getattr(job.parallel, key) for key in fixed):
            continue
        name = label_of(variant)
        if name in seen:
            continue
        seen.add(name)
        try:
            valid = validate(variant, world)
        except JobError as error:
            excluded.append((name, "; ".join(text for _, text in error.problems)))
            continue
        prediction, fit = _fitting(valid, machine, world, keep_recompute)
        fits[id(prediction)] = fit
        predictions.append(prediction)
    predictions.sort(key=lambda q: (not fits[id(q)], q.step_s))
    return Ranked(predictions, excluded, time.perf_counter() - start, fits)


def _fitting(job, machine: Machine, world: int, keep_recompute: bool = False) -> tuple[Prediction, bool]:
    """The prediction of the first variant that fits of: no recomputation, then selective, then full
    (a GPT: the job's own mode is one of them, not a floor; other models keep theirs), each without
    a pipeline with 1, 2, 4 ... micro-batches dividing a replica's share of the batch (the fewest
    first: accumulation costs time, and under ZeRO-2/3 holds the gradients whole). None fits: the
    last one, marked so."""
    limit = machine.memory_per_rank(min(world, machine.ranks_per_node))
    modes = RECOMPUTE if job.model.kind == "gpt" and not keep_recompute else (job.model.recompute,)
    for variant in _memory_variants(job, modes, world):  # memory first: it needs no simulation
        plan = StepPlan(variant, machine)
        if plan.memory().total <= limit:
            break
    prediction = plan.predict()
    prediction.label = label_of(variant)
    return prediction, prediction.memory.total <= limit


def _memory_variants(job, modes, world: int):
    """``job`` with each recomputation mode and, without a pipeline, each valid accumulation count."""
    p = job.parallel
    share = share_of(job, p.dp) if p.pp == 1 else 0  # cp splits sequences, not the batch
    counts = [m for m in range(1, share + 1) if share % m == 0 and m & (m - 1) == 0] if share else [p.micro_batches]
    for mode in modes:
        for m in counts:
            variant = replace(job, model=replace(job.model, recompute=mode), parallel=replace(p, micro_batches=m))
            if m == p.micro_batches:
                yield variant
                continue
            try:
                yield validate(variant, world)
            except JobError:
                continue


def find(ranked: Ranked, wanted: str) -> Prediction | None:
    """The prediction labelled ``wanted`` exactly (spaces between its words as in the table), or None."""
    wanted = " ".join(wanted.split())
    return next((q for q in ranked.predictions if q.label == wanted), None)


def not_found(ranked: Ranked, wanted: str, world: int) -> str:
    """Why ``wanted`` has no prediction: the reason it was excluded, or the labels it may have
    meant (the closest spellings among those of its grid, else among all)."""
    wanted = " ".join(wanted.split())
    reason = next((why for label, why in ranked.excluded if label == wanted), None)
    if reason is not None:
        return f"layout {wanted!r} is excluded for {world} ranks: {reason}"
    labels = [q.label for q in ranked.predictions]
    grid = wanted.split()[0] if wanted else ""
    same_grid = [label for label in labels if label.split()[0] == grid]
    near = difflib.get_close_matches(wanted, same_grid or labels, n=3, cutoff=0.0 if same_grid else 0.5)
    hint = f"; did you mean {' or '.join(repr(label) for label in near)}?" if near else "; the table lists them"
    return f"no layout {wanted!r} among the {len(labels)} planned for {world} ranks{hint}"
