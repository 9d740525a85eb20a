"""How data-parallel replicas agree, chosen by name (``parallel.mode`` in a job file).

    mode = make_mode(job.parallel.mode, model, ctx, AdamW, {"lr": 3e-4}, **mode_options(job.parallel))
    mode.serve()                             # parameter-server ranks serve here until training ends
    if mode.is_worker:
        schedule = WarmupCosine(mode.optimizer, warmup_steps, steps)
        for step in range(steps):
            ids, targets = batch(step, mode.ctx.dp_rank, mode.ctx.dp_size)
            model.loss(ids, targets).backward()
            mode.after_backward()            # communicate and step as the mode requires; grads cleared
            schedule.step()
    mode.shutdown()                          # every rank: stop messages, final average or nothing

Every mode has the same interface:

- ``is_worker``: whether this rank trains (False only on parameter-server ranks);
- ``ctx``: the ParallelContext a worker splits its data over (``dp_rank``/``dp_size``): the
  given context, or for ``ps`` the workers' own (dp = world - servers); None on a server;
- ``optimizer``: what a learning-rate schedule drives (has ``lr``); for ``ps`` workers the
  ParameterServer, whose lr travels with each push;
- ``after_backward()``: after ``loss.backward()``: synchronise, step, clear the gradients;
- ``serve()``: blocks a parameter-server rank until every worker has stopped, a no-op elsewhere;
- ``shutdown()``: end of training on every rank (a server that has not served yet serves here).

Modes: ``allreduce`` (DistributedDataParallel + the optimizer: synchronous data parallelism),
``ps`` (``ParameterServer``, synchronous for staleness 0, else asynchronous with that bound)
and ``local_sgd`` (``LocalSGD``: H local steps, then a parameter average). ``allreduce`` here is
plain data parallelism; pipeline and tensor parallelism, ZeRO and mixed precision keep their
own paths in the training loop (local SGD takes a ``MixedPrecision`` too).
"""
from __future__ import annotations

from ..optim.clip import clip_grad_norm
from .data import DistributedDataParallel
from .local_sgd import LocalSGD
from .ps import ParameterServer

MODES = ("allreduce", "ps", "local_sgd")


class Mode:
    """The common interface; a mode that needs no serving or final exchange keeps these."""

    is_worker = True

    def serve(self) -> None:
        pass

    def shutdown(self) -> None:
        pass


class AllReduceMode(Mode):
    """Synchronous data parallelism: bucketed gradient all-reduce mean, then the optimizer."""

    name = "allreduce"

    def __init__(self, model, ctx, optimizer_class, optimizer_options: dict, bucket_mb: float = 25.0,
                 overlap: bool = True, max_grad_norm: float = 0.0):
        self.ctx = ctx
        self.ddp = DistributedDataParallel(model, ctx, bucket_mb=bucket_mb, overlap=overlap)
        self.optimizer = optimizer_class(model.named_parameters(), **optimizer_options)
        self.max_grad_norm = float(max_grad_norm)

    def after_backward(self) -> None:
        self.ddp.finish_grad_sync()
        if self.max_grad_norm:  # the gradients are the dp mean, the same on every rank
            clip_grad_norm(self.ddp.params, self.max_grad_norm)
        self.optimizer.step()
        self.optimizer.zero_grad()

    def describe(self) -> str:
        return f"allreduce: {self.ctx.dp_size} replicas, {len(self.ddp.buckets)} gradient bucket(s)"


class ParameterServerMode(Mode):
    """``ParameterServer`` behind the common interface."""

    name = "ps"

    def __init__(self, model, ctx, optimizer_class, optimizer_options: dict, servers: int = 1, staleness: int = 0,
                 max_grad_norm: float = 0.0):
        self.ps = ParameterServer(model.named_parameters(), ctx, optimizer_class, servers=servers,
                                  staleness=staleness, max_grad_norm=max_grad_norm, **optimizer_options)
        self.is_worker = self.ps.is_worker
        self.ctx = self.ps.ctx
        self.optimizer = self.ps if self.is_worker else self.ps.optimizer

    def after_backward(self) -> None:
        self.ps.push_pull()

    def serve(self) -> None:
        self.ps.serve()

    def shutdown(self) -> None:
        self.ps.shutdown()

    def describe(self) -> str:
        return self.ps.describe()


class LocalSGDMode(Mode):
    """``LocalSGD`` behind the common interface."""

    name = "local_sgd"

    def __init__(self, model, ctx, optimizer_class, optimizer_options: dict, local_steps: int = 4,
                 average_optimizer_state: bool = False, max_grad_norm: float = 0.0, amp=None):
        self.ctx = ctx
        named = amp.named_master_parameters() if amp is not None else model.named_parameters()
        self.optimizer = optimizer_class(named, **optimizer_options)
        self.local = LocalSGD(model, ctx, self.optimizer, local_steps=local_steps,
                              average_optimizer_state=average_optimizer_state, max_grad_norm=max_grad_norm, amp=amp)

    def after_backward(self) -> None:
        self.local.step()

    def shutdown(self) -> None:
        self.local.shutdown()

    def describe(self) -> str:
        state = ", optimizer state averaged too" if self.local.average_optimizer_state else ""
        return f"local SGD: {self.ctx.dp_size} replicas average parameters every {self.local.local_steps} steps{state}"


def make_mode(mode: str, model, ctx, optimizer_class, optimizer_options: dict | None = None, *,
              staleness: int = 0, servers: int = 1, local_steps: int = 4, average_optimizer_state: bool = False,
              bucket_mb: float = 25.0, overlap: bool = True, max_grad_norm: float = 0.0, amp=None):
    """The mode object for ``parallel.mode``; keys that do not apply to ``mode`` are ignored.

    ``amp``: a ``MixedPrecision`` of the model, for ``local_sgd`` (its optimizer steps the masters).

    ``ctx`` is the world's context (for ``ps`` the servers are taken from it). Every rank calls
    this with the same arguments (it communicates: parameter broadcast, communicator splits).
    """
    options = dict(optimizer_options or {})
    if mode == "allreduce":
        return AllReduceMode(model, ctx, optimizer_class, options, bucket_mb=bucket_mb, overlap=overlap,
                             max_grad_norm=max_grad_norm)
    if mode == "ps":
        return ParameterServerMode(model, ctx, optimizer_class, options, servers=servers, staleness=staleness,
                                   max_grad_norm=max_grad_norm)
    if mode == "local_sgd":
        return LocalSGDMode(model, ctx, optimizer_class, options, local_steps=local_steps,
                            average_optimizer_state=average_optimizer_state, max_grad_norm=max_grad_norm, amp=amp)
    raise ValueError(f"parallel.mode must be one of {MODES}, got {mode!r}")


def mode_options(parallel) -> dict:
    """The keyword arguments of ``make_mode`` from a job's ``[parallel]`` section (or any object with them)."""
    keys = ("staleness", "servers", "local_steps", "average_optimizer_state", "bucket_mb", "overlap")
    return {key: getattr(parallel, key) for key in keys if hasattr(parallel, key)}
