"""ZeRO-2's gradient sync: each bucket reduce-scattered during backward into this rank's shard.

    sync = BucketedReduceScatter(model, ctx, bucket_mb=25, overlap=True, dtype=np.float32)
    loss.backward()                    # a bucket starts its reduce-scatter once its gradients are final
    sync.finish()                      # wait; the shard gradient holds the dp mean of this rank's part
    zero.shard.grad = sync.take_shard_gradient()
    zero.step(reduce=False)

A bucket is a run of consecutive parameters of ZeRO-1's flat layout (``zero.flat_layout``), so
its reduce-scatter, in uneven pieces, sends each rank the part inside its shard. Gradients are
freed as they are copied in, buckets once reduced, at most ``IN_FLIGHT`` in flight; buckets
launch in index order and unused parameters give zeros, so every rank makes the same calls.
More: docs/architecture.md, "ZeRO-2".
"""
from __future__ import annotations

import math
import time

import numpy as np

from .. import defaults
from ..backend import get_array_module
from .data import plan_buckets
from .hybrid import average_over
from .zero import flat_layout, range_pieces

IN_FLIGHT = 2  # buckets reduced at once: one filling while one is on the wire, as DeepSpeed's double buffer


class ShardBucket:
    """A run of consecutive parameters (``slots``, descending) of the flat layout, [begin, end) in it."""

    def __init__(self, index: int, slots: list[int], begin: int, end: int):
        self.index, self.slots, self.begin, self.end = index, slots, begin, end
        self.flat = None  # made when its first gradient arrives, dropped once reduced
        self.ready: set = set()
        self.pending = None


class BucketedReduceScatter:
    """ZeRO-2: bucketed reduce-scatter over dp, overlapped with backward; the shard gradient in the
    end. Implements ``grad_sync.GradientSync``'s interface (which picks it, so it cannot import it)."""

    ddp = None  # no DDP: nothing is all-reduced

    def __init__(self, holder, ctx, *, bucket_mb: float = defaults.BUCKET_MB, overlap: bool = True, dtype,
                 comm=None, replicas=None):
        """``comm``: what the shards are over (default dp); ``replicas``: hybrid sharding's groups
        across, over which the shard gradient is averaged at the end (``parallel.hybrid``)."""
        self.holder, self.ctx = holder, ctx
        self.comm, self.replicas, self.overlap, self.dtype = comm or ctx.dp_cp, replicas, overlap, dtype
        named = list(holder.named_parameters())
        self.names = [name for name, _ in named]
        self.params = [p for _, p in named]
        self.offsets, self.shard_size = flat_layout([p.size for p in self.params], self.comm.size)
        self.xp = get_array_module(self.params[0].data) if self.params else np
        bucket_bytes = math.inf if bucket_mb is None or bucket_mb == math.inf else bucket_mb * (1 << 20)
        self.buckets, self._where = [], {}
        for b, slots in enumerate(plan_buckets(self.params, bucket_bytes)):  # each a descending run
            last = slots[0]
            self.buckets.append(ShardBucket(b, slots, self.offsets[slots[-1]], self.offsets[last] + self.params[last].size))
            for slot in slots:
                self._where[id(self.params[slot])] = (b, slot)
        self._sync_enabled = True
        self._next_launch = 0
        self._shard_grad = None
        self.peak_bucket_bytes = 0  # the most bucket memory alive at once so far
        self.sync_seconds = 0.0
        for p in self.params:
            if p.requires_grad:
                p.register_grad_hook(self._on_grad_ready)

    # ----- the GradientSync interface -------------------------------------------------
    def no_sync(self):
        return _Paused(self)

    def _finish_dp(self) -> None:
        if not self._sync_enabled:
            return
        start = time.perf_counter()
        for bucket in self.buckets[self._next_launch:]:  # those not launched during backward, one by one
            for slot in bucket.slots:
                if slot not in bucket.ready:  # no gradient this step (or no overlap): in now, zeros if none
                    self._copy_in(bucket, slot)
            self._launch_ready()
        for bucket in self.buckets:
            self._complete(bucket)
        average_over(self.replicas, self._shard())  # a stage without parameters still has its (empty) shard
        self._next_launch = 0
        self.sync_seconds += time.perf_counter() - start

    def finish(self) -> None:
        """The step's end: every bucket reduced, then sequence parallelism's tp sum on the shard."""
        self._finish_dp()
        if self._sync_enabled:
            self._sum_sequence_parallel_over_tp()

    @property
    def seconds(self) -> float:
        return self.sync_seconds

    def describe(self) -> str:
        return f"ZeRO-2: {len(self.buckets)} reduce-scatter bucket(s)"

    def check_layout(self, zero) -> None:
        """Raise unless ``zero`` (the ZeroRedundancyOptimizer stepping the shards) lays out the same
        parameters in the same order: the shard this sync fills is then the one it steps."""
        mine = [(name, p.size) for name, p in zip(self.names, self.params)]
        if mine != [(name, p.size) for name, p in zip(zero.names, zero.params)] or zero.shard_size != self.shard_size:
            raise ValueError("ZeRO-2: the gradient sync and the optimizer lay the parameters out differently")

    def take_shard_gradient(self):
        """This step's shard gradient (the dp mean of this rank's part, zeros in the padding); the
        sync forgets it, so the optimizer owns and frees it."""
        grad, self._shard_grad = self._shard_grad, None
        if grad is None:
            raise RuntimeError("ZeRO-2: no shard gradient; finish() was not called after backward this step")
        return grad

    # ----- backward's hooks ----------------------------------------------------------
    def _on_grad_ready(self, param) -> None:
        if not self._sync_enabled:
            return
        b, slot = self._where[id(param)]
        self._copy_in(self.buckets[b], slot)
        if self.overlap:
            self._launch_ready()
            for launched in self.buckets[:self._next_launch]:  # progress for MPI libraries without a thread
                if launched.pending is not None:
                    launched.pending.test()

    def _copy_in(self, bucket: ShardBucket, slot: int) -> None:
        """The parameter's final gradient (None: zeros) into its bucket, in the shard's dtype; the
        parameter's own gradient is then freed."""
        if bucket.flat is None:
            bucket.flat = self.xp.empty(bucket.end - bucket.begin, dtype=self.dtype)
            self._note_bucket_memory()
        p = self.params[slot]
        view = bucket.flat[self.offsets[slot] - bucket.begin: self.offsets[slot] - bucket.begin + p.size]
        if p.grad is None:
            view[...] = 0
        else:
            view[...] = p.grad.reshape(-1)
            p.grad = None
        bucket.ready.add(slot)

    def _launch_ready(self) -> None:
        """Launch full buckets in index order, first completing the oldest in flight when
        ``IN_FLIGHT`` are (so a bucket's memory is back before the next but one is made)."""
        while self._next_launch < len(self.buckets):
            bucket = self.buckets[self._next_launch]
            if len(bucket.ready) < len(bucket.slots):
                return
            in_flight = [b for b in self.buckets[:self._next_launch] if b.pending is not None]
            if len(in_flight) >= IN_FLIGHT:
                self._complete(in_flight[0])
            counts = range_pieces(bucket.begin, bucket.end, self.shard_size, self.comm.size)
            lo = max(bucket.begin, self.comm.rank * self.shard_size) - self.comm.rank * self.shard_size
            out = self._shard()[lo: lo + counts[self.comm.rank]]
            bucket.pending = self.comm.ireduce_scatter(bucket.flat, counts, out, "mean")
            self._next_launch += 1

    def _complete(self, bucket: ShardBucket) -> None:
        """Wait for ``bucket``'s reduce-scatter (its piece is in the shard gradient) and free it."""
        if bucket.pending is not None:
            bucket.pending.wait()
            bucket.pending = None
        bucket.flat = None
        bucket.ready.clear()

    def _shard(self):
        if self._shard_grad is None:
            self._shard_grad = self.xp.zeros(self.shard_size, dtype=self.dtype)
        return self._shard_grad

    def _note_bucket_memory(self) -> None:
        alive = sum(b.flat.nbytes for b in self.buckets if b.flat is not None)
        self.peak_bucket_bytes = max(self.peak_bucket_bytes, alive)

    # ----- sequence parallelism ------------------------------------------------------
    def _sum_sequence_parallel_over_tp(self) -> None:
        """Sum over tp the shard's parts of sequence-parallel parameters (their gradients are partial
        sums of this rank's sequence slice, ``parallel.sequence``); every tp rank's shard covers
        the same parameters, so the parts line up. One all-reduce, as without ZeRO-2."""
        tp = self.ctx.tp
        if tp.size == 1:
            return
        grad, start = self._shard(), self.comm.rank * self.shard_size
        spans = []
        for p, offset in zip(self.params, self.offsets):
            lo, hi = max(offset, start), min(offset + p.size, start + self.shard_size)
            if getattr(p, "sequence_parallel", False) and lo < hi:
                spans.append((lo - start, hi - start))
        if not spans:
            return
        summed = tp.allreduce(self.xp.concatenate([grad[a:b] for a, b in spans]), "sum")
        at = 0
        for a, b in spans:
            grad[a:b] = summed[at: at + b - a]
            at += b - a


class _Paused:
    """``no_sync()``: backward accumulates whole gradients locally; the step's last backward reduces."""

    def __init__(self, sync: BucketedReduceScatter):
        self.sync = sync

    def __enter__(self):
        self.previous, self.sync._sync_enabled = self.sync._sync_enabled, False

    def __exit__(self, *exc):
        self.sync._sync_enabled = self.previous
