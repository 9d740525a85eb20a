"""Loading a checkpoint into any layout: each rank reads exactly the slabs it now holds.

Reads go through ``index.h5``'s virtual datasets, so a rank that now holds rows 0..511 of a
tensor written as four column shards reads just that hyperslab and HDF5 stitches it; a slab
that is exactly a written piece (the same layout again) is read from its shard directly. Before
anything is read, every file is checked against the manifest (presence, size, CRC-32; the
ranks share the work): a missing shard would otherwise read silently as fill values.
"""
from __future__ import annotations

import os

import h5py
import numpy as np

from ..backend import to_device
from .manifest import INDEX, CheckpointError, list_steps, read_manifest, resolve_step_dir, step_dirname, verify_files
from .pieces import global_slab, saved_weight_decays, slab_slices, zero_param_slabs


def verify_collectively(step_dir: str, manifest: dict, comm) -> None:
    """Each rank checks a share of the files; all ranks raise the same error if any is bad."""
    names = sorted(manifest["files"])
    mine = names[comm.Get_rank()::comm.Get_size()]
    problems = sum(comm.allgather(verify_files(step_dir, manifest, mine)), [])
    if problems:
        raise CheckpointError("damaged checkpoint: " + "; ".join(problems))


class _Source:
    """Where tensors are read from: a piece's own dataset in its shard file when this rank's
    slab is exactly a piece that was written (loading into the layout that saved), the index's
    virtual dataset otherwise (HDF5 stitches the slab from the pieces it overlaps)."""

    def __init__(self, step_dir: str, manifest: dict, index):
        self.step_dir, self.manifest, self.index = step_dir, manifest, index
        self.files: dict = {}

    def read(self, key: str, shape: tuple, slab, what: str):
        table = self.manifest["tensors"].get(key)
        if table is None:
            raise CheckpointError(f"{what}: the checkpoint has no tensor {key!r}")
        if tuple(table["shape"]) != tuple(shape):
            raise CheckpointError(f"{what}: {key} has global shape {tuple(table['shape'])} in the checkpoint "
                                  f"but {tuple(shape)} here")
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


def _load_model(source, named, what):
    for name, param in named:
        shape, slab = global_slab(param)
        param.data[...] = to_device(source.read(f"model/{name}", shape, slab, what), param.xp)


def _state_keys(manifest, name) -> list[str]:
    prefix = f"optim/{name}/"
    return sorted({k[len(prefix):] for k in list(manifest["tensors"]) + list(manifest["scalars"]) if k.startswith(prefix)})


def _load_optimizer(source, optimizer, named, what):
    from ..parallel.zero import ZeroRedundancyOptimizer

    manifest = source.manifest
    if isinstance(optimizer, ZeroRedundancyOptimizer):
        optimizer.optimizer.state["shard"] = _load_flat_state(source, list(zero_param_slabs(optimizer)),
                                                              optimizer.shard, what)
        return
    if hasattr(optimizer, "flat_range_slabs"):  # a parameter server: each server loads its range's state
        slabs = optimizer.flat_range_slabs()
        if slabs is not None:
            optimizer.optimizer.state["shard"] = _load_flat_state(source, slabs, optimizer.shard, what)
        return
    params = dict(named)
    for name, param in zip(optimizer.names, optimizer.params):
        shape, slab = global_slab(params.get(name, param))
        state = {}
        for key in _state_keys(manifest, name):
            full = f"optim/{name}/{key}"
            if full in manifest["scalars"]:
                state[key] = int(manifest["scalars"][full])
            else:
                state[key] = to_device(source.read(full, shape, slab, what), param.xp).astype(param.dtype)
        optimizer.state[name] = state


def _load_flat_state(source, slabs: list, shard, what) -> dict:
    """The state of an optimizer over a flat range (ZeRO-1's shard, a parameter server's range),
    assembled from the per-parameter global tensors; ``slabs`` from ``range_param_slabs``."""
    manifest = source.manifest
    first_name = slabs[0][0]
    state = {}
    for key in _state_keys(manifest, first_name):
        first = f"optim/{first_name}/{key}"
        if first in manifest["scalars"]:
            state[key] = int(manifest["scalars"][first])
            continue
        flat = np.zeros(shard.size, dtype=shard.dtype)
        for name, _, shape, glob, local_shape, offset in slabs:
            block = source.read(f"optim/{name}/{key}", shape, glob, what).reshape(-1)
            flat[offset: offset + block.size] = block
        state[key] = to_device(flat, shard.xp)
    return state


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

    Returns ``{"step", "step_dir", "layout", "extra"}`` (``extra``: the plain JSON values).
    Collective over ``ctx.world``; every rank raises the same CheckpointError on damage.
    """
    comm = ctx.world.mpi
    step_dir = resolve_step_dir(path, step)
    manifest = read_manifest(step_dir)
    verify_collectively(step_dir, manifest, comm)
    named = list(model.named_parameters()) if hasattr(model, "named_parameters") else list(model)
    what = f"loading {step_dir}"
    with h5py.File(os.path.join(step_dir, INDEX), "r") as index:
        source = _Source(step_dir, manifest, index)
        try:
            _load_model(source, named, what)
            if optimizer is not None:
                _load_optimizer(source, optimizer, named, what)
                if hasattr(optimizer, "load_weight_decays"):  # the groups the run was trained with
                    optimizer.load_weight_decays(saved_weight_decays(manifest["scalars"]))
        finally:
            source.close()
    if hasattr(optimizer, "refresh_shard"):
        optimizer.refresh_shard()
    if strict:  # every model tensor of the checkpoint must land on some rank
        loaded = set().union(*comm.allgather({f"model/{n}" for n, _ in named}))
        unused = sorted(k for k in manifest["tensors"] if k.startswith("model/") and k not in loaded)
        if unused:
            raise CheckpointError(f"{what}: tensors no rank of this model takes: {unused[:5]}"
                                  f"{' ...' if len(unused) > 5 else ''} (pass strict=False to ignore)")
    values = _load_extra(manifest, extra, ctx)
    return {"step": manifest["step"], "step_dir": step_dir, "layout": manifest["layout"], "extra": values}


def load_latest(root: str, model, optimizer, ctx, extra: dict | None = None, strict: bool = True) -> dict | None:
    """Load the newest checkpoint under ``root`` that verifies; None when there is none.

    A damaged newest checkpoint is reported on rank 0 and the next older one is tried.
    """
    for step in reversed(list_steps(root)):
        try:
            return load(os.path.join(root, step_dirname(step)), model, optimizer, ctx, extra, strict=strict)
        except CheckpointError as error:
            if ctx.rank == 0:
                print(f"hpcpar: skipping checkpoint step {step}: {error}", flush=True)
    return None
