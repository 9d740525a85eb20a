"""What a save writes where, from what every rank holds: who writes which piece (evening out the
bytes per rank), the manifest's tensor table (each piece a range of its writer's flat dataset of
its dtype, or a dataset of its own in a collective save's shared file) and the bytes of
``index.h5`` (a virtual dataset per tensor at its global shape). All follow from the gathered
descriptions alone, the same at every save of a run, so ``Plan`` makes them once.

``writer`` runs the save as a transaction over the ranks; this module is its plan.
"""
from __future__ import annotations

import functools
import io
import json
import math

import h5py
import numpy as np

from ..state import slab_slices
from .manifest import CheckpointError, shard_filename


class Plan:
    """Who writes which piece, the manifest's tensor table and the index.h5 image: all follow
    from what every rank holds, the same at every save of a run, so they are made once."""

    _last = None  # the plan of the last save (a run saves the same layout again and again)

    def __init__(self, everyone: list, shared_file: str | None, layout: dict):
        self.everyone, self.shared_file, self.layout = everyone, shared_file, layout
        self.owner, self.load = assign_writers(everyone)
        self._tensors, self.index = None, None

    @classmethod
    def of(cls, everyone: list, shared_file: str | None, layout: dict) -> "Plan":
        last = cls._last
        if last is None or (last.everyone, last.shared_file, last.layout) != (everyone, shared_file, layout):
            last = cls._last = cls(everyone, shared_file, layout)
        return last

    def tensors(self) -> dict:
        if self._tensors is None:
            self._tensors = tensor_table(self.everyone, self.owner, self.shared_file)
        return self._tensors


def index_image(tensors: dict, layout: dict) -> bytes:
    """The bytes of index.h5: one virtual dataset per tensor at its global shape over the shard datasets.

    Source files are named relative to the index, so the same bytes serve every step (and
    the folder can be moved or copied as a whole); creating the virtual datasets costs
    ~0.4 ms each, which made up half of a save before the image was reused.
    """
    buffer = io.BytesIO()
    blob_sizes: dict = {}  # (file, flat dataset) -> elements
    for table in tensors.values():
        for piece in table["pieces"]:
            if "start" in piece:
                blob = (piece["file"], piece["dataset"])
                blob_sizes[blob] = max(blob_sizes.get(blob, 0), piece["start"] + slab_size(piece["slab"]))
    # The oldest format with virtual datasets (HDF5 1.10), so Debian's h5ls/h5dump read it too.
    with h5py.File(buffer, "w", libver=("v110", "v110")) as index:
        index.attrs["layout"] = json.dumps(layout)
        for key, table in tensors.items():
            dtype = np.dtype(table["dtype"])
            virtual = h5py.VirtualLayout(shape=tuple(table["shape"]), dtype=dtype)
            for piece in table["pieces"]:
                shape = tuple(stop - start for start, stop in piece["slab"])
                if "start" not in piece:  # a dataset of its own (a collective save's shared file)
                    source = h5py.VirtualSource(piece["file"], piece["dataset"], shape=shape)
                elif 0 in shape:
                    continue
                else:  # a range of the flat dataset, mapped onto the N-D block (row-major on both sides)
                    start, flat = piece["start"], (blob_sizes[(piece["file"], piece["dataset"])],)
                    source = h5py.VirtualSource(piece["file"], piece["dataset"], shape=flat)[
                        start: start + slab_size(piece["slab"])]
                virtual[slab_slices(piece["slab"])] = source
            # NaN where no source is readable: a missing shard shows in plain readers instead of zeros.
            index.create_virtual_dataset(key, virtual, fillvalue=np.nan if dtype.kind == "f" else None)
    return buffer.getvalue()


def assign_writers(everyone: list) -> dict:
    """``({(key, slab): rank}, bytes per rank)``: one writer per distinct piece, evening out the bytes.

    Largest pieces first, each to the holder with the fewest bytes so far (ties: lowest rank),
    so data-parallel replicas split the writing instead of rank 0 writing everything.
    """
    holders: dict = {}
    sizes: dict = {}
    for rank, entries in enumerate(everyone):
        for key, slab, _, dtype in entries:
            piece = (key, tuple(map(tuple, slab)))
            holders.setdefault(piece, []).append(rank)
            sizes[piece] = slab_size(piece[1]) * itemsize(dtype)
    load = [0] * len(everyone)
    owner = {}
    for piece in sorted(holders, key=lambda p: (-sizes[p], p[0])):
        rank = min(holders[piece], key=lambda r: (load[r], r))
        owner[piece] = rank
        load[rank] += sizes[piece]
    return owner, load


@functools.lru_cache(maxsize=None)
def itemsize(dtype: str) -> int:
    return np.dtype(dtype).itemsize


@functools.lru_cache(maxsize=None)
def dtype_name(dtype: str) -> str:
    return np.dtype(dtype).name


def slab_size(slab) -> int:
    return math.prod(stop - start for start, stop in slab)


def dataset_name(n: int, key: str) -> str:
    """The name of the n-th piece in a collective save's shared file (one dataset per piece)."""
    return f"{n:05d}:{key.replace('/', '|')}"


def tensor_table(everyone: list, owner: dict, shared_file: str | None = None) -> dict:
    """``{key: {shape, dtype, pieces: [{slab, rank, file, dataset, start}]}}``, each distinct slab once;
    checks coverage.

    A piece is the range from element ``start`` of the flat dataset ``dataset`` (its dtype's
    name) of its writer's shard file: each writer lays its pieces end to end per dtype, in the
    order it holds them. In ``shared_file`` (a collective save) each piece is a dataset of its own.
    """
    tensors = {}
    for rank, entries in enumerate(everyone):
        written = 0 if shared_file is None else sum(1 for e in everyone[:rank] for _ in e)  # unique names
        filled: dict = {}  # dtype -> elements laid out so far in this rank's shard
        for key, slab, shape, dtype in entries:
            table = tensors.setdefault(key, {"shape": list(shape), "dtype": dtype, "pieces": []})
            if list(shape) != table["shape"]:
                raise CheckpointError(f"{key}: ranks disagree on its global shape ({table['shape']} vs {list(shape)})")
            slab = tuple(map(tuple, slab))
            if owner[(key, slab)] != rank:
                continue
            piece = {"slab": [list(s) for s in slab], "rank": rank, "file": shared_file or shard_filename(rank)}
            if shared_file is None:
                name = dtype_name(dtype)
                piece |= {"dataset": name, "start": filled.get(name, 0)}
                filled[name] = filled.get(name, 0) + slab_size(slab)
            else:
                piece["dataset"] = dataset_name(written, key)
                written += 1
            table["pieces"].append(piece)
    for key, table in tensors.items():
        covered = sum(slab_size(p["slab"]) for p in table["pieces"])
        if covered != math.prod(table["shape"]):
            raise CheckpointError(f"{key}: the pieces held by the ranks cover {covered} of "
                                  f"{math.prod(table['shape'])} elements (overlapping or missing shards)")
    return tensors
