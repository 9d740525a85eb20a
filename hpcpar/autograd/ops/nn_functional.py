"""Fused neural-network ops: softmax, losses, normalisation, embedding, dropout, linear, attention.

Each is one Function with a closed-form backward, so a model step makes a few passes over
memory per op instead of one per primitive. Elementwise passes, not matmuls, decide how
close NumPy gets to PyTorch (docs/architecture.md, measured facts), so temporaries are updated in place. Saved
buffers are overwritten during backward where noted: graphs are single-use (tensor.py).
"""
from __future__ import annotations

import math

import numpy as np

from ...backend import get_array_module
from .. import fused, precision
from ..function import Function
from ..fused import softmax_rows as _softmax
from ._common import check_host_range, integer_array, scatter_add_rows, wants_grad


class Softmax(Function):
    op = "softmax"

    def forward(self, a, axis=-1):
        self.axis = axis
        inner = precision.upcast(a)
        self.out = _softmax(inner, axis, in_place=inner is not a)
        return self.out

    def backward(self, grad):
        # dx = y * (g - sum(g * y)), in float32 for 16-bit inputs
        xp = self.xp(grad)
        grad = precision.upcast(grad)
        g = grad * self.out
        row = g.sum(axis=self.axis, keepdims=True)
        xp.subtract(grad, row, out=g)
        g *= self.out
        return (g,)


class LogSoftmax(Function):
    op = "log_softmax"

    def forward(self, a, axis=-1):
        xp = get_array_module(a)
        self.axis = axis
        a = precision.upcast(a)
        out = a - a.max(axis=axis, keepdims=True)
        total = xp.exp(out).sum(axis=axis, keepdims=True)
        out -= xp.log(total, out=total)
        self.out = out
        return out

    def backward(self, grad):
        # dx = g - softmax * sum(g)
        xp = self.xp(grad)
        grad = precision.upcast(grad)
        g = xp.exp(self.out)
        g *= grad.sum(axis=self.axis, keepdims=True)
        xp.subtract(grad, g, out=g)
        return (g,)


class CrossEntropy(Function):
    """Log-softmax and negative log-likelihood in one op; backward is softmax - onehot.

    Computed in float32 (or float64) whatever the logits' dtype; the loss is float32 for 16-bit
    logits and the valid targets are counted as integers."""

    op = "cross_entropy"

    def forward(self, logits, targets, ignore_index=-100, reduction="mean"):
        xp = get_array_module(logits)
        classes = logits.shape[-1]
        x = precision.upcast(logits).reshape(-1, classes)  # (..., C) -> (N, C)
        t = targets.reshape(-1)
        valid = t != ignore_index
        t = xp.where(valid, t, 0)  # the range was checked by cross_entropy() (check_host_range)
        rows = xp.arange(x.shape[0])
        probs = x - x.max(axis=1, keepdims=True)
        picked = probs[rows, t]  # shifted logit of each target
        xp.exp(probs, out=probs)
        total = probs.sum(axis=1)
        nll = xp.log(total)
        nll -= picked
        nll *= valid
        probs *= xp.reciprocal(total, out=total)[:, None]
        self.probs, self.rows, self.targets, self.valid = probs, rows, t, valid
        self.shape, self.reduction = logits.shape, reduction
        if reduction == "none":
            return nll.reshape(targets.shape)
        loss = nll.sum()
        if reduction == "mean":  # over non-ignored targets, counted exactly; 0 (not NaN) when all are ignored
            self.count = xp.maximum(xp.count_nonzero(valid), 1)
            loss = (loss / self.count).astype(nll.dtype)
        return loss

    def backward(self, grad):
        # Each row's gradient is scale * (softmax - onehot(target)); ignored rows get scale 0.
        grad = grad.astype(self.probs.dtype, copy=False)
        if self.reduction == "none":
            scale = grad.reshape(-1) * self.valid
        elif self.reduction == "mean":
            scale = self.valid * (grad / self.count).astype(self.probs.dtype)
        else:
            scale = self.valid * grad
        scale = scale.astype(self.probs.dtype, copy=False)
        g = self.probs  # overwritten: the graph is single-use
        g *= scale[:, None]
        g[self.rows, self.targets] -= scale
        return (g.reshape(self.shape),)


class Embedding(Function):
    op = "embedding"

    def forward(self, weight, ids):
        xp = get_array_module(weight)
        self.ids, self.num_rows = ids, weight.shape[0]
        return xp.take(weight, ids, axis=0)  # (...) -> (..., D)

    def backward(self, grad):
        dim = grad.shape[-1]
        return (scatter_add_rows(self.ids.reshape(-1), grad.reshape(-1, dim), (self.num_rows, dim)),)


class LayerNorm(Function):
    """Normalise over the last axis, then scale and shift; one Function, closed-form backward.

    16-bit inputs are normalised in float32 and rounded once at the output. Backward then keeps
    the input itself and the per-row mean and 1/std (as fused GPU kernels do) and recomputes the
    normalised input in float32, instead of keeping a float32 copy of the size of the input.
    """

    op = "layer_norm"

    def forward(self, x, *params, has_weight=True, has_bias=True, eps=1e-5):
        weight = params[0] if has_weight else None
        bias = params[-1] if has_bias else None
        inner = precision.upcast(x)
        out, xhat, mean, rstd = fused.layer_norm(inner, weight, bias, eps)
        self.low = inner is not x
        # 16 bits: keep x, mean and rstd and recompute xhat; otherwise keep xhat (one pass less)
        self.xhat, self.saved = (None, (x, mean)) if self.low else (xhat, None)
        self.rstd, self.weight = rstd, weight
        self.has_weight, self.has_bias = has_weight, has_bias
        return out

    def backward(self, grad):
        if self.low:
            x, mean = self.saved
            xhat = precision.upcast(x)
            xhat -= mean
            xhat *= self.rstd
            grad = precision.upcast(grad)
        else:
            xhat = self.xhat
        dx, dweight, dbias = fused.layer_norm_backward(grad, xhat, self.rstd, self.weight,
                                                       self.has_weight and wants_grad(self, 1),
                                                       self.has_bias and wants_grad(self, 1 + self.has_weight))
        return (dx, *([dweight] if self.has_weight else []), *([dbias] if self.has_bias else []))


def dropout_scale(rng, p: float, shape, dtype, xp):
    """0 (probability p) or 1/(1-p) for each element of ``shape``, drawn from ``rng``.

    In ``dtype``, except for 16-bit dtypes: there the scales stay float32, so that 1/(1-p) is not
    rounded to 16 bits (bfloat16 would turn 1/0.9 into 1.109) and the product is rounded once."""
    draw_dtype = np.dtype(dtype) if np.dtype(dtype).name in ("float32", "float64") else np.float32  # what generators draw
    return scale_from_uniform(xp.asarray(rng.random(shape, dtype=draw_dtype)), p, dtype)


def scale_from_uniform(uniform, p: float, dtype):
    """``dropout_scale`` from uniform [0, 1) draws (float32, or float64 for float64), reusing their buffer."""
    xp = get_array_module(uniform)
    xp.multiply(uniform >= p, uniform.dtype.type(1.0 / (1.0 - p)), out=uniform)  # uniform <- (uniform >= p) / (1 - p)
    return uniform if precision.is_low(np.dtype(dtype)) else uniform.astype(dtype, copy=False)


class Dropout(Function):
    """``x * scale``: scales drawn from ``rng`` with probability ``p``, or the ``scale`` array given
    (both kept for backward), or drawn by ``mask()`` (a keyed draw: called again in backward, so
    nothing is kept)."""

    op = "dropout"

    def forward(self, x, p=None, rng=None, scale=None, mask=None):
        if mask is not None:
            self.mask, self.scale = mask, None
            return x * mask()
        self.scale = dropout_scale(rng, p, x.shape, x.dtype, get_array_module(x)) if scale is None else scale
        return x * self.scale

    def backward(self, grad):
        return (grad * (self.scale if self.scale is not None else self.mask()),)


class Linear(Function):
    """x (..., in) @ weight (in, out) + bias (out,), folded to one GEMM each way."""

    op = "linear"
    weight_inputs = (1, 2)  # a zero-bubble pipeline may compute these gradients later (autograd.deferred)

    def forward(self, x, weight, bias=None):
        if weight.ndim != 2 or x.ndim < 1 or x.shape[-1] != weight.shape[0]:
            raise ValueError(f"linear: input of shape {x.shape} does not fit weight of shape {weight.shape} "
                             "(expected x (..., in) and weight (in, out))")
        if bias is not None and bias.shape != (weight.shape[1],):
            raise ValueError(f"linear: bias of shape {bias.shape} does not fit weight of shape {weight.shape}")
        x2 = x.reshape(-1, x.shape[-1])  # (..., in) -> (N, in)
        out = precision.matmul(x2, weight, keep_float32=True)  # 16 bits: the bias is added before the one rounding
        if bias is not None:
            out += bias
        self.x2, self.weight, self.x_shape, self.has_bias = x2, weight, x.shape, bias is not None
        return out.reshape(x.shape[:-1] + (weight.shape[1],))  # (N, out) -> (..., out)

    def backward(self, grad):
        g2 = precision.gemm_operand(grad.reshape(-1, grad.shape[-1]))  # (..., out) -> (N, out)
        grad_x = precision.matmul(g2, self.weight.T).reshape(self.x_shape) if wants_grad(self, 0) else None
        grad_w = precision.matmul(self.x2.T, g2) if wants_grad(self, 1) else None
        if not self.has_bias:
            return grad_x, grad_w
        return grad_x, grad_w, precision.sum(g2, axis=0) if wants_grad(self, 2) else None


class Attention(Function):
    """softmax(q k^T / sqrt(hs) + causal mask) v over (B, H, T, hs), probabilities kept for backward.

    ``keep`` (B, H, T, T), optional: the attention-dropout scale (0 or 1/(1-p)) applied to the
    probabilities before they weight ``v``, kept for backward; or ``draw_keep()``, which draws it,
    called in forward and again in backward (nothing kept). With 16-bit inputs the scores, the softmax and its
    backward are float32 and the two products take 16-bit operands (float32 accumulation), as in
    fused GPU attention; the probabilities are kept in the compute dtype.
    """

    op = "attention"

    def forward(self, q, k, v, causal=True, keep=None, draw_keep=None):
        if q.ndim != 4 or q.shape != k.shape or q.shape != v.shape:
            raise ValueError(f"attention: q, k, v must share one (B, H, T, hs) shape, "
                             f"got {q.shape}, {k.shape}, {v.shape}")
        self.scale = 1.0 / math.sqrt(q.shape[-1])
        # Scaling (T, hs) is cheaper than scaling (T, T). On NumPy a 16-bit q is upcast first: the
        # product upcasts its operands anyway, and ml_dtypes' promotion of a 16-bit array times a
        # Python float changed in 0.7 (float32 before, 16-bit since), so the dtype is not left to it.
        q_scaled = precision.gemm_operand(q) * self.scale
        # (B, H, T, hs) @ (B, H, hs, T) -> (B, H, T, T), float32 for 16-bit inputs
        scores = precision.matmul(q_scaled, k.swapaxes(-1, -2), keep_float32=True)
        fused.attention_softmax(scores, causal)
        probs = scores.astype(q.dtype, copy=False)  # 16 bits: rounded once, what backward keeps
        self.draw_keep = draw_keep  # drawn again in backward, not kept
        keep = draw_keep() if draw_keep is not None else keep
        if keep is not None and keep.shape != probs.shape:
            raise ValueError(f"attention: dropout scale of shape {keep.shape} does not fit probabilities {probs.shape}")
        weights = probs if keep is None else (scores * keep).astype(q.dtype, copy=False)
        out = precision.matmul(weights, v)  # (B, H, T, T) @ (B, H, T, hs) -> (B, H, T, hs)
        self.keep = None if self.draw_keep is not None else keep
        self.q_scaled, self.k, self.v, self.probs, self.out = q_scaled, k, v, probs, out
        return out

    def backward(self, grad):
        probs, keep = self.probs, self.keep if self.draw_keep is None else self.draw_keep()
        grad = precision.gemm_operand(grad)  # used by two products and a sum
        weights = probs if keep is None else (precision.upcast(probs) * keep).astype(probs.dtype, copy=False)
        grad_v = precision.matmul(weights.swapaxes(-1, -2), grad)
        d_scores = precision.matmul(grad, self.v.swapaxes(-1, -2), keep_float32=True)  # d weights, (B, H, T, T)
        if keep is not None:
            d_scores *= keep  # d probs
        # Softmax backward needs sum_j dP_ij P_ij = grad_i . out_i (with dropout too, since
        # out_i = sum_j keep_ij P_ij v_j): a (T, hs) product, not (T, T).
        d_scores -= precision.sum(precision.upcast(grad) * self.out, axis=-1, keepdims=True)
        d_scores *= probs  # masked positions have probability 0, so their gradient is 0
        grad_q = precision.matmul(d_scores, self.k, keep_float32=True)
        grad_q *= self.scale
        grad_k = precision.matmul(d_scores.swapaxes(-1, -2), self.q_scaled)
        return grad_q, grad_k, grad_v


def softmax(a, axis=-1):
    return Softmax.apply(a, axis=axis)


def log_softmax(a, axis=-1):
    return LogSoftmax.apply(a, axis=axis)


def cross_entropy(logits, targets, ignore_index=-100, reduction="mean"):
    """Mean (or sum, or per-element) negative log-likelihood of integer ``targets`` under ``logits`` (..., C).

    Targets equal to ``ignore_index`` contribute nothing; the mean is over the others.
    """
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"cross_entropy: reduction must be 'mean', 'sum' or 'none', got {reduction!r}")
    check_host_range(targets, logits.shape[-1], "cross_entropy", "target", "classes", ignore=ignore_index)
    targets = integer_array(targets, getattr(logits, "data", logits), "cross_entropy", "targets")
    if targets.shape != logits.shape[:-1]:
        raise ValueError(f"cross_entropy: logits of shape {logits.shape} need targets of shape "
                         f"{logits.shape[:-1]}, got {targets.shape}")
    return CrossEntropy.apply(logits, targets=targets, ignore_index=ignore_index, reduction=reduction)


def embedding(weight, ids):
    """Rows of ``weight`` (V, D) picked by integer ``ids`` (...): shape (..., D).

    Ids on the host are checked against the rows (``check_host_range``).
    """
    check_host_range(ids, weight.shape[0], "embedding", "id", "rows")
    return Embedding.apply(weight, ids=integer_array(ids, getattr(weight, "data", weight), "embedding", "ids"))


def layer_norm(x, weight, bias, eps=1e-5):
    """Layer normalisation over the last axis; ``weight`` and ``bias`` (D,) may each be None."""
    params = [p for p in (weight, bias) if p is not None]
    for p in params:
        if p.shape != x.shape[-1:]:
            raise ValueError(f"layer_norm: parameter of shape {p.shape} does not fit input {x.shape}")
    return LayerNorm.apply(x, *params, has_weight=weight is not None, has_bias=bias is not None, eps=eps)


def dropout(x, p, rng=None, training=True, scale=None, mask=None):
    """Zero each element with probability ``p`` and scale the rest by 1/(1-p); identity when not training.

    The mask is drawn from ``rng``, or given as ``scale`` (0 or 1/(1-p) per element, as
    ``dropout_scale`` gives it), or drawn by ``mask()`` in forward and again in backward
    (``nn.Dropout``'s keyed masks: the same draws, never kept)."""
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"dropout: p must be in [0, 1], got {p}")
    if not training or p == 0:
        return x
    if scale is not None or mask is not None:
        return Dropout.apply(x, scale=scale, mask=mask)
    if p == 1:
        return x * 0.0
    return Dropout.apply(x, p=p, rng=rng)


def linear(x, weight, bias=None):
    """``x @ weight + bias`` with weight laid out (in_features, out_features)."""
    return Linear.apply(x, weight) if bias is None else Linear.apply(x, weight, bias)


def attention(q, k, v, causal=True, keep=None, draw_keep=None):
    """Scaled dot-product attention over (B, H, T, hs) inputs, causal by default.

    ``keep``: an optional (B, H, T, T) array of attention-dropout scales; ``draw_keep``: a function
    of no arguments that draws them (``nn.HeadDropout.drawer``), called again in backward instead
    of keeping them.
    """
    return Attention.apply(q, k, v, causal=causal, keep=keep, draw_keep=draw_keep)
