"""The gradient sync of a synchronous step: how the dp replicas' gradients become one.

    sync = make_gradient_sync(model, ctx, sharded=False, compression=None, bucket_mb=25, overlap=True)
    with sync.no_sync():        # every micro-batch's backward but the last (a pipeline: its whole schedule)
        loss.backward()
    sync.finish()               # the step's end: the gradients are those the update steps on

Both engines (plain forward/backward and the pipeline executor) call only this interface;
``make_gradient_sync`` is the one rule that picks the sync: none, DDP, ZeRO-1 (in the
optimizer), ZeRO-2 (``zero_grads``: bucketed reduce-scatter) or ZeRO-3 (the same over
``zero_params``' layout, which then frees the gathered units).
"""
from __future__ import annotations

import contextlib

import numpy as np

from .data import DistributedDataParallel
from .sequence import sync_sequence_parallel_grads
from .zero_grads import BucketedReduceScatter
from .zero_params import ShardedParameterSync


def make_gradient_sync(holder, ctx, *, sharded: int, compression=None, bucket_mb: float, overlap: bool,
                       alone=(), master_dtype=None, shards=None, replicas=None) -> "GradientSync":
    """The sync of ``holder``'s gradients (a module, or a pipeline's stages; ZeRO-3's
    ``ShardedParameters`` for ``sharded`` = 3): ZeRO-1 (1) reduce-scatters in its optimizer;
    ZeRO-2 (2) and 3 reduce-scatter buckets during backward
    into the shard's ``master_dtype`` (None: the parameters'); replicas, or a compressor (it
    changes the gradient even at dp = 1), take DDP's bucketed all-reduce; one replica keeps its
    gradients where backward left them. ``alone``: parameters another rank holds too (a
    pipeline's tied embedding), which a compressor sees whole and alike on each holder only in
    a bucket of their own. ``shards``, ``replicas``: hybrid sharding's groups (``parallel.hybrid``)."""
    if sharded == 3:  # ``holder`` is then the ZeRO-3 parameter store
        return ShardedParameterSync(holder, ctx, bucket_mb=bucket_mb, overlap=overlap, replicas=replicas)
    if sharded == 2:
        # a stage without parameters (a CNN's pooling) reduces an empty shard: any dtype
        dtype = master_dtype or next((p.dtype for _, p in holder.named_parameters()), np.dtype(np.float32))
        return BucketedReduceScatter(holder, ctx, bucket_mb=bucket_mb, overlap=overlap, dtype=dtype, comm=shards,
                                     replicas=replicas)
    if sharded:
        return OptimizerReduces(holder, ctx)
    if ctx.dp_cp.size > 1 or compression is not None:
        return BucketedAllReduce(DistributedDataParallel(holder, ctx, bucket_mb=bucket_mb, overlap=overlap,
                                                         compression=compression,
                                                         alone=alone if compression is not None else ()), ctx)
    return LocalGradients(holder, ctx)


class GradientSync:
    """No dp exchange; subclasses add theirs in ``_finish_dp``. Every sync completes the tp
    all-reduce of sequence-parallel gradients (``parallel.sequence``) after its own."""

    ddp = None  # the DistributedDataParallel, when the sync is one (its buckets and compressor)

    def __init__(self, holder, ctx):
        self.holder, self.ctx = holder, ctx

    def no_sync(self):
        """Backward inside accumulates locally; the exchange waits for ``finish``."""
        return contextlib.nullcontext()

    def finish(self) -> None:
        """The step's end: this sync's exchange, then sequence parallelism's over tp."""
        self._finish_dp()
        sync_sequence_parallel_grads(self.holder.named_parameters(), self.ctx.tp)

    def _finish_dp(self) -> None:
        pass

    @property
    def seconds(self) -> float:
        """Time spent waiting for this sync's communication so far."""
        return 0.0

    def describe(self) -> str:
        return "no gradient all-reduce"


class OptimizerReduces(GradientSync):
    """ZeRO-1: nothing during backward; the optimizer reduce-scatters the gradients it steps on."""

    def describe(self) -> str:
        return "ZeRO-1 reduce-scatter"


class LocalGradients(GradientSync):
    """One replica: the gradients stay where backward left them (no copy into buckets and back)."""

    def _finish_dp(self) -> None:
        zero_unused_grads(self.holder.named_parameters())

    def describe(self) -> str:
        return "no gradient all-reduce (one replica)"


class BucketedAllReduce(GradientSync):
    """DDP: bucketed all-reduce over dp, optionally compressed."""

    def __init__(self, ddp, ctx):
        super().__init__(ddp, ctx)
        self.ddp = ddp

    def no_sync(self):
        return self.ddp.no_sync()

    def _finish_dp(self) -> None:
        self.ddp.finish_grad_sync()

    @property
    def seconds(self) -> float:
        return self.ddp.sync_seconds

    def describe(self) -> str:
        return f"{len(self.ddp.buckets)} all-reduce bucket(s)"


def zero_unused_grads(named_parameters) -> None:
    """Zeros for each trainable parameter that backward did not reach, as the all-reduce gives it
    when there are replicas: weight decay and the moments then move the same at every dp."""
    for _, param in named_parameters:
        if param.requires_grad and param.grad is None:
            param.grad = param.xp.zeros_like(param.data)
