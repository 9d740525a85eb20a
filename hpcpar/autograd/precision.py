"""The mixed-precision policy: what every op computes in, written down once.

A model computes in its parameters' dtype. In float32 and float64 each op runs in that dtype and
nothing here changes a value. When a tensor input of an op is 16-bit (float16, or bfloat16 from
``ml_dtypes``), that dtype is the op's *compute dtype* and the op follows one of three rules
(``COMPUTE``, ``FLOAT32_INSIDE``, ``FLOAT32``, described where they are defined), as PyTorch's
autocast op lists do. Whatever the rule, counts (valid targets, tied maxima, elements of a mean)
are integers, never floats of the compute dtype (bfloat16 stops counting at 256, float16
overflows at 65504), and every sum over many elements accumulates in float32, the sums inside
backward too: bias and LayerNorm weight gradients, undoing broadcasts, embedding rows,
convolution folds (``accumulate``).

``Function.apply`` enforces each op's output rule from ``POLICY`` (each Function names its op),
``Tensor.backward`` gives every gradient its tensor's dtype; docs/precision.md shows the same table.
"""
from __future__ import annotations

import numpy as np

from ..backend import get_array_module

# Output (and what backward keeps) in the compute dtype. Matrix products (matmul, linear, conv2d,
# attention's two products) multiply 16-bit operands with float32 accumulation and round the result
# once to 16 bits, as a GPU's tensor cores do; NumPy has no 16-bit GEMM, so there they are float32
# BLAS on upcast operands (``matmul`` below). Elementwise ops round after each step, as on a GPU.
COMPUTE = "compute dtype"
# Upcast, compute in float32 (statistics, exponentials, the sums), return the compute dtype:
# softmax, log_softmax, layer_norm, gelu, attention's softmax.
FLOAT32_INSIDE = "float32 inside, compute dtype out"
# Return float32: the losses and the reductions that feed them (sum, mean). Outside the autograd
# the same holds for gradient norms (clipping) and the optimizer's math on the float32 master
# weights (``optim.amp``).
FLOAT32 = "float32"
RULES = (COMPUTE, FLOAT32_INSIDE, FLOAT32)

# op -> (rule, what runs in float32 or why). Ops are the names in ``hpcpar.autograd.ops`` and the
# tensor-parallel ops; the last rows are not autograd ops but belong to the same policy.
POLICY: dict[str, tuple[str, str]] = {
    "add": (COMPUTE, "broadcast gradients summed in float32"),
    "sub": (COMPUTE, "broadcast gradients summed in float32"),
    "mul": (COMPUTE, "broadcast gradients summed in float32"),
    "div": (COMPUTE, "broadcast gradients summed in float32"),
    "neg": (COMPUTE, ""),
    "pow": (COMPUTE, ""),
    "matmul": (COMPUTE, "float32 accumulation, rounded once"),
    "linear": (COMPUTE, "float32 accumulation; bias gradient summed in float32"),
    "conv2d": (COMPUTE, "float32 accumulation; input gradient folded in float32"),
    "max_pool2d": (COMPUTE, "exact"),
    "avg_pool2d": (COMPUTE, "window sums in float32"),
    "embedding": (COMPUTE, "repeated rows' gradients summed in float32"),
    "dropout": (COMPUTE, "scale 1/(1-p) applied in float32"),
    "exp": (COMPUTE, ""),
    "log": (COMPUTE, ""),
    "sqrt": (COMPUTE, ""),
    "tanh": (COMPUTE, ""),
    "relu": (COMPUTE, "exact"),
    "where": (COMPUTE, "exact"),
    "masked_fill": (COMPUTE, "exact"),
    "max": (COMPUTE, "exact; tied maxima counted exactly (float32 or wider)"),
    "reshape": (COMPUTE, "exact"),
    "transpose": (COMPUTE, "exact"),
    "getitem": (COMPUTE, "repeated indices' gradients summed in float32"),
    "concatenate": (COMPUTE, "exact"),
    "tp_communication": (COMPUTE, "copy/reduce/scatter/gather over tp; bfloat16 reduces in float32"),
    "recompute": (COMPUTE, "not an op: a recomputed region; its ops follow their own rules, its output "
                           "is what the region returns"),
    "backward_hook": (COMPUTE, "identity (its output is its input); its backward calls a hook"),
    "softmax": (FLOAT32_INSIDE, "max, exp, sum and backward in float32"),
    "log_softmax": (FLOAT32_INSIDE, "max, exp, log-sum and backward in float32"),
    "layer_norm": (FLOAT32_INSIDE, "mean, variance, normalisation and backward in float32; keeps the "
                                   "input and per-row statistics, not a float32 copy"),
    "gelu": (FLOAT32_INSIDE, "tanh polynomial in float32; backward recomputes it from the input"),
    "attention": (FLOAT32_INSIDE, "scores, softmax and its backward in float32; the products in the "
                                  "compute dtype; probabilities kept in the compute dtype"),
    "ring_attention": (FLOAT32_INSIDE, "as attention, over the cp ring: scores, log-sum-exp merges, the output "
                                       "accumulator and the dK/dV passed around the ring in float32"),
    "router": (FLOAT32, "an MoE router's scores: float32 operands and product (float64 stays float64), so that "
                        "close experts do not tie in 16 bits"),
    "grouped_linear": (COMPUTE, "as linear, per expert: float32 accumulation; weight and bias gradients in float32"),
    "unpermute_rows": (COMPUTE, "exact: rows placed into slots"),
    "ep_communication": (COMPUTE, "exact: all-to-all over ep moves rows, sums nothing"),
    "attach_loss": (COMPUTE, "identity; the auxiliary loss's seed in its own dtype"),
    "scale_gradient": (COMPUTE, "identity; the gradient multiplied by a constant (1/ep) in its own dtype"),
    "sum": (FLOAT32, "accumulated in float32"),
    "mean": (FLOAT32, "accumulated in float32, divided by an integer count"),
    "cross_entropy": (FLOAT32, "log-softmax in float32, valid targets counted as integers"),
    "vocab_parallel_cross_entropy": (FLOAT32, "as cross_entropy, the sums all-reduced in float32"),
    "clip_grad_norm": (FLOAT32, "not an op: sums of squares in float32, float64 across ranks"),
    "optimizer_step": (FLOAT32, "not an op: the optimizer updates float32 master weights"),
}

_LOW_NAMES = ("float16", "bfloat16")
_FLOAT32 = np.dtype(np.float32)


def rule(op: str | None) -> str:
    """The rule of ``op``; a Function that names no op (one written outside hpcpar) computes in the compute dtype."""
    if op is None:
        return COMPUTE
    if op not in POLICY:
        raise KeyError(f"precision policy: no rule for op {op!r}; add it to POLICY in hpcpar/autograd/precision.py "
                       f"and to docs/precision.md")
    return POLICY[op][0]


def is_low(dtype) -> bool:
    """Whether ``dtype`` is a 16-bit float (float16 or ml_dtypes' bfloat16)."""
    return dtype.itemsize == 2 and dtype.name in _LOW_NAMES


def accumulation_dtype(dtype):
    """float32 for 16-bit dtypes, the dtype itself otherwise (float32 and float64 keep their own)."""
    return _FLOAT32 if is_low(dtype) else dtype


def upcast(x):
    """``x`` as float32 when 16-bit (a new array), else ``x`` itself (no copy)."""
    return x.astype(_FLOAT32) if is_low(x.dtype) else x


def compute_dtype(arrays):
    """The first 16-bit dtype among ``arrays``, or None (then the policy changes nothing)."""
    for array in arrays:
        if is_low(array.dtype):
            return array.dtype
    return None


def enforce(op_rule: str, out, compute):
    """``out`` in the dtype its rule gives under the compute dtype ``compute`` (floating outputs only)."""
    target = _FLOAT32 if op_rule == FLOAT32 else compute
    if out.dtype == target or out.dtype.kind not in "fV":
        return out
    return out.astype(target)


def like(grad, dtype):
    """A gradient in its tensor's ``dtype`` (a float32 gradient of a bfloat16 tensor is rounded to it)."""
    return grad if grad.dtype == dtype else grad.astype(dtype)


def matmul(a, b, keep_float32: bool = False):
    """``a @ b``; with a 16-bit operand, float32 accumulation rounded once to the compute dtype, or
    returned as float32 with ``keep_float32`` (for a softmax or a bias that follows). On NumPy the
    operands are upcast for float32 BLAS; on CuPy cuBLAS multiplies float16 with float32
    accumulation and ``keep_float32`` upcasts its float16 result."""
    low = compute_dtype((a, b))
    if low is None:
        return a @ b
    if get_array_module(a) is np:  # NumPy's float16 matmul has no BLAS (~100x slower): upcast
        a, b = a.astype(_FLOAT32, copy=False), b.astype(_FLOAT32, copy=False)
    out = a @ b
    return out.astype(_FLOAT32 if keep_float32 else low, copy=False)


def gemm_operand(x):
    """``x`` as the operand of several ``matmul`` calls: upcast once on NumPy (which would upcast it
    for each), unchanged elsewhere (CuPy multiplies float16 itself)."""
    return upcast(x) if get_array_module(x) is np else x


def sum(x, axis=None, keepdims=False):  # noqa: A001 - the reduction of the policy, like ndarray.sum
    """``x.sum(axis)`` accumulated in float32 when ``x`` is 16-bit; the result in the accumulation dtype."""
    if is_low(x.dtype):
        return x.sum(axis=axis, dtype=_FLOAT32, keepdims=keepdims)
    return x.sum(axis=axis, keepdims=keepdims)
