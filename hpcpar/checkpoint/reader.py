"""Loading a checkpoint into any layout, as a transaction over all ranks: each rank reads exactly
the slabs it now holds.

The objects being loaded say what they need through the checkpoint protocol (``hpcpar.state``):
a ``LoadPlan`` of reads (key, global shape, slab, dtype) and what to do once all are in. Every
rank first checks every read against the manifest (a mismatch is a ``CheckpointError``) and the
files it needs; then reads its pieces into host memory or straight into the destinations that
offer themselves, checking every MiB against its CRC-32 (damage is a ``CheckpointDamaged``, on
which ``load_latest`` tries the previous step); only when every rank got that far are the values
assigned and the plans finished. A failure on any rank is the same error on every rank and
leaves the model, the optimizer and every ``extra`` as they were.

The bytes (mapping, checking, copying) are ``source``'s; this module runs the transaction.
docs/architecture.md has the order of the checks and the copies, and why.
"""
from __future__ import annotations

import contextlib
import functools
import gc
import os

import numpy as np

from .. import log
from ..state import Saved, checkpointable
from .manifest import (CheckpointDamaged, CheckpointError, latest_step, list_steps, read_manifest, resolve_step_dir,
                       step_dirname, verify_files)
from .fastcopy import copy_arrays
from .source import RawSource, verifier_chunks
from .upcycle import upcycled

logger = log.get_logger(__name__)


def check_reads(reads, manifest: dict) -> list[str]:
    """What does not fit: a tensor the checkpoint lacks, another global shape or dtype, a slab outside it."""
    problems, tensors = [], manifest["tensors"]
    for read in reads:
        table = tensors.get(read.key)
        if table is None:
            problems.append(f"the checkpoint has no tensor {read.key!r}")
        elif list(read.global_shape) != table["shape"]:
            problems.append(f"{read.key} has global shape {tuple(table['shape'])} in the checkpoint but "
                            f"{tuple(read.global_shape)} here")
        elif read.dtype is not None and number_kind(table["dtype"]) != number_kind(read.dtype):
            problems.append(f"{read.key} is {table['dtype']} in the checkpoint but {np.dtype(read.dtype)} here")
        elif not slab_inside(read.slab, table["shape"]):
            problems.append(f"{read.key}: this rank's slab {[list(s) for s in read.slab]} is not inside its "
                            f"global shape {tuple(table['shape'])}")
    return problems


def slab_inside(slab, shape: list) -> bool:
    """Whether ``slab`` has an axis per axis of ``shape`` and lies inside it (a loop, not a
    generator: a load asks this for each tensor it reads)."""
    if len(slab) != len(shape):
        return False
    for (a, b), n in zip(slab, shape):
        if not 0 <= a <= b <= n:
            return False
    return True


@functools.lru_cache(maxsize=256)
def number_kind(dtype) -> str:
    """"float", "integer" or "bool": a load may change the precision (float32 masters into
    bfloat16 working copies, a float64 run into a float32 model for sampling), never the kind."""
    dtype = np.dtype(dtype)
    if dtype.kind in "fc" or (dtype.kind == "V" and "float" in dtype.name):  # ml_dtypes' bfloat16 is kind V
        return "float"
    return {"i": "integer", "u": "integer", "b": "bool"}.get(dtype.kind, dtype.name)


def restore_extra(manifest: dict, extra: dict | None, ctx) -> tuple[dict, list]:
    """Restore the ``extra`` states (all of them or, on an error, none): (the plain JSON values,
    [(object, its state before)] to put back if the load fails later)."""
    values, restored = {}, []
    try:
        for name, saved in manifest["extra"].items():
            if "value" in saved:
                values[name] = saved["value"]
            elif extra and name in extra:
                before = extra[name].state_dict()
                restored.append((extra[name], before))
                extra[name].load_state_dict(saved["state_dict"])
    except Exception:
        for target, before in reversed(restored):  # back to how they were, then the error
            target.load_state_dict(before)
        raise
    return values, restored


def restore_streams(manifest: dict, extra: dict | None, ctx) -> None:
    """Random streams belong to ranks: restored only when each rank is the same rank again."""
    mine = manifest["rank_state"].get(str(ctx.rank), {})
    if manifest["layout"] != ctx.layout:
        return
    for name, target in (extra or {}).items():
        if isinstance(target, np.random.Generator) and name in mine:
            target.bit_generator.state = mine[name]


def load(path: str, model, optimizer, ctx, extra: dict | None = None, step: int | None = None,
         strict: bool = True, upcycle=None) -> dict:
    """Load the checkpoint at ``path`` (a root: the step ``latest`` names, or ``step``; or a step folder).

    ``model`` and ``optimizer`` are Checkpointables (``hpcpar.state``: a Module, a pipeline, an
    optimizer, ZeRO-1, a parameter server) or (name, parameter) pairs; ``optimizer`` may be None.
    Returns ``{"step", "step_dir", "layout", "extra"}`` (``extra``: the plain JSON values).
    Collective over ``ctx.world`` (three all-gathers, none on one rank); every rank raises the
    same error, and then nothing has changed: ``CheckpointDamaged`` for damaged files,
    ``CheckpointError`` for a checkpoint that does not fit (names, shapes, dtypes, slabs).
    ``upcycle(key)``, for a weights-only load into an MoE model: dense MLPs become its experts,
    and the tensors it accepts stay as initialised when the checkpoint lacks them
    (``upcycle.upcycled``; the counts in ``"upcycled"``).
    """
    with collector_paused():
        return load_step(rank0_says(ctx, resolve_step_dir, path, step), model, optimizer, ctx, extra, strict, upcycle)


def rank0_says(ctx, function, *args):
    """``function(*args)`` as rank 0 of ``ctx.world`` finds it, on every rank (its CheckpointError
    too). Which step folder a root's ``latest`` names is one answer for the whole load: ranks on
    other nodes can see another ``latest``, or none (a node-local folder), and a rank that went
    its own way (another step, or an error alone) would leave the others waiting in the load's
    all-gathers forever. A step folder a rank lacks is then damage that every rank hears of."""
    answer = error = None
    if ctx.world.rank == 0:
        try:
            answer = function(*args)
        except CheckpointError as exc:
            error = exc
    if ctx.world.size > 1:
        answer, error = ctx.world.bcast_object((answer, error), root=0)
    if error is not None:
        raise error
    return answer


@contextlib.contextmanager
def collector_paused():
    """Python's cyclic garbage collector off for the duration, then as it was: a load makes
    thousands of small containers (the manifest, the plan), none in a cycle, and each collection
    they would trigger walks every object of the process, the model's included (1-2 ms a load)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def load_step(step_dir: str, model, optimizer, ctx, extra: dict | None, strict: bool, upcycle=None) -> dict:
    """``load`` of one step folder."""
    comm = ctx.world.mpi
    what = f"loading {step_dir}"
    plan, source, found = plan_load(step_dir, model, optimizer, comm, upcycle)
    alone = comm.Get_size() == 1  # one rank agrees with itself: no all-gathers (and no pickling)
    everyone = [found] if alone else comm.allgather(found)  # 1: what each rank found before reading a byte
    for kind, error in (("damaged", CheckpointDamaged), ("mismatch", CheckpointError)):
        raise_if_any([mine[kind] for mine in everyone], what, error)
    manifest = source.manifest
    if strict:
        unused = unused_model_keys(manifest, [mine["model_keys"] for mine in everyone])
        if unused:
            raise CheckpointError(f"{what}: tensors no rank of this model takes: {unused[:5]}"
                                  f"{' ...' if len(unused) > 5 else ''} (pass strict=False to ignore)")
    refused, extras, restored = [], {}, []
    try:  # the mappings and HDF5 files stay open until the checked bytes are in their places
        damaged, values = read_checked(source, plan, verifier_chunks([mine["runs"] for mine in everyone],
                                                                     comm.Get_rank()))
        if not damaged:
            try:  # the extras before the point of no return: they can refuse a state, and are put back
                extras, restored = restore_extra(manifest, extra, ctx)
            except Exception as error:  # noqa: BLE001 - every rank raises below
                refused.append(f"restoring the extra state: {type(error).__name__}: {error}")
        # 2: every rank has every value, or none goes in
        everyone = [(damaged, refused)] if alone else comm.allgather((damaged, refused))
        if any(d or r for d, r in everyone):
            for target, before in reversed(restored):
                target.load_state_dict(before)
            raise_if_any([d for d, _ in everyone], what, CheckpointDamaged)
            raise_if_any([r for _, r in everyone], what, CheckpointError)
        failed = source.fill_targets()  # the point of no return: the checked bytes, into their places
    finally:
        source.close()
    # 3: a file cut short since its check (another process writing it) is damage on every rank: a
    # rank that raised alone would try an older step, or stop, while the others went on without it
    failed = [failed] if alone else comm.allgather(failed)
    raise_if_any([[f"{problem} (the model is partly loaded: load again)" for problem in mine] for mine in failed],
                 what, CheckpointDamaged)
    for read, value in zip(plan.reads, values):
        if value is not None:
            read.assign(value)
    copy_arrays(plan.copies)
    for finish in plan.finish:
        finish()
    restore_streams(manifest, extra, ctx)
    return {"step": manifest["step"], "step_dir": step_dir, "layout": manifest["layout"], "extra": extras,
            **({"upcycled": found["upcycled"]} if upcycle is not None else {})}


def read_checked(source: RawSource, plan, mine: dict) -> tuple[list[str], list]:
    """(damage found, the values of the plan's reads: None for those filled at commit) after
    checking the chunks in ``mine``; no values when anything is damaged."""
    damaged, values = [], []
    try:
        damaged = source.read_and_verify(mine)
        if not damaged:
            values = source.read_all(plan.reads)
    except (OSError, ValueError, KeyError) as error:
        damaged.append(f"{type(error).__name__}: {error}")
    return damaged, values


def plan_load(step_dir: str, model, optimizer, comm, upcycle=None) -> tuple:
    """(load plan, RawSource, what this rank found: damage, mismatches, the model tensors it
    does not read, the MiBs it will read) before reading any tensor."""
    rank, size = comm.Get_rank(), comm.Get_size()
    found = {"damaged": [], "mismatch": [], "model_keys": ("read", []), "runs": {}}
    try:
        manifest = read_manifest(step_dir)
    except CheckpointError as error:  # reported by every rank after the first all-gather, never alone
        found["damaged" if isinstance(error, CheckpointDamaged) else "mismatch"].append(str(error))
        return None, None, found
    saved = Saved(manifest["tensors"], manifest["scalars"])
    plan = checkpointable(model).load_plan(saved)
    if optimizer is not None:
        plan.extend(checkpointable(optimizer).load_plan(saved))
    if upcycle is not None:
        plan, found["upcycled"] = upcycled(plan, manifest["tensors"], upcycle)
    found["mismatch"] = check_reads(plan.reads, manifest)
    if found["mismatch"]:
        return plan, None, found
    found["model_keys"] = model_keys_taken(manifest, plan.reads)
    source = RawSource(step_dir, manifest, plan.reads)
    names = sorted(manifest["files"])
    # Presence and size of every file (a share each) and of those this rank reads; the full
    # checksum of the files read through h5py (format 1, collective saves: one CRC-32 each).
    problems = verify_files(step_dir, manifest, set(names[rank::size]) | set(source.needed), checksums=False)
    problems += verify_files(step_dir, manifest, source.legacy)
    found["damaged"] = problems
    found["runs"] = source.chunk_runs()
    return plan, source, found


def model_keys_taken(manifest: dict, reads) -> tuple[str, list]:
    """The checkpoint's model tensors this rank reads, for the first all-gather, in the shorter
    of two forms: ("unread", those it does not read: none for a replica, a tensor-parallel
    shard) or ("read", those it reads: a pipeline stage's)."""
    taken = {read.key for read in reads}
    model = [key for key in manifest["tensors"] if key.startswith("model/")]
    unread = [key for key in model if key not in taken]
    return ("unread", unread) if 2 * len(unread) <= len(model) else ("read", [k for k in model if k in taken])


def unused_model_keys(manifest: dict, everyone: list) -> list[str]:
    """The checkpoint's model tensors no rank reads (``model_keys_taken`` of every rank), sorted."""
    model = {key for key in manifest["tensors"] if key.startswith("model/")}
    loaded: set = set()
    for form, keys in everyone:
        loaded |= set(keys) if form == "read" else model.difference(keys)
    return sorted(model - loaded)


def raise_if_any(everyone: list, what: str, error) -> None:
    """Raise ``error`` naming each problem once, with the ranks that found it, when any rank found one."""
    ranks: dict = {}
    for rank, mine in enumerate(everyone):
        for problem in mine:
            ranks.setdefault(problem, []).append(rank)
    if ranks:
        found = [f"{problem} (rank{'s' if len(r) > 1 else ''} {', '.join(map(str, r))})" for problem, r in ranks.items()]
        shown = "; ".join(found[:6]) + (f"; ... ({len(found) - 6} more)" if len(found) > 6 else "")
        raise error(f"{what}: {shown}")


def load_latest(root: str, model, optimizer, ctx, extra: dict | None = None, strict: bool = True) -> dict | None:
    """Load the step ``latest`` names under ``root``; None when there is no committed step.

    ``latest`` is the source of truth: steps above it (another run's, left in the folder) are
    never loaded. A damaged step (``CheckpointDamaged``) is reported and the next older one is
    tried; any other error (a checkpoint that does not fit the model) is raised.
    """
    for step in rank0_says(ctx, steps_to_try, root):  # every rank tries the same steps in the same order
        try:
            with collector_paused():
                return load_step(os.path.join(root, step_dirname(step)), model, optimizer, ctx, extra, strict)
        except CheckpointDamaged as error:
            logger.warning(f"skipping damaged checkpoint step {step}: {error}")
    return None


def steps_to_try(root: str) -> list[int]:
    """The steps ``load_latest`` tries, in order: the one ``latest`` names, then the older ones."""
    newest = latest_step(root)
    if newest is None:
        return []
    above = [s for s in list_steps(root) if s > newest]
    if above:
        logger.warning(f"{root}: ignoring steps {above} above the one 'latest' names ({newest})")
    order = []
    for step in [newest] + [s for s in reversed(list_steps(root)) if s < newest]:
        if os.path.isdir(os.path.join(root, step_dirname(step))):
            order.append(step)
        else:
            logger.warning(f"skipping checkpoint step {step}: 'latest' names it but {root} has no such folder")
    return order
