"""What a graph keeps alive for its backward, counted in bytes (activation memory).

    with kept_for_backward(exclude=model.parameters()) as kept:
        loss = model.loss(ids, targets)
    kept.bytes      # the distinct buffers the graph holds, parameters excluded
    kept.by_op      # the same bytes, each buffer under the first op that held it

An op of the graph holds two kinds of arrays until its backward has run: what its Function
saved on itself, and the arrays of its leaf inputs (parameters, stage inputs, constants); a
non-leaf input is linked by its ``GraphNode``, which holds no array. Both are counted, each
buffer once, a view as the whole buffer it keeps alive. Ops are counted as they join the graph
(``Function.attach`` calls ``note``), so only ops made inside the block are seen.
"""
from __future__ import annotations

import contextlib

_active: "KeptForBackward | None" = None


def note(fn) -> None:
    """Count what the graph's op ``fn`` keeps, when a tally is open (called as it joins the graph)."""
    if _active is not None:
        _active.add(fn)


def owner(array):
    """The array that owns ``array``'s memory (itself, or the base at the end of its chain of views)."""
    while _is_array(getattr(array, "base", None)):
        array = array.base
    return array


def _is_array(value) -> bool:
    return hasattr(value, "nbytes") and hasattr(value, "base") and hasattr(value, "dtype")


def _arrays_of(fn):
    """The arrays op ``fn`` keeps: its leaf inputs' and those saved on it (one level of tuples and lists).

    A non-leaf input is linked by its ``GraphNode``, which holds no array."""
    for parent in getattr(fn, "parents", ()):
        if parent.is_leaf:
            yield parent.data
    for value in vars(fn).values():
        if _is_array(value):
            yield value
        elif isinstance(value, (tuple, list)):
            yield from (v for v in value if _is_array(v))


class KeptForBackward:
    """The running tally of one ``kept_for_backward`` block. It holds references to what it counted
    (so that ids stay unique) until the block ends, and after that only the totals."""

    def __init__(self, exclude=()):
        self._excluded = {id(owner(getattr(t, "data", t))) for t in exclude}
        self._owners: dict[int, object] = {}  # id -> the owning array, held so that ids stay unique
        self.by_op: dict[str, int] = {}

    def add(self, fn) -> None:
        op = getattr(fn, "op", None) or type(fn).__name__
        for array in _arrays_of(fn):
            base = owner(array)
            key = id(base)
            if key in self._excluded or key in self._owners:
                continue
            self._owners[key] = base
            self.by_op[op] = self.by_op.get(op, 0) + int(base.nbytes)

    @property
    def bytes(self) -> int:
        return sum(self.by_op.values())

    def close(self) -> None:
        self._owners = {}


@contextlib.contextmanager
def kept_for_backward(exclude=()):
    """Count the bytes the graph built inside this block keeps for backward (``exclude``: tensors or
    arrays not to count, e.g. the parameters). Blocks do not nest."""
    global _active
    if _active is not None:
        raise RuntimeError("kept_for_backward() blocks do not nest")
    _active = KeptForBackward(exclude)
    try:
        yield _active
    finally:
        _active.close()
        _active = None
