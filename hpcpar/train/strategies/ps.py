"""Parameter server (``parallel.mode = "ps"``): the last ``servers`` ranks hold the parameters and
step them; workers push gradients and pull parameters (``hpcpar.parallel.ps``).

Under fp16/bf16 the servers keep float32 masters and the workers push float32 gradients,
unscaled (``ParameterServer``'s mixed precision); a step with a non-finite loss or gradient is
skipped by every server (synchronous) or that worker's push dropped (asynchronous).

Checkpoints are collective over the whole world and synchronous: a worker asks the servers to
join, they pause serving and save their ranges of the parameters and of the optimizer state.
Servers save first at the end, while they still serve; then every worker stops them.
"""
from __future__ import annotations

import time

from ... import checkpoint
from ...parallel.ps import ParameterServer
from ..config import JobError
from .base import DataParallelOnly
from .ingredients import optimizer_class, state_bytes


class ParameterServerStrategy(DataParallelOnly):
    name = "ps"
    own_context = True  # the workers' context is split off the world's, without the servers

    def __init__(self, job, ctx, model, precision, data=None):
        super().__init__(job, ctx, model)
        p = job.parallel
        cls, options = optimizer_class(job)
        self.ps = ParameterServer(model.named_parameters(), ctx, cls, servers=p.servers, staleness=p.staleness,
                                  max_grad_norm=job.optimizer.grad_clip, master_dtype=precision.master_dtype,
                                  scaler=precision.scaler(), **options)
        self.trains = self.ps.is_worker
        self.ctx = self.ps.ctx  # the workers' own context (dp = world - servers); None on a server

    @classmethod
    def grid_ranks(cls, job, world_size: int) -> int:
        return world_size - job.parallel.servers  # the workers

    @classmethod
    def check_job(cls, job, world_size: int) -> list:
        p, problems = job.parallel, super().check_job(job, world_size)
        if cls.grid_ranks(job, world_size) < 1:
            problems.insert(0, ("parallel.servers", f"{p.servers} server(s) leave no worker among {world_size} "
                                                    f"ranks; launch more than {p.servers} ranks or lower "
                                                    f"parallel.servers"))
        if job.train.on_nonfinite == "rewind":  # the servers hold the weights and serve on: nothing reloads them
            problems.append(("train.on_nonfinite", "\"rewind\" is not supported with parallel.mode = \"ps\" (the "
                                                   "servers, which hold the weights, would have to reload while "
                                                   "serving); use \"skip\" or \"stop\""))
        return problems

    @property
    def optimizer(self):
        return self.ps if self.trains else self.ps.optimizer  # a worker's lr travels with its pushes

    def named_parameters(self) -> list:
        return list(self.model.named_parameters())

    def train_step(self, inputs, targets):
        return self.local_train_step(inputs, targets, self.ps.backward)

    def finish_step(self, max_norm: float, loss: float) -> bool:
        """Push the gradients and pull fresh parameters (the servers clip, by the job's grad_clip, and step)."""
        start = time.perf_counter()
        taken = self.ps.push_pull(loss)
        self.stats["comm_s"] = time.perf_counter() - start
        self.stats.update(self.ps.metrics())
        return taken

    def optimizer_state_bytes(self) -> int:
        return 0 if self.trains else state_bytes(self.ps.optimizer)

    def describe(self) -> str:
        return self.ps.describe()

    def weight_decays(self) -> dict:
        return self.ps.named_weight_decays()

    def checkpoint_target(self) -> tuple:
        return self.ps, None, self.world_ctx  # the servers save parameters and state, the workers nothing

    def checkpoint_extra(self) -> dict:
        """The workers' loss scaler under fp16 (synchronous workers keep equal ones; asynchronous: rank 0's)."""
        return {} if self.ps.scaler is None else {"scaler": self.ps.scaler}

    def load_weights(self, step_dir: str) -> dict:
        raise JobError(self.job.source, [("parallel.mode", "--load-weights-only is not supported with mode = \"ps\" "
                                                           "(the servers keep weights and optimizer state together); "
                                                           "resume the whole checkpoint with --resume PATH")])

    def save(self, root: str, step: int, extra: dict, keep: int, asynchronous: bool):
        def write():  # always synchronous: the servers pause serving for it
            return checkpoint.save(root, step, self.ps, None, self.world_ctx, extra=extra, keep=keep)

        if not self.trains:
            return write()
        written = []
        self.ps.save_checkpoint(step, lambda: written.append(write()))
        return written[0]

    def communicators(self) -> list:
        return super().communicators() + [c for c in (self.ps.comm, self.ps.server_comm) if c is not None]

    def use_trace(self, tracer) -> None:
        super().use_trace(tracer)
        self.ps.trace = tracer  # a server's rounds and updates

    def serve(self, save_step) -> None:
        self.ps.on_save = save_step  # when the workers ask
        self.ps.serve()
        self.ps.shutdown()

    def finish_training(self, save_final) -> None:
        if save_final is not None:  # while the servers still serve
            save_final()
        self.shutdown()

    def shutdown(self) -> None:
        self.ps.shutdown()
