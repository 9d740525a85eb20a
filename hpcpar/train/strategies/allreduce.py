"""Synchronous data parallelism with pp = 1 (tensor parallelism lives inside the model's layers).

The engine is plain forward and backward with ``micro_batches`` slices accumulated under the
gradient sync's ``no_sync``, so DDP's bucketed all-reduce (overlapped with the last backward,
optionally compressed) runs once per step; ZeRO-1 reduce-scatters in the optimizer instead.
"""
from __future__ import annotations

import time

from .base import accumulate_gradients
from .synchronous import SynchronousStrategy


class AllReduce(SynchronousStrategy):
    name = "allreduce"

    def __init__(self, job, ctx, model, precision, data=None):
        super().__init__(job, ctx, model)
        self.build_gradient_sync(model, precision, overlap=job.parallel.overlap, layers=model.layers())
        self.build_precision(precision, model.named_parameters())
        self.build_update(owns_for_norm=lambda param: True)

    @property
    def ddp(self):
        return self.grad_sync.ddp

    def named_parameters(self) -> list:
        return list(self.model.named_parameters())

    def train_step(self, inputs, targets):
        start = time.perf_counter()
        comm_before = self.ctx.layer_comm_seconds() + self.grad_sync.seconds
        with self.auxiliary_losses():
            loss = accumulate_gradients(self.model, inputs, targets, self.job.parallel.micro_batches,
                                        self.precision.backward, self.grad_sync.no_sync, self.trace)
        self.grad_sync.finish()
        step = time.perf_counter() - start
        comm = self.ctx.layer_comm_seconds() + self.grad_sync.seconds - comm_before
        self.stats = {"step_s": step, "compute_s": step - comm, "comm_s": comm, "idle_s": 0.0}
        return loss

    def describe(self) -> str:
        return f"allreduce: {self.ctx.dp_size} replicas, {self.grad_sync.describe()}{self.sharding()}"
