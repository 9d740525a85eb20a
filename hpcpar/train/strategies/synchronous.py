"""What the synchronous strategies share: every replica steps on the dp-averaged gradients.

Subclasses (``AllReduce``, ``Pipeline``) run the step's forward and backward; the optimizer,
mixed precision and the step's end are built here, the same for both: the optimizer is ZeRO-1
(``parallel.zero``: state sharded over dp, gradients reduce-scattered) or a plain one on
dp-averaged gradients, stepping float32 masters under fp16/bf16.
"""
from __future__ import annotations

import time

from ...parallel.compression_state import CompressionState
from ...parallel.zero import ZeroRedundancyOptimizer
from ...state import Together
from .base import Strategy
from .ingredients import optimizer_class, state_bytes
from .update import ReplicatedUpdate, ShardedUpdate


class SynchronousStrategy(Strategy):
    def build_update(self, precision, named, owns_for_norm) -> None:
        """The master weights of ``precision``, optimizer and update over this rank's parameters ``named``."""
        self.precision = precision.masters(named)
        masters = self.precision.named_master_parameters()
        cls, options = optimizer_class(self.job)
        if self.job.parallel.zero:
            self._optimizer = ZeroRedundancyOptimizer(masters, self.ctx.dp, cls, **options)
            self.update = ShardedUpdate(self._optimizer, self.precision, self.ctx, owns_for_norm)
        else:
            self._optimizer = cls(masters, **options)
            self.update = ReplicatedUpdate(self._optimizer, self.precision, self.ctx, owns_for_norm)

    @property
    def optimizer(self):
        return self._optimizer

    def finish_step(self, max_norm: float, loss: float) -> bool:
        comm_before = self.ctx.comm_seconds()
        start = time.perf_counter()
        if max_norm > 0:
            self.update.clip(max_norm)
        taken = self.update.step(loss)
        self._optimizer.zero_grad()
        for _, param in self.named_parameters():  # the model's own grads (distinct from masters under amp)
            param.grad = None
        comm = self.ctx.comm_seconds() - comm_before
        self.stats["comm_s"] = self.stats.get("comm_s", 0.0) + comm
        self.stats["compute_s"] = self.stats.get("compute_s", 0.0) + time.perf_counter() - start - comm
        self.stats.update(self.precision.metrics())
        return taken

    def optimizer_state_bytes(self) -> int:
        optimizer = self._optimizer.state_bytes() if self.job.parallel.zero else state_bytes(self._optimizer)
        return optimizer + self.precision.master_bytes()

    def weight_decays(self) -> dict:
        return self._optimizer.named_weight_decays()

    def data_parallel(self):
        """The DDP that reduces gradients over dp, with its buckets and compressor (None: ZeRO-1,
        or one replica without compression)."""
        return None

    def checkpoint_target(self) -> tuple:
        """The float32 masters, the optimizer and, when the compressor carries error feedback
        from step to step, that too unless ``checkpoint.compression_state`` is off
        (``parallel.compression_state``): the resume is then exact."""
        optimizer, ddp = self._optimizer, self.data_parallel()
        if ddp is not None and ddp.compression.carries_state:
            optimizer = Together(optimizer, CompressionState(ddp.compression, self.ctx, ddp.buckets,
                                                             saved=self.job.checkpoint.compression_state))
        return self.precision.named_master_parameters(), optimizer, self.ctx

    def checkpoint_extra(self) -> dict:
        return {} if self.precision.scaler is None else {"scaler": self.precision.scaler}

    def after_load(self) -> None:
        self.precision.copy_to_model()
