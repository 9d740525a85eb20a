"""The global gradient norm of a model split over tensor-, pipeline- and expert-parallel ranks."""
from __future__ import annotations

import math

import numpy as np

from ..optim.clip import scale_to_norm, squares_on_host


def counts_toward_norm(param, ctx, owns=None) -> bool:
    """Whether this rank counts ``param`` in a global norm, so that each element counts once.

    A tp-sharded parameter by every tp rank (each has its own slice), a tp-replicated one
    (LayerNorm, row-parallel bias) by tp rank 0 only, a weight tied across pipeline stages by
    its lowest holder (``owns(param)``). Experts split over ep (axis 0) count by the same rule on
    their other axes; their squares are then summed over ep (``expert_squares_summed``).
    """
    shape, full = param.shape, param.global_shape
    if param.expert_parallel:
        shape, full = shape[1:], full[1:]
    sharded = full is not None and tuple(full) != tuple(shape)
    return (sharded or ctx.tp_rank == 0) and (owns is None or owns(param))


def sum_over_model_parallel(ctx):
    """``local sum -> sum over the tp and pp groups``: completes a sum of squares over the model's pieces."""
    def total(local: float) -> float:
        value = ctx.tp.allreduce(np.array([local], dtype=np.float64), "sum")
        return float(ctx.pp.allreduce(value, "sum")[0])
    return total


def expert_squares_summed(dense: float, experts: float, ctx) -> float:
    """This rank's sum of squares: its dense part plus its ep group's expert parts (each rank of
    the group holds other experts; the dense part is the same on all of them)."""
    group = ctx.expert_group()
    if group is None:
        return dense + experts
    return dense + float(group.allreduce(np.array([experts], dtype=np.float64), "sum")[0])


def clip_grad_norm_parallel(named_parameters, max_norm: float, ctx, owns=None) -> float:
    """Clip by the global norm over the whole model however it is split.

    Each element is counted once (``counts_toward_norm``); the sum of squares is then completed
    over ep (experts), tp and pp; dp replicas hold the same averaged gradients and are not summed.
    """
    counted = [p for _, p in named_parameters if counts_toward_norm(p, ctx, owns)]
    dense, experts = squares_on_host([p.grad for p in counted if p.grad is not None and not p.expert_parallel],
                                     [p.grad for p in counted if p.grad is not None and p.expert_parallel])
    local = expert_squares_summed(dense, experts, ctx)
    norm = math.sqrt(sum_over_model_parallel(ctx)(local))
    scale_to_norm([p.grad for _, p in named_parameters if p.grad is not None], norm, max_norm)
    return norm
