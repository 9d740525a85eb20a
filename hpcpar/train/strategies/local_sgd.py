"""Local SGD (``parallel.mode = "local_sgd"``): each replica steps on its own gradients and the
parameters are averaged every ``local_steps`` steps (``hpcpar.parallel.local_sgd``).

Training ends with one more average. A checkpoint holds one model, the replicas' average (a
checkpoint between averages saves their mean and leaves the replicas as they are), and beside
it each replica's own values as its rows (``hpcpar.parallel.local_sgd_state``): its optimizer
state, and between averages its parameters, so that a resume from any step is exact.
"""
from __future__ import annotations

import time

from ... import checkpoint
from ...parallel.local_sgd import LocalSGD
from ...parallel.local_sgd_state import LocalSGDReplicas
from ...state import Together
from .base import DataParallelOnly
from .ingredients import optimizer_class, state_bytes


class LocalSGDStrategy(DataParallelOnly):
    name = "local_sgd"

    def __init__(self, job, ctx, model, precision, data=None):
        super().__init__(job, ctx, model)
        p = job.parallel
        self.precision = precision.masters(model.named_parameters())
        cls, options = optimizer_class(job)
        self._optimizer = cls(self.precision.named_master_parameters(), **options)
        self.local = LocalSGD(model, ctx, self._optimizer, local_steps=p.local_steps,
                              average_optimizer_state=p.average_optimizer_state,
                              max_grad_norm=job.optimizer.grad_clip, amp=self.precision)
        self.replicas = LocalSGDReplicas(self.local, ctx, self.precision.scaler)

    @property
    def optimizer(self):
        return self._optimizer

    def named_parameters(self) -> list:
        return list(self.model.named_parameters())

    def train_step(self, inputs, targets):
        return self.local_train_step(inputs, targets, self.precision.backward)

    def finish_step(self, max_norm: float, loss: float):
        """A local step (clipped by the job's grad_clip inside LocalSGD); every H-th, the average.
        A non-finite loss or gradient skips this replica's step only (no collective per step)."""
        start = time.perf_counter()
        health = self.local.step(loss)
        self.stats["comm_s"] = time.perf_counter() - start
        self.stats.update(self.precision.metrics())
        return health

    def optimizer_state_bytes(self) -> int:
        return state_bytes(self._optimizer) + self.precision.master_bytes()

    def weight_decays(self) -> dict:
        return self._optimizer.named_weight_decays()

    def describe(self) -> str:
        state = ", optimizer state averaged too" if self.local.average_optimizer_state else ""
        return f"local SGD: {self.ctx.dp_size} replicas average parameters every {self.local.local_steps} steps{state}"

    def checkpoint_target(self) -> tuple:
        return self.precision.named_master_parameters(), Together(self._optimizer, self.replicas), self.ctx

    def checkpoint_extra(self) -> dict:
        return {} if self.precision.scaler is None else {"scaler": self.precision.scaler}

    def save(self, root: str, step: int, extra: dict, keep: int, asynchronous: bool):
        model, optimizer, ctx = self.checkpoint_target()
        if self.local.steps_since_average:  # between averages: the model saved is the replicas' mean
            model = self.local.averaged(model)
        return checkpoint.save(root, step, model, optimizer, ctx, extra=extra, keep=keep, asynchronous=asynchronous)

    def after_load(self) -> None:
        self.precision.copy_to_model()

    def finish_training(self, save_final) -> None:
        """The last average, then the checkpoint; one taken between averages also keeps each
        replica's values from before that average, which a resume continues from."""
        if save_final is not None and self.local.steps_since_average:
            self.replicas.hold()
        try:
            super().finish_training(save_final)
        finally:
            self.replicas.release()

    def shutdown(self) -> None:
        self.local.shutdown()  # the last average: every replica ends with the same model
