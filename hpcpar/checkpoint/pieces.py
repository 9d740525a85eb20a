"""What a rank holds, as pieces of global tensors.

A ``Piece`` is a hyperslab of one global tensor (``model/<param>`` or
``optim/<param>/<state>``) and the local array holding it. Every layout reduces to pieces:
a data-parallel replica offers whole tensors, a tensor-parallel shard a block of columns
or rows, a ZeRO-1 rank runs of the flattened parameters (cut into row-major slabs here).
Saving writes each distinct piece once; loading reads, for each tensor a rank now holds,
exactly its slab from the global view, whatever layout wrote it.

A parameter that is a shard of a larger tensor says so with two attributes set by the
layer that sharded it: ``global_shape`` and ``global_start`` (the index of its first
element in the global tensor). Without them a parameter is its whole tensor.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

Slab = tuple  # ((start, stop), ...) per axis, in global coordinates


@dataclass
class Piece:
    key: str
    global_shape: tuple
    slab: Slab
    array: object  # NumPy or CuPy array of the slab's shape

    @property
    def shape(self) -> tuple:
        return tuple(stop - start for start, stop in self.slab)


def global_slab(param) -> tuple[tuple, Slab]:
    """(global shape, slab) of a parameter: the whole tensor unless it is a shard."""
    shape = tuple(getattr(param, "global_shape", param.shape))
    start = tuple(getattr(param, "global_start", (0,) * len(shape)))
    return shape, tuple((s, s + n) for s, n in zip(start, param.shape))


def slab_slices(slab: Slab) -> tuple:
    return tuple(slice(start, stop) for start, stop in slab)


def flat_range_to_slabs(shape: tuple, begin: int, end: int) -> list[Slab]:
    """Cut the row-major flat range [begin, end) of an array of ``shape`` into rectangular slabs.

    A ZeRO shard boundary can fall anywhere inside a parameter; the range splits into at
    most 2 (ndim - 1) + 1 slabs: a ragged head, whole rows, a ragged tail (recursively).
    """
    if begin >= end:
        return []
    if len(shape) == 0:
        return [()]
    if len(shape) == 1:
        return [((begin, end),)]
    row = math.prod(shape[1:])
    first, last = begin // row, (end - 1) // row
    if first == last:  # inside one row: recurse into it
        return [((first, first + 1),) + sub for sub in flat_range_to_slabs(shape[1:], begin - first * row, end - first * row)]
    slabs = []
    if begin % row:  # ragged head
        slabs += flat_range_to_slabs(shape, begin, (first + 1) * row)
        first += 1
    whole_end = end // row
    if whole_end > first:
        slabs.append(((first, whole_end),) + tuple((0, n) for n in shape[1:]))
    if end % row and end // row >= first:  # ragged tail
        slabs += flat_range_to_slabs(shape, whole_end * row, end)
    return slabs


def model_pieces(named_parameters) -> list[Piece]:
    pieces = []
    for name, param in named_parameters:
        shape, slab = global_slab(param)
        pieces.append(Piece(f"model/{name}", shape, slab, param.data))
    return pieces


def optimizer_pieces(optimizer, named_parameters) -> tuple[list[Piece], dict]:
    """Array state as pieces and integer state (step counts) as ``{key: int}``."""
    from ..parallel.zero import ZeroRedundancyOptimizer

    if optimizer is None:
        return [], {}
    if isinstance(optimizer, ZeroRedundancyOptimizer):
        return _zero_pieces(optimizer)
    params = dict(named_parameters)
    pieces, scalars = [], {}
    for name, param in zip(optimizer.names, optimizer.params):
        shape, slab = global_slab(params.get(name, param))
        for key, value in optimizer.state[name].items():
            if np.ndim(value) == 0:
                scalars[f"optim/{name}/{key}"] = int(value)
            else:
                pieces.append(Piece(f"optim/{name}/{key}", shape, slab, value))
    return pieces, scalars


WEIGHT_DECAY = "weight_decay"  # scalars "weight_decay/<param>": the groups, by name, so any layout restores them


def weight_decay_scalars(optimizer) -> dict:
    """{"weight_decay/<param name>": value} of the parameters ``optimizer`` updates."""
    decays = optimizer.named_weight_decays() if hasattr(optimizer, "named_weight_decays") else {}
    return {f"{WEIGHT_DECAY}/{name}": float(value) for name, value in decays.items()}


def saved_weight_decays(scalars: dict) -> dict:
    """{param name: weight decay} from a manifest's scalars (empty for checkpoints from before groups)."""
    prefix = WEIGHT_DECAY + "/"
    return {key[len(prefix):]: float(value) for key, value in scalars.items() if key.startswith(prefix)}


def range_param_slabs(names, params, offsets, begin: int, end: int):
    """The flat range [begin, end) of parameters laid end to end (``offsets``: where each starts),
    cut into rectangular slabs: (name, param, global shape, global slab, local shape, offset of
    the slab's elements in the range). A ZeRO-1 shard and a parameter server's range are such ranges."""
    for name, param, start in zip(names, params, offsets):
        lo, hi = max(begin, start), min(end, start + param.size)
        if lo >= hi:
            continue
        shape, param_slab = global_slab(param)
        offset = lo - begin
        for local in flat_range_to_slabs(param.shape, lo - start, hi - start):
            glob = tuple((a + p0, b + p0) for (a, b), (p0, _) in zip(local, param_slab))
            local_shape = tuple(b - a for a, b in local)
            yield name, param, shape, glob, local_shape, offset
            offset += math.prod(local_shape)


def zero_param_slabs(zero):
    """``range_param_slabs`` of this rank's ZeRO-1 shard."""
    begin = zero.comm.rank * zero.shard_size
    return range_param_slabs(zero.names, zero.params, zero.offsets, begin, begin + zero.shard_size)


def flat_state_pieces(slabs, state: dict) -> tuple[list[Piece], dict]:
    """An optimizer's state over a flat range (``state``: its arrays over the range, and step
    counts) as pieces of the per-parameter global tensors ``optim/<name>/<key>``, and scalars."""
    pieces, scalars = [], {}
    for name, _, shape, glob, local_shape, offset in slabs:
        for key, value in state.items():
            if np.ndim(value) == 0:
                scalars[f"optim/{name}/{key}"] = int(value)
            else:
                block = value[offset: offset + math.prod(local_shape)].reshape(local_shape)
                pieces.append(Piece(f"optim/{name}/{key}", shape, glob, block))
    return pieces, scalars


def _zero_pieces(zero) -> tuple[list[Piece], dict]:
    return flat_state_pieces(list(zero_param_slabs(zero)), zero.optimizer.state["shard"])
