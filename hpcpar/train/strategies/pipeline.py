"""Pipeline parallelism (pp > 1): ``PipelineParallel`` runs the schedule, tp inside its layers, dp around it."""
from __future__ import annotations

import numpy as np

from ...autograd import Tensor, no_grad
from ...backend import to_host
from ...parallel.pipeline import PipelineParallel
from .ingredients import make_gradient_compressor
from .synchronous import SynchronousStrategy


class Pipeline(SynchronousStrategy):
    name = "pipeline"

    def __init__(self, job, ctx, model, precision, data):
        super().__init__(job, ctx, model)
        p = job.parallel
        sample = None
        if p.partition == "balanced":  # the stages are cut by measured time on one micro-batch
            inputs, _ = data.batch_at(0)
            sample = inputs[: max(1, len(inputs) // p.micro_batches)]
        self.pipe = PipelineParallel(model, ctx, schedule=p.schedule, micro_batches=p.micro_batches,
                                     chunks=p.chunks, partition=p.partition, bucket_mb=p.bucket_mb,
                                     dp_average=not p.zero, sample_input=sample,
                                     compression=make_gradient_compressor(p))
        self.build_update(precision, self.pipe.named_parameters(), owns_for_norm=self.pipe.owns_for_norm)
        self.pipe.backward_loss = self.precision.backward  # the last stage's backward seeded with the scale

    def named_parameters(self) -> list:
        return self.pipe.named_parameters()

    def data_parallel(self):
        return self.pipe.ddp

    def train_step(self, inputs, targets):
        tp_before = self.ctx.tp.stats.total_seconds
        loss = self.pipe.train_step(inputs, targets)
        self.trace.add_actions(self.pipe.trace)  # F, B, W, sends and receives, as the schedule ran them
        s = self.pipe.stats
        tp = self.ctx.tp.stats.total_seconds - tp_before
        self.stats = {"step_s": s["step_s"], "compute_s": s["compute_s"] - tp, "comm_s": s["comm_s"] + tp,
                      "idle_s": s["idle_s"]}
        return loss

    def evaluate_loss(self, inputs, targets) -> float:
        """Forward only through the stages; the last stage's loss, shared with every pp rank."""
        outputs = self.pipe.infer([inputs])  # the last stage gets the logits, the others None
        with no_grad():
            loss = self.pipe.loss_fn(Tensor(outputs[0]), targets).item() if outputs else 0.0
        return float(self.ctx.pp.allreduce(np.array([loss]), "sum")[0])

    def evaluate_outputs(self, inputs):
        """Forward only through the stages: the last stage's outputs, sent to every pp rank (a
        rank holds only its stages' trained layers, so the whole model there would be wrong)."""
        outputs = self.pipe.infer([inputs])  # the last stage gets the logits, the others None
        last = self.ctx.pp_size - 1  # the rank of the last virtual stage, with chunks too
        return Tensor(self.ctx.pp.bcast_object(to_host(outputs[0]) if outputs else None, root=last))

    def describe(self) -> str:
        p = self.job.parallel
        return f"pipeline: {self.ctx.pp_size} stages, {p.schedule}, {p.micro_batches} micro-batches"
