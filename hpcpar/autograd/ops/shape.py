"""Shape ops: reshape, transpose, indexing, concatenate, split."""
from __future__ import annotations

import numbers

from ...backend import get_array_module
from .. import precision
from ..function import Function
from ._common import scatter_add_rows


class Reshape(Function):
    op = "reshape"

    def forward(self, a, shape):
        self.shape = a.shape
        return a.reshape(shape)

    def backward(self, grad):
        return (grad.reshape(self.shape),)


class Transpose(Function):
    op = "transpose"

    def forward(self, a, axes=None):
        axes = tuple(reversed(range(a.ndim))) if axes is None else tuple(ax % a.ndim for ax in axes)
        self.inverse = tuple(sorted(range(a.ndim), key=axes.__getitem__))
        return a.transpose(axes)

    def backward(self, grad):
        return (grad.transpose(self.inverse),)


def _as_index(index, xp):
    """Tensors and lists in an index become ``xp`` arrays; integers stay plain."""
    from ..tensor import Tensor

    if isinstance(index, tuple):
        return tuple(_as_index(i, xp) for i in index)
    if isinstance(index, Tensor):
        index = index.data
    if isinstance(index, numbers.Integral) and not isinstance(index, bool):
        return int(index)
    if isinstance(index, (list, bool)) or hasattr(index, "dtype"):
        return xp.asarray(index)
    return index  # slice, None, Ellipsis


def _scatter_is_assignment(index) -> bool:
    """True when no element can be selected twice, so backward may assign instead of add."""
    parts = index if isinstance(index, tuple) else (index,)
    return all(p is None or p is Ellipsis or isinstance(p, (int, slice))
               or getattr(p, "dtype", None) is not None and p.dtype.kind == "b" for p in parts)


class GetItem(Function):
    op = "getitem"

    def forward(self, a, index):
        self.index = _as_index(index, get_array_module(a))
        self.shape, self.dtype = a.shape, a.dtype
        return a[self.index]

    def backward(self, grad):
        xp = self.xp(grad)
        index = self.index
        if getattr(index, "dtype", None) is not None and index.dtype.kind in "iu":  # a[ids]: rows, maybe repeated
            rows = index.reshape(-1) % self.shape[0]  # negative ids name the same rows as positive ones
            return (scatter_add_rows(rows, grad.reshape((-1,) + self.shape[1:]), self.shape),)
        if _scatter_is_assignment(index):
            full = xp.zeros(self.shape, dtype=self.dtype)
            full[index] = grad
        else:  # integer arrays may repeat an element: its gradients must add up (in float32 for 16 bits)
            full = xp.zeros(self.shape, dtype=precision.accumulation_dtype(self.dtype))
            xp.add.at(full, index, grad)
        return (full,)


class Concatenate(Function):
    op = "concatenate"

    def forward(self, *arrays, axis=0):
        self.axis = axis
        self.bounds = []
        offset = 0
        for a in arrays[:-1]:
            offset += a.shape[axis]
            self.bounds.append(offset)
        return get_array_module(*arrays).concatenate(arrays, axis=axis)

    def backward(self, grad):
        return tuple(self.xp(grad).split(grad, self.bounds, axis=self.axis))


def reshape(a, shape):
    return Reshape.apply(a, shape=tuple(shape) if not isinstance(shape, int) else (shape,))


def transpose(a, axes=None):
    """Permute the axes (``None`` reverses them)."""
    return Transpose.apply(a, axes=axes)


def getitem(a, index):
    """``a[index]`` with basic or advanced indexing; repeated indices accumulate gradients."""
    return GetItem.apply(a, index=index)


def concatenate(tensors, axis=0):
    return Concatenate.apply(*tensors, axis=axis)


def split(a, sections, axis=0):
    """Split along ``axis`` into ``sections`` equal parts (an int) or parts of the listed sizes."""
    size = a.shape[axis]
    if isinstance(sections, numbers.Integral):
        if sections <= 0 or size % sections:
            raise ValueError(f"split: an axis of size {size} does not divide into {sections} equal sections")
        sizes = [size // sections] * int(sections)
    else:
        sizes = [int(s) for s in sections]
        if any(s < 0 for s in sizes) or sum(sizes) != size:
            raise ValueError(f"split: section sizes {sizes} do not add up to the axis size {size}")
    axis = axis % a.ndim
    pieces, start = [], 0
    for n in sizes:  # each piece is a basic slice: a view forward, one slice assignment backward
        pieces.append(getitem(a, (slice(None),) * axis + (slice(start, start + n),)))
        start += n
    return pieces
