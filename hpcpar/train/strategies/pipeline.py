"""Pipeline parallelism (pp > 1): ``PipelineParallel`` runs the schedule, tp inside its layers, dp around it.

Built in the order each part needs the one before: the stages (this rank's layers), the
gradient sync and precision over their parameters, the engine (handed both), the update.
"""
from __future__ import annotations

import numpy as np

from ...autograd import Tensor, no_grad
from ...backend import to_host
from ...parallel.pipeline import PipelineParallel, Stages
from ...state import SavedElsewhere
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
        stages = Stages(model, ctx, chunks=p.chunks, partition=p.partition, sample_input=sample)
        # The engine runs its whole schedule under no_sync: nothing to overlap with.
        self.build_gradient_sync(stages, precision, overlap=False, alone=stages.tied.params(),
                                 layers=stages.local_layers())
        self.build_precision(precision, stages.named_parameters())
        self.pipe = PipelineParallel(stages, ctx, schedule=p.schedule, micro_batches=p.micro_batches,
                                     loss_fn=getattr(model, "loss_from_logits", None), grad_sync=self.grad_sync,
                                     backward_loss=self.precision.backward)  # seeded with the loss scale
        self.build_update(owns_for_norm=self.pipe.owns_for_norm)

    def named_parameters(self) -> list:
        return self.pipe.named_parameters()

    def derived_communicators(self) -> list:
        return super().derived_communicators() + [comm for comm, _, _ in self.pipe.stages.tied.groups]

    def checkpoint_target(self) -> tuple:
        """The synchronous target without the tied weights a lower pipeline rank saves."""
        weights, optimizer, ctx = super().checkpoint_target()
        names = self.pipe.stages.tied.saved_by_another
        if not names:
            return weights, optimizer, ctx
        return SavedElsewhere(weights, names), SavedElsewhere(optimizer, names), ctx

    def train_step(self, inputs, targets):
        tp_before = self.ctx.layer_comm_seconds()
        with self.auxiliary_losses():
            loss = self.pipe.train_step(inputs, targets)
        self.trace.add_actions(self.pipe.trace)  # F, B, W, sends and receives, as the schedule ran them
        s = self.pipe.stats
        tp = self.ctx.layer_comm_seconds() - tp_before
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
        return (f"pipeline: {self.ctx.pp_size} stages, {p.schedule}, {p.micro_batches} micro-batches, "
                f"{self.grad_sync.describe()}{self.sharding()}")
