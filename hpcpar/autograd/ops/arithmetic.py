"""Broadcasting arithmetic and matrix products."""
from __future__ import annotations

import numbers

from ...backend import get_array_module
from .. import precision
from ..function import Function, unbroadcast
from ._common import broadcast_error, wants_grad


class Add(Function):
    op = "add"

    def forward(self, a, b):
        self.shapes = a.shape, b.shape
        try:
            return a + b
        except ValueError:
            raise broadcast_error("add", a, b) from None

    def backward(self, grad):
        # The same array may go to both inputs: backward never writes into its ``grad``.
        return unbroadcast(grad, self.shapes[0]), unbroadcast(grad, self.shapes[1])


class Sub(Function):
    op = "sub"

    def forward(self, a, b):
        self.shapes = a.shape, b.shape
        try:
            return a - b
        except ValueError:
            raise broadcast_error("sub", a, b) from None

    def backward(self, grad):
        grad_b = -unbroadcast(grad, self.shapes[1]) if wants_grad(self, 1) else None
        return unbroadcast(grad, self.shapes[0]), grad_b


class Mul(Function):
    op = "mul"

    def forward(self, a, b):
        self.a, self.b = a, b
        try:
            return a * b
        except ValueError:
            raise broadcast_error("mul", a, b) from None

    def backward(self, grad):
        a, b = self.a, self.b
        grad_a = unbroadcast(grad * b, a.shape) if wants_grad(self, 0) else None
        grad_b = unbroadcast(grad * a, b.shape) if wants_grad(self, 1) else None
        return grad_a, grad_b


class Div(Function):
    op = "div"

    def forward(self, a, b):
        try:
            out = a / b
        except ValueError:
            raise broadcast_error("div", a, b) from None
        self.a_shape, self.b, self.out = a.shape, b, out
        return out

    def backward(self, grad):
        grad_over_b = grad / self.b
        grad_b = None
        if wants_grad(self, 1):  # d(a/b)/db = -(a/b)/b, reusing the forward output
            grad_b = grad_over_b * self.out
            self.xp(grad_b).negative(grad_b, out=grad_b)
            grad_b = unbroadcast(grad_b, self.b.shape)
        return unbroadcast(grad_over_b, self.a_shape), grad_b


class Neg(Function):
    op = "neg"

    def forward(self, a):
        return -a

    def backward(self, grad):
        return (-grad,)


def _power(x, n):
    """``x ** n``; small integer powers by multiplication (float32 ``x**3`` is ~250x slower).

    May return ``x`` itself (n == 1): callers must not write into the result then.
    """
    xp = get_array_module(x)
    if n == 0.5:
        return xp.sqrt(x)
    if n == int(n) and abs(n) <= 4:
        m = abs(int(n))
        if m == 0:
            return xp.ones_like(x)
        result = x
        if m >= 2:
            result = x * x
            for _ in range(m - 2):
                result *= x
        return xp.reciprocal(result) if n < 0 else result
    return xp.power(x, x.dtype.type(n))


class Pow(Function):
    op = "pow"

    def forward(self, a, exponent):
        self.a, self.exponent = a, exponent
        out = _power(a, exponent)
        return out.copy() if out is a else out

    def backward(self, grad):
        n = self.exponent
        if n == 1:
            return (grad,)
        d = _power(self.a, n - 1)  # d(a^n)/da = n a^(n-1)
        d = d * grad if d is self.a else self.xp(d).multiply(d, grad, out=d)
        d *= n
        return (d,)


def _fold_batch(a):
    """(..., K) -> (prod(...), K): a matmul against a 2-D matrix becomes one large GEMM."""
    return a.reshape(-1, a.shape[-1])


def _swap(a):
    return a.swapaxes(-1, -2)


class MatMul(Function):
    op = "matmul"

    def forward(self, a, b):
        if a.ndim < 2 or b.ndim < 2:
            raise ValueError(f"matmul: both operands need at least 2 dimensions (1-D is not supported), "
                             f"got shapes {a.shape} and {b.shape}")
        if a.shape[-1] != b.shape[-2]:
            raise ValueError(f"matmul: shapes {a.shape} and {b.shape} do not match "
                             f"(a.shape[-1]={a.shape[-1]} but b.shape[-2]={b.shape[-2]})")
        self.a, self.b = a, b
        if b.ndim == 2:  # (..., K) @ (K, N): one GEMM instead of one per batch entry
            return precision.matmul(_fold_batch(a), b).reshape(a.shape[:-1] + (b.shape[1],))
        try:
            return precision.matmul(a, b)
        except ValueError:
            raise ValueError(f"matmul: batch dimensions of shapes {a.shape} and {b.shape} do not broadcast") from None

    def backward(self, grad):
        a, b = self.a, self.b
        grad_a = grad_b = None
        if wants_grad(self, 0):
            grad_a = unbroadcast(precision.matmul(grad, _swap(b)), a.shape)
        if wants_grad(self, 1):
            if b.ndim == 2:  # sum over the batch folded into the GEMM's inner dimension
                grad_b = precision.matmul(_fold_batch(a).T, _fold_batch(grad))
            else:
                grad_b = unbroadcast(precision.matmul(_swap(a), grad), b.shape)
        return grad_a, grad_b


def add(a, b):
    return Add.apply(a, b)


def sub(a, b):
    return Sub.apply(a, b)


def mul(a, b):
    return Mul.apply(a, b)


def div(a, b):
    return Div.apply(a, b)


def neg(a):
    return Neg.apply(a)


def pow(a, exponent):  # noqa: A001 - the op is named like the operator it implements
    """``a ** exponent`` for a Python number ``exponent``."""
    if not isinstance(exponent, numbers.Real) or isinstance(exponent, bool):
        raise TypeError(f"pow: exponent must be a Python number, got {type(exponent).__name__}")
    exponent = exponent.item() if hasattr(exponent, "item") else exponent  # NumPy scalar -> Python
    return Pow.apply(a, exponent=exponent)


def matmul(a, b):
    """Batched ``a @ b`` with broadcast batch dimensions; both operands at least 2-D."""
    return MatMul.apply(a, b)

