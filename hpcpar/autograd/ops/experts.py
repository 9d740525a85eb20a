"""The differentiable pieces of a Mixture-of-Experts layer (``nn.moe``): routing, moving rows, experts.

    logits = router_logits(x, weight)                  # (..., E), float32 at least
    rows = permute_rows(x, tokens)                     # x[tokens]: the rows for the experts, in their order
    rows = all_to_all_rows(rows, sent, received, ep)   # to the ranks that hold the experts (and back)
    h = grouped_linear(rows, weight, bias, counts)     # expert e's rows times its own weight
    y = unpermute_rows(rows, slots, n)                 # back into n slots, zeros where nothing came

``permute_rows`` and ``unpermute_rows`` are the one permutation and its inverse the layer uses
(dispatch and combine); each one's backward is the other's forward. ``attach_loss`` carries an
auxiliary loss with an activation: its gradient starts where the activation's backward passes.
"""
from __future__ import annotations

import numpy as np

from .. import precision
from ..function import Function
from ._common import wants_grad
from .shape import getitem


def permute_rows(x, index):
    """``x[index]`` (rows; repeated indices allowed): backward adds each row's gradients back."""
    return getitem(x, index)


class UnpermuteRows(Function):
    """Rows into ``n`` slots, ``out[index[i]] = y[i]`` (distinct indices), zeros elsewhere."""

    op = "unpermute_rows"

    def forward(self, y, index, n: int):
        self.index = index
        out = self.xp(y).zeros((n,) + y.shape[1:], dtype=y.dtype)
        out[index] = y
        return out

    def backward(self, grad):
        return (grad[self.index],)


def unpermute_rows(y, index, n: int):
    return UnpermuteRows.apply(y, index=index, n=n)


class RouterLogits(Function):
    """``x @ weight`` in float32 at least (float64 stays float64): a router's scores must not be
    rounded to 16 bits, where close experts would tie (Switch Transformer's selective precision)."""

    op = "router"

    def forward(self, x, weight):
        dtype = np.promote_types(np.promote_types(x.dtype, weight.dtype) if x.dtype.kind == "f" else weight.dtype,
                                 np.float32)
        self.x = x.reshape(-1, x.shape[-1]).astype(dtype, copy=False)
        self.weight, self.shape, self.dtypes = weight.astype(dtype, copy=False), x.shape, (x.dtype, weight.dtype)
        return (self.x @ self.weight).reshape(x.shape[:-1] + (weight.shape[1],))

    def backward(self, grad):
        g = grad.reshape(-1, grad.shape[-1]).astype(self.x.dtype, copy=False)
        grad_x = (g @ self.weight.T).reshape(self.shape).astype(self.dtypes[0], copy=False) if wants_grad(self, 0) else None
        grad_w = (self.x.T @ g).astype(self.dtypes[1], copy=False) if wants_grad(self, 1) else None
        return grad_x, grad_w


def router_logits(x, weight):
    return RouterLogits.apply(x, weight)


def segments(counts) -> list[tuple[int, int, int]]:
    """(expert, first row, end row) of each expert with rows, for rows grouped by expert."""
    bounds = np.concatenate([[0], np.cumsum(counts)]).astype(int)
    return [(e, int(bounds[e]), int(bounds[e + 1])) for e in range(len(counts)) if bounds[e + 1] > bounds[e]]


class GroupedLinear(Function):
    """Rows grouped by expert (``counts[e]`` rows of expert e, in order) times that expert's matrix:
    ``y[rows of e] = x[rows of e] @ weight[e] + bias[e]``; weight (experts, in, out), bias (experts,
    out). One GEMM per expert each way (Megatron's GroupedMLP); an expert without rows gets zeros."""

    op = "grouped_linear"

    def forward(self, x, weight, bias=None, counts=()):
        if weight.ndim != 3 or x.ndim != 2 or x.shape[1] != weight.shape[1] or len(counts) != weight.shape[0] \
                or sum(counts) != x.shape[0]:
            raise ValueError(f"grouped_linear: rows {x.shape} and counts {list(counts)} do not fit weight {weight.shape} "
                             f"(expected x (rows, in), weight (experts, in, out), one count per expert)")
        self.x, self.weight, self.has_bias = x, weight, bias is not None
        self.segments = segments(counts)
        out = self.xp(x).empty((x.shape[0], weight.shape[2]), dtype=np.promote_types(x.dtype, weight.dtype))
        for e, lo, hi in self.segments:
            out[lo:hi] = precision.matmul(x[lo:hi], weight[e], keep_float32=True) + (0 if bias is None else bias[e])
        return out

    def backward(self, grad):
        xp = self.xp(grad)
        grad_x = xp.zeros(self.x.shape, dtype=grad.dtype) if wants_grad(self, 0) else None
        grad_w = xp.zeros(self.weight.shape, dtype=precision.accumulation_dtype(grad.dtype)) if wants_grad(self, 1) else None
        grad_b = xp.zeros((self.weight.shape[0], self.weight.shape[2]), dtype=grad_w.dtype if grad_w is not None
                          else precision.accumulation_dtype(grad.dtype)) if self.has_bias and wants_grad(self, 2) else None
        for e, lo, hi in self.segments:
            g = precision.gemm_operand(grad[lo:hi])
            if grad_x is not None:
                grad_x[lo:hi] = precision.matmul(g, self.weight[e].T)
            if grad_w is not None:
                grad_w[e] = precision.matmul(self.x[lo:hi].T, g, keep_float32=True)
            if grad_b is not None:
                grad_b[e] = precision.sum(grad[lo:hi], axis=0)
        return (grad_x, grad_w, grad_b) if self.has_bias else (grad_x, grad_w)


def grouped_linear(x, weight, bias, counts):
    counts = tuple(int(c) for c in counts)
    if bias is None:
        return GroupedLinear.apply(x, weight, counts=counts)
    return GroupedLinear.apply(x, weight, bias, counts=counts)


class AllToAllRows(Function):
    """Rows to the ranks of ``comm`` (``sent[r]`` of them to rank r, in order), ``received[r]`` from
    each; backward sends the gradients back the same way reversed."""

    op = "ep_communication"

    def forward(self, x, comm, sent, received):
        self.comm, self.sent, self.received = comm, sent, received
        return comm.alltoallv(x, sent, received)

    def backward(self, grad):
        return (self.comm.alltoallv(grad, self.received, self.sent),)


def all_to_all_rows(x, comm, sent, received):
    return x if comm is None or comm.size == 1 else AllToAllRows.apply(x, comm=comm, sent=sent, received=received)


class ScaleGradient(Function):
    """``x`` itself forward; its gradient times ``factor`` backward."""

    op = "scale_gradient"

    def forward(self, x, factor: float):
        self.factor = factor
        return x

    def backward(self, grad):
        return (grad * self.factor,)


def scale_gradient(x, factor: float):
    """``x``, whose gradient backward multiplies by ``factor`` (expert weights under expert
    parallelism: ``1/ep``, so that averaging over the ranks that hold them gives the global mean)."""
    return x if factor == 1 else ScaleGradient.apply(x, factor=float(factor))


class AttachLoss(Function):
    """``x`` itself forward; backward passes ``x``'s gradient through and gives the scalar ``loss``
    the gradient ``scale``: an auxiliary loss made inside a layer (a pipeline stage's MoE router)
    joins the backward of the loss the engine seeds, with the seed's scale (Megatron's
    ``MoEAuxLossAutoScaler``)."""

    op = "attach_loss"

    def forward(self, x, loss, scale: float):
        self.scale, self.shape, self.dtype = scale, loss.shape, loss.dtype
        return x

    def backward(self, grad):
        return grad, self.xp(grad).full(self.shape, self.scale, dtype=self.dtype)


def attach_loss(x, loss, scale: float):
    return AttachLoss.apply(x, loss, scale=float(scale))


