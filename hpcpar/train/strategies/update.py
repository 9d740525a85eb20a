"""The optimizer step of a synchronous strategy, for each way the parameters and their state are held.

    update = ReplicatedUpdate(optimizer, precision, ctx, owns_for_norm)   # DDP, pipeline: averaged grads
    update = ShardedUpdate(zero, precision, ctx, owns_for_norm)           # ZeRO-1: reduce-scatter first
    update = ShardedUpdate(zero, precision, ctx, owns_for_norm, sync)     # ZeRO-2: the sync's shard
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
    """ZeRO-1 and -2: each rank clips and steps its shard of the gradient, reduce-scattered by the
    optimizer (ZeRO-1) or during backward by ``reduced_in_backward`` (ZeRO-2's gradient sync)."""

    def __init__(self, zero, precision, ctx, owns_for_norm, reduced_in_backward=None):
        self.optimizer, self.precision, self.ctx = zero, precision, ctx
        self.owns = lambda master: owns_for_norm(precision.model_parameter(master))  # noqa: E731
        self.sync = reduced_in_backward
        self.reduced = False

    def _reduce(self) -> None:
        """The shard gradient in place, unscaled: ZeRO-1 reduces the unscaled masters' gradients,
        ZeRO-2 takes its sync's shard (made of the model's gradients) and unscales that."""
        if self.reduced:
            return
        self.precision.unscale_grads()
        if self.sync is None:
            self.optimizer.reduce_gradients()
        else:
            self.optimizer.take_shard_gradient(self.sync, self.precision.scale)
        self.reduced = True

    def clip(self, max_norm: float) -> float:
        self._reduce()
        counts = lambda param: counts_toward_norm(param, self.ctx, self.owns)  # noqa: E731
        return self.optimizer.clip_grad_norm(max_norm, counts=counts, model_parallel_sum=sum_over_model_parallel(self.ctx))

    def step(self, loss, norm: float | None = None) -> StepHealth:
        if self.sync is not None:  # ZeRO-2: the shard is the only gradient there is to check
            self._reduce()
        grads = list(self.optimizer.named_shard_grads()) if self.sync is not None else None
        health = self.precision.step(self.optimizer, allreduce_max=world_max(self.ctx), loss=loss, norm=norm,
                                     grads=grads, reduce=not self.reduced)
        self.reduced = False
        return health


def world_max(ctx):
    """``value -> its maximum over every rank``: each rank takes the same skip decision (a step's
    health: ``optim.finite``)."""
    return lambda value: float(ctx.world.allreduce(np.array([value]), "max")[0])
