"""The global gradient norm of a model split over tensor- and pipeline-parallel ranks."""
from __future__ import annotations

import numpy as np

from ..optim.clip import clip_grad_norm, scale_to_norm


def counts_toward_norm(param, ctx, owns=None) -> bool:
    """Whether this rank counts ``param`` in a global norm, so that each element counts once.

    A tp-sharded parameter by every tp rank (each has its own slice), a tp-replicated one
    (LayerNorm, row-parallel bias) by tp rank 0 only, a weight tied across pipeline stages by
    its lowest holder (``owns(param)``).
    """
    sharded = param.global_shape is not None and tuple(param.global_shape) != param.shape
    return (sharded or ctx.tp_rank == 0) and (owns is None or owns(param))


def sum_over_model_parallel(ctx):
    """``local sum -> sum over the tp and pp groups``: completes a sum of squares over the model's pieces."""
    def total(local: float) -> float:
        value = ctx.tp.allreduce(np.array([local], dtype=np.float64), "sum")
        return float(ctx.pp.allreduce(value, "sum")[0])
    return total


def clip_grad_norm_parallel(named_parameters, max_norm: float, ctx, owns=None) -> float:
    """Clip by the global norm over the whole model however it is split.

    Each element is counted once (``counts_toward_norm``); the sum of squares is then completed
    over tp and pp; dp replicas hold the same averaged gradients and are not summed.
    """
    counted = [p for _, p in named_parameters if counts_toward_norm(p, ctx, owns)]
    norm = clip_grad_norm(counted, float("inf"), allreduce_sum=sum_over_model_parallel(ctx))  # the norm only
    scale_to_norm([p.grad for _, p in named_parameters if p.grad is not None], norm, max_norm)
    return norm
