"""Elementwise functions and selections.

Backward passes reuse the forward output where the derivative is a function of it
(exp, sqrt, tanh) and update their own temporaries in place to save memory passes.
"""
from __future__ import annotations

import math

from ...backend import get_array_module
from .. import fused, precision
from ..function import Function, unbroadcast
from ._common import broadcast_error


class Exp(Function):
    op = "exp"

    def forward(self, a):
        self.out = get_array_module(a).exp(a)
        return self.out

    def backward(self, grad):
        return (grad * self.out,)


class Log(Function):
    op = "log"

    def forward(self, a):
        self.a = a
        return get_array_module(a).log(a)

    def backward(self, grad):
        return (grad / self.a,)


class Sqrt(Function):
    op = "sqrt"

    def forward(self, a):
        self.out = get_array_module(a).sqrt(a)
        return self.out

    def backward(self, grad):
        g = grad / self.out
        g *= 0.5
        return (g,)


class Tanh(Function):
    op = "tanh"

    def forward(self, a):
        self.out = get_array_module(a).tanh(a)
        return self.out

    def backward(self, grad):
        xp = self.xp(grad)
        g = self.out * self.out
        xp.subtract(1, g, out=g)  # 1 - tanh^2
        g *= grad
        return (g,)


class Relu(Function):
    op = "relu"

    def forward(self, a):
        self.out = get_array_module(a).maximum(a, a.dtype.type(0))
        return self.out

    def backward(self, grad):
        return (grad * (self.out > 0),)


_GELU_C = math.sqrt(2.0 / math.pi)
_GELU_A = 0.044715


class Gelu(Function):
    """GELU, tanh approximation (GPT-2): 0.5 x (1 + tanh(c (x + a x^3))).

    Only the input is kept: backward recomputes the tanh from it (a pass of the tanh for a
    quarter of the MLP's activation bytes at 32/64 bits; at 16 bits, computed in float32, saving
    the tanh in 16 bits would also cost its precision where 1 - t^2 is small)."""

    op = "gelu"

    def forward(self, x):
        inner = precision.upcast(x)
        t = _gelu_tanh(inner)
        self.x = x
        return fused.gelu_from_tanh(inner, t, get_array_module(t).empty_like(t))

    def backward(self, grad):
        # d/dx = 0.5 (1 + t) + 0.5 x (1 - t^2) c (1 + 3 a x^2), with t the tanh
        x = precision.upcast(self.x)
        return (fused.gelu_gradient(x, _gelu_tanh(x), grad, _GELU_A, _GELU_C),)


def _gelu_tanh(x):
    """tanh(c (x + a x^3)), computed as c x (1 + a x^2) in ``x``'s dtype, then tanh in place."""
    t = fused.gelu_tanh_argument(x, get_array_module(x).empty_like(x), _GELU_A, _GELU_C)
    get_array_module(x).tanh(t, out=t)
    return t


class Where(Function):
    op = "where"

    def forward(self, a, b, condition):
        xp = get_array_module(a, b)
        self.condition = xp.asarray(condition, dtype=bool)
        self.shapes = a.shape, b.shape
        try:
            return xp.where(self.condition, a, b)
        except ValueError:
            raise ValueError(f"where: condition {self.condition.shape} and values {a.shape}, {b.shape} "
                             "do not broadcast") from None

    def backward(self, grad):
        xp = self.xp(grad)
        zero = grad.dtype.type(0)
        grad_a = unbroadcast(xp.where(self.condition, grad, zero), self.shapes[0])
        grad_b = unbroadcast(xp.where(self.condition, zero, grad), self.shapes[1])
        return grad_a, grad_b


class MaskedFill(Function):
    op = "masked_fill"

    def forward(self, a, mask, value):
        xp = get_array_module(a)
        self.mask = xp.asarray(mask, dtype=bool)
        try:
            out = xp.where(self.mask, a.dtype.type(value), a)
        except ValueError:
            raise broadcast_error("masked_fill", a, self.mask) from None
        if out.shape != a.shape:
            raise ValueError(f"masked_fill: mask of shape {self.mask.shape} is larger than the input {a.shape}")
        return out

    def backward(self, grad):
        return (self.xp(grad).where(self.mask, grad.dtype.type(0), grad),)


def exp(a):
    return Exp.apply(a)


def log(a):
    return Log.apply(a)


def sqrt(a):
    return Sqrt.apply(a)


def tanh(a):
    return Tanh.apply(a)


def relu(a):
    return Relu.apply(a)


def gelu(a):
    """GELU with the tanh approximation, as GPT-2."""
    return Gelu.apply(a)


def where(condition, a, b):
    """``a`` where ``condition`` (a boolean array, not differentiated) holds, else ``b``."""
    from ..tensor import Tensor

    if isinstance(condition, Tensor):
        condition = condition.data
    return Where.apply(a, b, condition=condition)


def masked_fill(a, mask, value):
    """``a`` with ``value`` wherever the boolean ``mask`` (broadcast to ``a``) is true."""
    from ..tensor import Tensor

    if isinstance(mask, Tensor):
        mask = mask.data
    return MaskedFill.apply(a, mask=mask, value=value)
