"""Reductions: sum, mean, max."""
from __future__ import annotations

import math

from .. import precision
from ..function import Function
from ._common import kept_shape, normalize_axes


class Sum(Function):
    op = "sum"

    def forward(self, a, axis=None, keepdims=False):
        self.shape = a.shape
        self.axes = normalize_axes(axis, a.ndim)
        return precision.sum(a, axis=self.axes, keepdims=keepdims)

    def backward(self, grad):
        # A read-only broadcast view: no copy of the input's size is made here.
        grad = grad.reshape(kept_shape(self.shape, self.axes))
        return (self.xp(grad).broadcast_to(grad, self.shape),)


class Mean(Function):
    op = "mean"

    def forward(self, a, axis=None, keepdims=False):
        self.shape = a.shape
        self.axes = normalize_axes(axis, a.ndim)
        return a.mean(axis=self.axes, keepdims=keepdims, dtype=precision.accumulation_dtype(a.dtype))

    def backward(self, grad):
        count = math.prod(self.shape[i] for i in self.axes)
        grad = grad.reshape(kept_shape(self.shape, self.axes)) * (1.0 / (count or 1))
        return (self.xp(grad).broadcast_to(grad, self.shape),)


class Max(Function):
    """The gradient is split evenly among tied maxima (as ``torch.amax``), so it is symmetric."""

    op = "max"

    def forward(self, a, axis=None, keepdims=False):
        self.axes = normalize_axes(axis, a.ndim)
        self.a = a
        self.out = a.max(axis=self.axes, keepdims=True)
        return self.out if keepdims else self.out.reshape([n for i, n in enumerate(a.shape) if i not in self.axes])

    def backward(self, grad):
        is_max = self.a == self.out
        ties = is_max.sum(axis=self.axes, keepdims=True, dtype=precision.accumulation_dtype(self.a.dtype))
        return (is_max * (precision.upcast(grad.reshape(self.out.shape)) / ties),)


def sum(a, axis=None, keepdims=False):  # noqa: A001 - mirrors Tensor.sum
    return Sum.apply(a, axis=axis, keepdims=keepdims)


def mean(a, axis=None, keepdims=False):
    return Mean.apply(a, axis=axis, keepdims=keepdims)


def max(a, axis=None, keepdims=False):  # noqa: A001 - mirrors Tensor.max
    """Maximum over ``axis``; the gradient is shared evenly among ties."""
    return Max.apply(a, axis=axis, keepdims=keepdims)
