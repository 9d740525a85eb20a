"""What a rank holds, as pieces of global tensors, and the protocol by which objects save and load them.

A ``Piece`` is a hyperslab of one global tensor (``model/<param>`` or ``optim/<param>/<state>``)
and the local array holding it: a data-parallel replica offers whole tensors, a tensor-parallel
shard a block (its ``Tensor.global_shape`` and ``global_start``), ZeRO-1 and the parameter
server runs of the flattened parameters (cut into row-major slabs here).

Anything with state in a checkpoint implements ``Checkpointable``: ``checkpoint_pieces()``, what
this rank saves (pieces, and scalars such as step counts), and ``load_plan(saved)``, the slabs it
reads (``Read``) and what to do once all are in. The checkpoint package knows only this protocol,
which is why any layout loads a checkpoint of any other; a plain list of (name, parameter) pairs
is wrapped in ``ParameterList``. docs/architecture.md ("The checkpoint protocol") has the rest.
"""
from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from .backend import to_device

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


@dataclass(slots=True)  # slots, not frozen: a load makes one per tensor it reads (frozen costs 4x to build)
class Read:
    """One slab a rank reads at load; ``assign(values)`` gets a host array of the slab's shape
    (the receiver may keep it: it is its own). ``dtype``, when given, is the destination's
    dtype: a checkpoint tensor of another kind (integers for floats) is a mismatch, not a cast.
    ``target``, when given, is the array ``assign`` would fill: a loader may read the values
    straight into it once the load can no longer fail, and then not call ``assign``."""

    key: str
    global_shape: tuple
    slab: Slab
    assign: Callable[[np.ndarray], None]
    dtype: object = None
    target: object = None  # the destination array, if the loader may fill it in place instead of assign


@dataclass
class LoadPlan:
    reads: list = field(default_factory=list)  # [Read]
    finish: list = field(default_factory=list)  # callables run after every read is assigned
    # (destination, source) arrays copied once every read is assigned, before ``finish``: a copy of
    # loaded values into a second home (ZeRO-1's shard of its flat parameters), done by the
    # loader's fast copy where both are host arrays alike
    copies: list = field(default_factory=list)

    def extend(self, other: "LoadPlan") -> "LoadPlan":
        self.reads += other.reads
        self.finish += other.finish
        self.copies += other.copies
        return self


class Saved:
    """What a checkpoint holds, as a load plan needs to know it: tensor keys and scalars (integer
    step counts, ``weight_decay/<param>`` floats)."""

    def __init__(self, tensor_keys, scalars: dict):
        self.tensor_keys = set(tensor_keys)
        self.scalars = dict(scalars)
        self._state = {}  # parameter name -> its optimizer state keys, sorted (one pass, not one per parameter)
        for key in self.tensor_keys.union(self.scalars):
            if key.startswith("optim/"):
                name, _, state = key[len("optim/"):].rpartition("/")
                self._state.setdefault(name, []).append(state)
        for states in self._state.values():
            states.sort()
        self._decays = saved_weight_decays(self.scalars)  # asked for by every optimizer part of a load

    def state_keys(self, name: str) -> tuple[str, ...]:
        """The optimizer state saved for parameter ``name`` (``exp_avg``, ``step`` ...)."""
        return tuple(self._state.get(name, ()))

    def weight_decays(self) -> dict:
        """{parameter name: weight decay} saved (empty for checkpoints from before decay groups)."""
        return dict(self._decays)


class Checkpointable(ABC):
    """The checkpoint protocol (see the module docstring)."""

    @abstractmethod
    def checkpoint_pieces(self) -> tuple[list[Piece], dict]:
        """(pieces this rank saves, ``{key: number}`` scalars)."""

    @abstractmethod
    def load_plan(self, saved: Saved) -> LoadPlan:
        """What this rank reads from a checkpoint holding ``saved``; nothing may change before ``finish``."""


class ParameterHolder(Checkpointable):
    """The protocol for anything with ``named_parameters()``: its parameters as ``model/<name>``."""

    def checkpoint_pieces(self) -> tuple[list[Piece], dict]:
        return parameter_pieces(self.named_parameters()), {}

    def load_plan(self, saved: Saved) -> LoadPlan:
        return parameter_load_plan(self.named_parameters())


class ParameterList(ParameterHolder):
    """(name, parameter) pairs as a Checkpointable."""

    def __init__(self, named):
        self.named = list(named)

    def named_parameters(self):
        return self.named


def checkpointable(obj) -> Checkpointable:
    """``obj`` itself when it implements the protocol, else its (name, parameter) pairs wrapped."""
    return obj if isinstance(obj, Checkpointable) else ParameterList(obj)


class Together(Checkpointable):
    """Several Checkpointables saved and loaded as one (an optimizer and its compressor's state)."""

    def __init__(self, *parts):
        self.parts = [checkpointable(part) for part in parts]

    def checkpoint_pieces(self) -> tuple[list[Piece], dict]:
        pieces, scalars = [], {}
        for part in self.parts:
            more, numbers = part.checkpoint_pieces()
            pieces += more
            scalars.update(numbers)
        return pieces, scalars

    def load_plan(self, saved: Saved) -> LoadPlan:
        plan = LoadPlan()
        for part in self.parts:
            plan.extend(part.load_plan(saved))
        return plan


class SavedElsewhere(Checkpointable):
    """``part`` without its pieces of the parameters ``names`` (``model/<name>``, ``optim/<name>/...``),
    which another rank saves; it loads them as ``part`` does. A pipeline's tied embedding: each
    holder's shards of it are cut by its own stage's flat layout, so only the lowest holder's
    are saved (pieces must tile a tensor)."""

    def __init__(self, part, names):
        self.part, self.names = checkpointable(part), set(names)

    def _kept(self, key: str) -> bool:
        kind, _, rest = key.partition("/")
        name = rest.rpartition("/")[0] if kind == "optim" else rest
        return name not in self.names

    def checkpoint_pieces(self) -> tuple[list[Piece], dict]:
        pieces, scalars = self.part.checkpoint_pieces()
        return [piece for piece in pieces if self._kept(piece.key)], scalars

    def load_plan(self, saved: Saved) -> LoadPlan:
        return self.part.load_plan(saved)


# ----------------------------------------------------------------------------------------
# Slabs
# ----------------------------------------------------------------------------------------
def global_slab(param) -> tuple[tuple, Slab]:
    """(global shape, slab) of a parameter: the whole tensor unless it is a shard."""
    local = tuple(param.shape)
    if param.global_shape is None:  # the common case, without building a start of zeros (a load asks this per tensor)
        return local, tuple([(0, n) for n in local])
    return tuple(param.global_shape), tuple([(s, s + n) for s, n in zip(param.global_start, local)])


def row_of(rows: int, row: int, shape: tuple) -> tuple[tuple, Slab]:
    """(global shape, slab) of row ``row`` of a tensor of ``rows`` rows shaped ``shape``: how a rank
    saves a value that is its own, one row per dp replica (a compressor's or local SGD's state)."""
    return (rows,) + tuple(shape), ((row, row + 1),) + tuple((0, n) for n in shape)


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


WEIGHT_DECAY = "weight_decay"  # scalars "weight_decay/<param>": the decay groups by name, so any layout restores them


def weight_decay_scalars(decays: dict) -> dict:
    """``{"weight_decay/<param>": value}`` of an optimizer's ``{parameter name: weight decay}``."""
    return {f"{WEIGHT_DECAY}/{name}": float(value) for name, value in decays.items()}


def saved_weight_decays(scalars: dict) -> dict:
    """{parameter name: weight decay} from a checkpoint's scalars."""
    prefix = WEIGHT_DECAY + "/"
    return {key[len(prefix):]: float(value) for key, value in scalars.items() if key.startswith(prefix)}


# ----------------------------------------------------------------------------------------
# The protocol for the common holders of state
# ----------------------------------------------------------------------------------------
def parameter_pieces(named_parameters) -> list[Piece]:
    pieces = []
    for name, param in named_parameters:
        shape, slab = global_slab(param)
        pieces.append(Piece(f"model/{name}", shape, slab, param.data))
    return pieces


def parameter_load_plan(named_parameters) -> LoadPlan:
    """Each parameter's slab of ``model/<name>``, copied into it (cast to its dtype, on its device)."""
    def into(param):
        def assign(values):
            param.data[...] = to_device(values, param.xp)
        return assign

    reads = []
    for name, param in named_parameters:
        shape, slab = global_slab(param)
        reads.append(Read(f"model/{name}", shape, slab, into(param), param.dtype, param.data))
    return LoadPlan(reads)


def flat_state_pieces(slabs, state: dict) -> tuple[list[Piece], dict]:
    """An optimizer's state over a flat range (``state``: its arrays over the range, and step
    counts) as pieces of the per-parameter global tensors ``optim/<name>/<key>``, and scalars;
    ``slabs`` from ``range_param_slabs``."""
    pieces, scalars = [], {}
    for name, _, shape, glob, local_shape, offset in slabs:
        for key, value in state.items():
            if np.ndim(value) == 0:
                scalars[f"optim/{name}/{key}"] = int(value)
            else:
                block = value[offset: offset + math.prod(local_shape)].reshape(local_shape)
                pieces.append(Piece(f"optim/{name}/{key}", shape, glob, block))
    return pieces, scalars


def flat_state_load_plan(saved: Saved, slabs: list, shard, commit: Callable[[dict], None],
                         current: dict | None = None) -> LoadPlan:
    """Read the state of an optimizer over a flat range (ZeRO-1's shard, a parameter server's range)
    from the per-parameter global tensors; ``commit(state)`` receives it once every read is in.
    ``current``: the state now, whose host arrays of the shard's size and dtype are filled in
    place (nothing is written before the load commits): no new memory to fault in."""
    if not slabs:
        return LoadPlan()
    first_name = slabs[0][0]
    state, reads, reused = {}, [], []
    for key in saved.state_keys(first_name):
        first = f"optim/{first_name}/{key}"
        if first in saved.scalars:
            state[key] = int(saved.scalars[first])
            continue
        now = (current or {}).get(key)
        if isinstance(now, np.ndarray) and now.shape == (shard.size,) and now.dtype == shard.dtype:
            flat = state[key] = now
            reused.append(now)
        else:
            flat = state[key] = np.zeros(shard.size, dtype=shard.dtype)
        for name, _, shape, glob, local_shape, offset in slabs:
            def assign(values, flat=flat, offset=offset):
                flat[offset: offset + values.size] = values.reshape(-1)
            target = flat[offset: offset + math.prod(local_shape)].reshape(local_shape)  # what assign fills
            reads.append(Read(f"optim/{name}/{key}", shape, glob, assign, shard.dtype, target))

    covered = slabs[-1][5] + math.prod(slabs[-1][4])  # the slabs lie end to end from 0; past them, padding

    def finish():
        for flat in reused:
            flat[covered:] = 0  # the padding, as a new array's
        commit({key: value if np.ndim(value) == 0 else to_device(value, shard.xp) for key, value in state.items()})
    return LoadPlan(reads, [finish])
