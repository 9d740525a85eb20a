"""Loading a checkpoint into any layout: each rank reads exactly the slabs it now holds.

The objects being loaded say what they need through the checkpoint protocol (``hpcpar.state``):
a ``LoadPlan`` of reads (key, global shape, slab) and what to do once all are in. A load is a
transaction over all ranks:

1. every file is checked against the manifest (presence, size, CRC-32; the ranks share the
   work): a missing shard would otherwise read silently as fill values;
2. every rank checks every read of its plans against the manifest (the tensor exists, its
   global shape matches) and, with ``strict``, that every model tensor lands on some rank;
3. every rank reads its slabs into host memory;
4. only when every rank got this far are the values assigned and the plans finished.

Any failure before step 4 raises the same ``CheckpointError`` on every rank and leaves the
model, the optimizer and every ``extra`` exactly as they were.

Reads go through ``index.h5``'s virtual datasets, so a rank that now holds rows 0..511 of a
tensor written as four column shards reads just that hyperslab and HDF5 stitches it; a slab
that is exactly a written piece (the same layout again) is read from its shard directly.
"""
from __future__ import annotations

import os

import h5py
import numpy as np

from .. import log
from ..state import Saved, checkpointable, slab_slices
from .manifest import INDEX, CheckpointError, list_steps, read_manifest, resolve_step_dir, step_dirname, verify_files

logger = log.get_logger(__name__)


def verify_collectively(step_dir: str, manifest: dict, comm) -> None:
    """Each rank checks a share of the files; all ranks raise the same error if any is bad."""
    names = sorted(manifest["files"])
    mine = names[comm.Get_rank()::comm.Get_size()]
    problems = sum(comm.allgather(verify_files(step_dir, manifest, mine)), [])
    if problems:
        raise CheckpointError("damaged checkpoint: " + "; ".join(problems))


def agree(comm, problems: list[str], what: str) -> None:
    """Raise on every rank when any rank found a problem (each named with its rank)."""
    everyone = comm.allgather(problems)
    found = [f"rank {rank}: {p}" for rank, mine in enumerate(everyone) for p in mine]
    if found:
        shown = "; ".join(found[:6]) + (f"; ... ({len(found) - 6} more)" if len(found) > 6 else "")
        raise CheckpointError(f"{what}: {shown}")


class _Source:
    """Where tensors are read from: a piece's own dataset in its shard file when this rank's
    slab is exactly a piece that was written (loading into the layout that saved), the index's
    virtual dataset otherwise (HDF5 stitches the slab from the pieces it overlaps)."""

    def __init__(self, step_dir: str, manifest: dict, index):
        self.step_dir, self.manifest, self.index = step_dir, manifest, index
        self.files: dict = {}

    def read(self, key: str, slab):
        table = self.manifest["tensors"][key]
        wanted = [list(map(int, bounds)) for bounds in slab]
        for piece in table["pieces"]:
            if piece["slab"] == wanted:  # the same piece: skip the virtual-dataset mapping
                return self._read_whole(piece, table["dtype"])
        return self.index[key][slab_slices(slab)]

    def _read_whole(self, piece: dict, dtype: str):
        """A written piece's dataset, through h5py's low-level API (a third of ``dataset[...]``'s overhead)."""
        out = np.empty(tuple(stop - start for start, stop in piece["slab"]), dtype=dtype)
        dataset = h5py.h5d.open(self._file(piece["file"]).id, piece["dataset"].encode())
        if dataset.shape != out.shape:
            raise CheckpointError(f"{os.path.join(self.step_dir, piece['file'])}: dataset {piece['dataset']} has "
                                  f"shape {dataset.shape}, the manifest says {out.shape}")
        if out.size:
            dataset.read(h5py.h5s.ALL, h5py.h5s.ALL, out)
        return out

    def _file(self, name: str):
        if name not in self.files:
            self.files[name] = h5py.File(os.path.join(self.step_dir, name), "r")
        return self.files[name]

    def close(self) -> None:
        for f in self.files.values():
            f.close()


def check_reads(reads, manifest: dict) -> list[str]:
    """What does not fit: a tensor the checkpoint lacks, or one of another global shape."""
    problems = []
    for read in reads:
        table = manifest["tensors"].get(read.key)
        if table is None:
            problems.append(f"the checkpoint has no tensor {read.key!r}")
        elif tuple(table["shape"]) != tuple(read.global_shape):
            problems.append(f"{read.key} has global shape {tuple(table['shape'])} in the checkpoint but "
                            f"{tuple(read.global_shape)} here")
    return problems


def unused_model_tensors(reads, manifest: dict, comm) -> list[str]:
    """Model tensors of the checkpoint that no rank reads (strict loading refuses them)."""
    loaded = set().union(*comm.allgather({r.key for r in reads if r.key.startswith("model/")}))
    return sorted(k for k in manifest["tensors"] if k.startswith("model/") and k not in loaded)


def _load_extra(manifest, extra, ctx) -> dict:
    values = {}
    same_layout = manifest["layout"] == ctx.layout
    mine = manifest["rank_state"].get(str(ctx.rank), {})
    for name, saved in manifest["extra"].items():
        if "value" in saved:
            values[name] = saved["value"]
        elif extra and name in extra:
            extra[name].load_state_dict(saved["state_dict"])
    for name, target in (extra or {}).items():
        if isinstance(target, np.random.Generator) and same_layout and name in mine:
            # Random streams belong to ranks: restored only when each rank is the same rank again.
            target.bit_generator.state = mine[name]
    return values


def load(path: str, model, optimizer, ctx, extra: dict | None = None, step: int | None = None,
         strict: bool = True) -> dict:
    """Load the checkpoint at ``path`` (a root: its ``latest``, or ``step``; or a step folder).

    ``model`` and ``optimizer`` are Checkpointables (``hpcpar.state``: a Module, a pipeline, an
    optimizer, ZeRO-1, a parameter server) or (name, parameter) pairs; ``optimizer`` may be None.
    Returns ``{"step", "step_dir", "layout", "extra"}`` (``extra``: the plain JSON values).
    Collective over ``ctx.world``; every rank raises the same CheckpointError, and then nothing
    has changed.
    """
    comm = ctx.world.mpi
    step_dir = resolve_step_dir(path, step)
    manifest = read_manifest(step_dir)
    what = f"loading {step_dir}"
    verify_collectively(step_dir, manifest, comm)
    saved = Saved(manifest["tensors"], manifest["scalars"])
    plan = checkpointable(model).load_plan(saved)
    if optimizer is not None:
        plan.extend(checkpointable(optimizer).load_plan(saved))
    problems = check_reads(plan.reads, manifest)
    unused = unused_model_tensors(plan.reads, manifest, comm) if strict else []
    if unused and comm.Get_rank() == 0:
        problems.append(f"tensors no rank of this model takes: {unused[:5]}{' ...' if len(unused) > 5 else ''} "
                        f"(pass strict=False to ignore)")
    agree(comm, problems, what)
    values, problems = [], []
    with h5py.File(os.path.join(step_dir, INDEX), "r") as index:
        source = _Source(step_dir, manifest, index)
        try:
            values = [source.read(read.key, read.slab) for read in plan.reads]
        except (OSError, ValueError, KeyError, CheckpointError) as error:
            problems.append(f"{type(error).__name__}: {error}")
        finally:
            source.close()
    agree(comm, problems, what)
    for read, value in zip(plan.reads, values):  # the point of no return: every rank has every value
        read.assign(value)
    for finish in plan.finish:
        finish()
    values = _load_extra(manifest, extra, ctx)
    return {"step": manifest["step"], "step_dir": step_dir, "layout": manifest["layout"], "extra": values}


def load_latest(root: str, model, optimizer, ctx, extra: dict | None = None, strict: bool = True) -> dict | None:
    """Load the newest checkpoint under ``root`` that verifies; None when there is none.

    A damaged newest checkpoint is reported (a warning) and the next older one is tried.
    """
    for step in reversed(list_steps(root)):
        try:
            return load(os.path.join(root, step_dirname(step)), model, optimizer, ctx, extra, strict=strict)
        except CheckpointError as error:
            logger.warning(f"skipping checkpoint step {step}: {error}")
    return None
