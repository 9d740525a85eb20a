"""Gradient clipping by the global L2 norm, optionally completed across ranks."""
from __future__ import annotations

import math

import numpy as np

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
    grads = list(grads)
    norm = norm_of(grads, allreduce_sum)
    scale_to_norm(grads, norm, max_norm)
    return norm


def norm_of(grads, allreduce_sum=None) -> float:
    """The joint L2 norm of arrays (``allreduce_sum`` as in ``clip_grad_norm``): inf or NaN when an
    element is, or when the squares overflow (what Adam's second moment would hold)."""
    local, = squares_on_host(grads)
    total = float(allreduce_sum(local)) if allreduce_sum is not None else local
    return math.sqrt(total)


def sum_of_squares(grads):
    """The sum of the squares of every element of ``grads``, a 0-d array on their device (None
    for no arrays), summed in at least float32 (the precision policy)."""
    squares = []
    with np.errstate(over="ignore", invalid="ignore"):  # an inf norm is an answer (the step is skipped), not a warning
        for grad in grads:
            flat = grad.reshape(-1).astype(precision.accumulation_dtype(grad.dtype), copy=False)
            squares.append(get_array_module(flat).dot(flat, flat))
        return sum(squares) if squares else None


def squares_on_host(*grad_lists) -> list[float]:
    """The sum of squares of each list of arrays (0.0 for an empty one), in one device-to-host transfer."""
    sums = [sum_of_squares(grads) for grads in grad_lists]
    present = [value for value in sums if value is not None]
    if not present:
        return [0.0] * len(sums)
    xp = get_array_module(present[0])
    zero = xp.zeros((), dtype=present[0].dtype)
    return [float(value) for value in to_host(xp.stack([zero if v is None else v for v in sums]))]


def scale_to_norm(grads, norm: float, max_norm: float) -> None:
    """Scale ``grads`` in place by max_norm / norm when their joint ``norm`` exceeds ``max_norm``."""
    scale = max_norm / (norm + 1e-6)
    if scale < 1.0:
        for grad in grads:
            grad *= scale
