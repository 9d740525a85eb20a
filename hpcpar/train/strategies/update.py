"""The optimizer step of a synchronous strategy, for each way the parameters and their state are held.

    update = ReplicatedUpdate(optimizer, precision, ctx, owns_for_norm)   # DDP, pipeline: averaged grads
    update = ShardedUpdate(zero, precision, ctx, owns_for_norm)           # ZeRO-1: reduce-scatter first
    norm = update.clip(max_norm)      # optional: the global norm over dp, tp and pp
    health = update.step(loss, norm)  # skipped (health.taken False) for a non-finite loss or gradient

``precision`` is the run's ``optim.MasterWeights``: ``MixedPrecision`` (float32 masters, loss
scaling) or ``FullPrecision`` (the model's own parameters), so neither update branches on it.
"""
from __future__ import annotations

import numpy as np

from ...optim.finite import StepHealth
from ...parallel.grad_norm import clip_grad_norm_parallel, counts_toward_norm, sum_over_model_parallel


class ReplicatedUpdate:
    """Every dp replica holds the dp-averaged gradients and the whole optimizer state."""

    def __init__(self, optimizer, precision, ctx, owns_for_norm):
        self.optimizer, self.precision, self.ctx = optimizer, precision, ctx
        self.owns = lambda master: owns_for_norm(precision.model_parameter(master))  # noqa: E731

    def clip(self, max_norm: float) -> float:
        self.precision.unscale_grads()
        return clip_grad_norm_parallel(self.precision.named_master_parameters(), max_norm, self.ctx, owns=self.owns)

    def step(self, loss, norm: float | None = None) -> StepHealth:
        return self.precision.step(self.optimizer, allreduce_max=world_max(self.ctx), loss=loss, norm=norm)


class ShardedUpdate:
    """ZeRO-1: gradients are reduce-scattered by the optimizer; each rank clips and steps its shard."""

    def __init__(self, zero, precision, ctx, owns_for_norm):
        self.optimizer, self.precision, self.ctx = zero, precision, ctx
        self.owns = lambda master: owns_for_norm(precision.model_parameter(master))  # noqa: E731
        self.reduced = False

    def clip(self, max_norm: float) -> float:
        self.precision.unscale_grads()
        self.optimizer.reduce_gradients()
        self.reduced = True
        counts = lambda param: counts_toward_norm(param, self.ctx, self.owns)  # noqa: E731
        return self.optimizer.clip_grad_norm(max_norm, counts=counts, model_parallel_sum=sum_over_model_parallel(self.ctx))

    def step(self, loss, norm: float | None = None) -> StepHealth:
        health = self.precision.step(self.optimizer, allreduce_max=world_max(self.ctx), loss=loss, norm=norm,
                                     reduce=not self.reduced)
        self.reduced = False
        return health


def world_max(ctx):
    """``value -> its maximum over every rank``: each rank takes the same skip decision (a step's
    health: ``optim.finite``)."""
    return lambda value: float(ctx.world.allreduce(np.array([value]), "max")[0])
