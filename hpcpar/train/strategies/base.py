"""The Strategy interface: how the data-parallel replicas agree, from a job to a finished step.

A strategy builds what runs a step from the job (the engine, the optimizer, the precision's
master weights), runs a step (``train_step``, ``finish_step``), evaluates, contributes to
checkpoints through the protocol of ``hpcpar.state``, serves (a parameter server's server ranks)
and ends training. Before anything is built it answers what its mode asks of the job and the
world (``grid_ranks``, ``check_job``, ``own_context``). docs/architecture.md (the Strategy)
describes each part.
"""
from __future__ import annotations

import time
from abc import ABC, abstractmethod

import numpy as np

from ... import checkpoint, log
from ...nn.dropout_keys import offset_dropout_key
from ...nn.moe import is_router
from ..config import JobError
from ..config_types import toml_value
from ...runtime.trace import NO_TRACE

logger = log.get_logger(__name__)


def split_rows(batch, parts: int) -> list:
    size = len(batch) // parts
    return [batch[k * size:(k + 1) * size] for k in range(parts)]


def accumulate_gradients(model, inputs, targets, micro_batches: int, backward, no_sync=None,
                         trace=NO_TRACE):
    """Forward and backward of ``micro_batches`` slices of the rows, gradients summed; the mean
    loss, a 0-d float64 array on the model's device (added there: no device-to-host copy per step).

    ``no_sync()`` (DDP's) wraps every backward but the last, so the all-reduce runs once.
    ``trace`` records a forward and a backward span per slice.
    """
    total = 0.0
    pieces = list(zip(split_rows(inputs, micro_batches), split_rows(targets, micro_batches)))
    for k, (x, y) in enumerate(pieces):
        with trace.span("forward", "forward", micro=k), offset_dropout_key(k * x.shape[0]):  # the slice's own masks
            loss = model.loss(x, y) * (1.0 / micro_batches)
        with trace.span("backward", "backward", micro=k):
            if no_sync is not None and k < len(pieces) - 1:
                with no_sync():
                    backward(loss)
            else:
                backward(loss)
        total = total + loss.data.astype(np.float64)
    return total


class Strategy(ABC):
    """How the replicas agree (see the module docstring). Subclasses set the attributes below."""

    name: str = ""
    trains: bool = True  # False on ranks that only serve (parameter servers)
    trace = NO_TRACE  # a Tracer when the job writes one (use_trace)
    own_context = False  # True: its ranks train in a context it splits off the world's (parameter server)

    def __init__(self, job, ctx, model):
        self.job, self.ctx, self.model = job, ctx, model
        self.world_ctx = ctx  # the ranks a checkpoint is collective over
        self.stats: dict = {}

    # ----- what the mode asks of a job, before anything is built ------------------------
    @classmethod
    def grid_ranks(cls, job, world_size: int) -> int:
        """How many of the world's ranks the job's grid holds (the others serve it)."""
        return world_size

    @classmethod
    def check_job(cls, job, world_size: int) -> list:
        """(key, problem) pairs: what this way of agreeing cannot run with (``validate`` reports them)."""
        return []

    # ----- a training step ------------------------------------------------------------
    @property
    @abstractmethod
    def optimizer(self):
        """What a learning-rate schedule drives (it reads and sets ``lr``)."""

    @abstractmethod
    def train_step(self, inputs, targets):
        """Forward, backward and the gradient exchange; returns this replica's mean loss as a 0-d
        array on the device (``float(to_host(loss))`` reads it: the loop does at log steps only)."""

    @abstractmethod
    def finish_step(self, max_norm: float, loss):
        """Clip (``max_norm`` > 0), step, clear the gradients; the step's ``optim.StepHealth``.

        ``loss``: what ``train_step`` returned. A non-finite loss or gradient skips the step:
        on every rank alike where the ranks step together (agreed by one all-reduce), the
        replica's own under local SGD and a parameter server. What the run does next is the
        loop's ``train.on_nonfinite``.
        """

    def evaluate_loss(self, inputs, targets) -> float:
        """The mean loss of a batch, forward only (every rank of the replica gets it)."""
        return self.model.loss(inputs, targets).item()

    def evaluate_outputs(self, inputs):
        """The model's outputs of a batch (a Tensor of logits), forward only, on every rank of the
        replica: what a classifier's accuracy is counted from."""
        return self.model(inputs)

    @abstractmethod
    def named_parameters(self) -> list:
        """(name, parameter) pairs this rank computes with."""

    @abstractmethod
    def optimizer_state_bytes(self) -> int:
        """Bytes of optimizer state (and master weights) this rank holds."""

    def parameter_bytes(self) -> int:
        """Bytes of the parameters this rank holds between steps."""
        return sum(param.data.nbytes for _, param in self.named_parameters())

    def describe(self) -> str:
        return self.name

    # ----- observability ----------------------------------------------------------------
    def communicators(self) -> list:
        """Every communicator this rank's strategy talks on (what a trace watches)."""
        contexts = [self.world_ctx] + ([self.ctx] if self.ctx is not None else [])
        every = [c for ctx in contexts for c in ctx.communicators().values()] + self.derived_communicators()
        return list({id(c): c for c in every}.values())

    def derived_communicators(self) -> list:
        """Communicators the strategy split from the context's (a pipeline's tied weights, hybrid
        sharding's groups), which the context owns but does not list."""
        return []

    def use_trace(self, tracer) -> None:
        """Record this rank's spans (forward, backward, communication) in ``tracer``."""
        self.trace = tracer
        tracer.watch(self.communicators())

    # ----- checkpoints ----------------------------------------------------------------
    @abstractmethod
    def checkpoint_target(self) -> tuple:
        """(model, optimizer, context) as ``hpcpar.checkpoint.save`` and ``load`` take them."""

    def checkpoint_extra(self) -> dict:
        """State an exact resume needs besides the target's (a loss scaler)."""
        return {}

    def after_load(self) -> None:
        """Derived state to refresh once a checkpoint is in (low-precision copies of the masters)."""

    def save(self, root: str, step: int, extra: dict, keep: int, asynchronous: bool):
        model, optimizer, ctx = self.checkpoint_target()
        return checkpoint.save(root, step, model, optimizer, ctx, extra=extra, keep=keep, asynchronous=asynchronous)

    @abstractmethod
    def weight_decays(self) -> dict:
        """{parameter name: weight decay} that this rank's optimizer applies (its groups, by name)."""

    def load_latest(self, root: str, extra: dict) -> dict | None:
        """Resume from the latest checkpoint under ``root`` that loads (None: none does); collective."""
        return self._load(root, lambda *target: checkpoint.load_latest(root, *target, extra=extra))

    def load_step(self, step_dir: str, extra: dict) -> dict:
        """Resume from one step folder (of this run or another with the same fingerprint); collective."""
        return self._load(step_dir, lambda *target: checkpoint.load(step_dir, *target, extra=extra))

    def load_weights(self, step_dir: str) -> dict:
        """The model's weights alone from a step folder (``--load-weights-only``): optimizer state,
        schedule, data position and random streams start fresh; collective."""
        model, _, ctx = self.checkpoint_target()
        upcycle = is_router if self.job.moe_config() is not None else None  # a dense checkpoint's MLPs: every expert
        info = checkpoint.load(step_dir, model, None, ctx, upcycle=upcycle)
        self.after_load()
        if info.get("upcycled", {}).get("experts") and ctx.rank == 0:
            logger.info(f"upcycled: {info['upcycled']['experts']} expert tensors from the dense MLPs of {step_dir}, "
                        f"{len(info['upcycled']['fresh'])} router(s) initialised anew")
        return info

    def _load(self, where: str, load) -> dict | None:
        model, optimizer, ctx = self.checkpoint_target()
        asked = self.weight_decays()
        info = load(model, optimizer, ctx)
        if info is not None:
            self.after_load()
            self.check_weight_decays(asked, where)
        return info

    def check_weight_decays(self, asked: dict, root: str) -> None:
        """A checkpoint restores the weight decay each parameter was trained with; a job that asks
        for another (``optimizer.weight_decay``, ``optimizer.no_decay``) fails on every rank."""
        restored = self.weight_decays()
        differ = sorted(name for name, value in asked.items() if restored.get(name, value) != value)
        differ = sorted(set().union(*self.world_ctx.world.allgather_object(differ)))
        if differ:
            raise JobError(self.job.source, [("optimizer.no_decay", f"the checkpoint in {root} was trained with "
                                              f"another weight decay for {len(differ)} parameter(s) "
                                              f"({', '.join(differ[:3])}{', ...' if len(differ) > 3 else ''}) than "
                                              f"optimizer.weight_decay and optimizer.no_decay give; resume with the "
                                              f"settings it was trained with, or start anew with "
                                              f"--resume never in another checkpoint.dir")])

    # ----- serving and the end ----------------------------------------------------------
    def serve(self, save_step) -> None:
        """On ranks that only serve: serve until training ends (``save_step(step)`` when asked to save)."""

    def finish_training(self, save_final) -> None:
        """Bring the replicas to agreement, then ``save_final()`` (None: nothing to save)."""
        self.shutdown()
        if save_final is not None:
            save_final()

    def shutdown(self) -> None:
        """The end of training on every rank."""


class DataParallelOnly(Strategy):
    """A strategy whose replicas each hold the whole model and run its plain forward and
    backward (a parameter server, local SGD): no pipeline, tensor parallelism, ZeRO or compression."""

    @classmethod
    def check_job(cls, job, world_size: int) -> list:
        p, problems, mode = job.parallel, [], toml_value(job.parallel.mode)
        if p.pp > 1 or p.tp > 1 or p.cp > 1:
            problems.append(("parallel.mode", f"{mode} runs data parallel only, but pp = {p.pp}, tp = {p.tp} and "
                                              f"cp = {p.cp}; set pp = tp = cp = 1 or mode = \"allreduce\""))
        if p.zero:
            problems.append(("parallel.zero", f"ZeRO shards optimizer state across all-reducing replicas; "
                                              f"mode = {mode} needs zero = 0"))
        if p.compression != "none":
            problems.append(("parallel.compression", f"compression hooks into the gradient all-reduce; mode = "
                                                     f"{mode} needs compression = \"none\""))
        return problems

    def local_train_step(self, inputs, targets, backward):
        """Forward and backward with no gradient exchange (the exchange is the step's finish)."""
        start = time.perf_counter()
        loss = accumulate_gradients(self.model, inputs, targets, self.job.parallel.micro_batches, backward,
                                    trace=self.trace)
        elapsed = time.perf_counter() - start
        self.stats = {"step_s": elapsed, "compute_s": elapsed, "comm_s": 0.0, "idle_s": 0.0}
        return loss
