"""One interface over the strategies, for the training loop and ``hpcpar compare``.

An engine takes this dp replica's rows of the global batch, runs forward and backward (with
gradient accumulation or pipeline micro-batches), leaves the dp-averaged gradients in its
parameters and returns the loss. It also says where the step's time went.

- ``DataParallelEngine``: pp = 1 (tensor parallelism lives inside the model): DDP with
  bucketed, overlapped all-reduce and optional compression, or ZeRO-1's reduce-scatter;
  ``micro_batches`` > 1 accumulates gradients under ``no_sync``.
- ``PipelineEngine``: pp > 1: ``PipelineParallel`` (its dp averaging included).
"""
from __future__ import annotations

import time

import numpy as np

from ..parallel.data import DistributedDataParallel
from ..parallel.pipeline import PipelineParallel
from ..parallel.tensor import sync_sequence_parallel_grads


def _split_rows(batch, parts: int):
    size = len(batch) // parts
    return [batch[k * size:(k + 1) * size] for k in range(parts)]


class DataParallelEngine:
    def __init__(self, model, ctx, micro_batches=1, bucket_mb=25.0, overlap=True, compressor=None,
                 reduce_gradients=True, scale_loss=None):
        """``reduce_gradients=False`` leaves the dp reduction to the optimizer (ZeRO-1);
        ``scale_loss(loss)`` runs backward (mixed precision seeds it with the loss scale)."""
        self.model, self.ctx, self.micro_batches = model, ctx, micro_batches
        self.ddp = (DistributedDataParallel(model, ctx, bucket_mb=bucket_mb, overlap=overlap, compression=compressor)
                    if reduce_gradients else None)
        self.backward = scale_loss or (lambda loss: loss.backward())
        self.stats: dict = {}

    def named_parameters(self):
        return list(self.model.named_parameters())

    def owns_for_norm(self, param) -> bool:
        return True

    def train_step(self, inputs, targets) -> float:
        start = time.perf_counter()
        tp_before = self.ctx.tp.stats.total_seconds
        sync_before = self.ddp.sync_seconds if self.ddp else 0.0
        total = 0.0
        pieces = list(zip(_split_rows(inputs, self.micro_batches), _split_rows(targets, self.micro_batches)))
        for k, (x, y) in enumerate(pieces):
            loss = self.model.loss(x, y) * (1.0 / self.micro_batches)
            if self.ddp is not None and k < len(pieces) - 1:
                with self.ddp.no_sync():
                    self.backward(loss)
            else:
                self.backward(loss)
            total += loss.item()
        if self.ddp is not None:
            self.ddp.finish_grad_sync()
        sync_sequence_parallel_grads(self.model.named_parameters(), self.ctx.tp)
        step = time.perf_counter() - start
        comm = (self.ddp.sync_seconds - sync_before if self.ddp else 0.0) + self.ctx.tp.stats.total_seconds - tp_before
        self.stats = {"step_s": step, "compute_s": step - comm, "comm_s": comm, "idle_s": 0.0}
        return total

    def evaluate_loss(self, inputs, targets) -> float:
        return self.model.loss(inputs, targets).item()


class PipelineEngine:
    def __init__(self, model, ctx, **options):
        self.ctx = ctx
        self.pipe = PipelineParallel(model, ctx, **options)
        self.stats: dict = {}

    def named_parameters(self):
        return self.pipe.named_parameters()

    def owns_for_norm(self, param) -> bool:
        return self.pipe.owns_for_norm(param)

    def train_step(self, inputs, targets) -> float:
        tp_before = self.ctx.tp.stats.total_seconds
        loss = self.pipe.train_step(inputs, targets)
        s = self.pipe.stats
        tp = self.ctx.tp.stats.total_seconds - tp_before
        self.stats = {"step_s": s["step_s"], "compute_s": s["compute_s"] - tp, "comm_s": s["comm_s"] + tp,
                      "idle_s": s["idle_s"]}
        return loss

    def evaluate_loss(self, inputs, targets) -> float:
        """Forward only through the stages; the last stage's loss, shared with every pp rank."""
        from ..autograd import no_grad

        from ..autograd import Tensor

        outputs = self.pipe.infer([inputs])  # the last stage gets the logits, the others None
        with no_grad():
            loss = self.pipe.loss_fn(Tensor(outputs[0]), targets).item() if outputs else 0.0
        return float(self.ctx.pp.allreduce(np.array([loss]), "sum")[0])
