"""Synchronous data parallelism with pp = 1 (tensor parallelism lives inside the model's layers).

DDP's bucketed all-reduce overlapped with backward, with optional compression, or ZeRO-1's
reduce-scatter in the optimizer; ``micro_batches`` > 1 accumulates gradients under
``no_sync``, so the all-reduce runs once per step.
"""
from __future__ import annotations

import time

from ...parallel.data import DistributedDataParallel
from ...parallel.sequence import sync_sequence_parallel_grads
from .base import accumulate_gradients
from .ingredients import make_gradient_compressor
from .synchronous import SynchronousStrategy


class AllReduce(SynchronousStrategy):
    name = "allreduce"

    def __init__(self, job, ctx, model, precision, data=None):
        super().__init__(job, ctx, model)
        p = job.parallel
        self.ddp = None
        # ZeRO reduce-scatters the gradients itself. One replica has nothing to average: its
        # gradients stay where backward left them (no copy into buckets and back, no staging
        # through the host on a GPU), as the pipeline engine does; a compressor still runs,
        # since it changes the gradient.
        compressor = make_gradient_compressor(p)
        if not p.zero and (ctx.dp_size > 1 or compressor is not None):
            self.ddp = DistributedDataParallel(model, ctx, bucket_mb=p.bucket_mb, overlap=p.overlap,
                                               compression=compressor)
        self.build_update(precision, model.named_parameters(), owns_for_norm=lambda param: True)

    def named_parameters(self) -> list:
        return list(self.model.named_parameters())

    def data_parallel(self):
        return self.ddp

    def train_step(self, inputs, targets):
        start = time.perf_counter()
        comm_before = self.ctx.tp.stats.total_seconds + (self.ddp.sync_seconds if self.ddp else 0.0)
        loss = accumulate_gradients(self.model, inputs, targets, self.job.parallel.micro_batches,
                                    self.precision.backward, self.ddp.no_sync if self.ddp else None, self.trace)
        if self.ddp is not None:
            self.ddp.finish_grad_sync()
        elif not self.job.parallel.zero:
            zero_unused_grads(self.model.named_parameters())
        sync_sequence_parallel_grads(self.model.named_parameters(), self.ctx.tp)
        step = time.perf_counter() - start
        comm = self.ctx.tp.stats.total_seconds + (self.ddp.sync_seconds if self.ddp else 0.0) - comm_before
        self.stats = {"step_s": step, "compute_s": step - comm, "comm_s": comm, "idle_s": 0.0}
        return loss

    def describe(self) -> str:
        p = self.job.parallel
        how = ("ZeRO-1 reduce-scatter" if p.zero else f"{len(self.ddp.buckets)} all-reduce bucket(s)" if self.ddp
               else "no gradient all-reduce (one replica)")
        return f"allreduce: {self.ctx.dp_size} replicas, {how}"


def zero_unused_grads(named_parameters) -> None:
    """Zeros for each trainable parameter that backward did not reach, as the all-reduce gives it
    when there are replicas: weight decay and the moments then move the same at every dp."""
    for _, param in named_parameters:
        if param.requires_grad and param.grad is None:
            param.grad = param.xp.zeros_like(param.data)
