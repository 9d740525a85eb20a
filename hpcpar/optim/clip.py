"""Gradient clipping by the global L2 norm, optionally completed across ranks."""
from __future__ import annotations

import math

from ..autograd import precision
from ..backend import get_array_module, to_host


def clip_grad_norm(params, max_norm: float, allreduce_sum=None) -> float:
    """Scale all gradients in place so their joint L2 norm is at most ``max_norm``; return the norm before.

    ``allreduce_sum(local_sum_of_squares) -> global sum`` completes the norm across ranks
    that each hold a part of the gradients (tensor- or pipeline-parallel shards); each element
    must be counted on exactly one rank. Squares are summed in at least float32 (the precision policy).
    """
    return clip_arrays([p.grad for p in params if p.grad is not None], max_norm, allreduce_sum)


def clip_arrays(grads, max_norm: float, allreduce_sum=None) -> float:
    """``clip_grad_norm`` of gradient arrays themselves (views of a flat buffer, say)."""
    squares = []
    for grad in grads:
        flat = grad.reshape(-1).astype(precision.accumulation_dtype(grad.dtype), copy=False)
        squares.append(get_array_module(flat).dot(flat, flat))
    local = float(to_host(sum(squares))) if squares else 0.0  # one device-to-host transfer
    total = float(allreduce_sum(local)) if allreduce_sum is not None else local
    norm = math.sqrt(total)
    scale_to_norm(grads, norm, max_norm)
    return norm


def scale_to_norm(grads, norm: float, max_norm: float) -> None:
    """Scale ``grads`` in place by max_norm / norm when their joint ``norm`` exceeds ``max_norm``."""
    scale = max_norm / (norm + 1e-6)
    if scale < 1.0:
        for grad in grads:
            grad *= scale
