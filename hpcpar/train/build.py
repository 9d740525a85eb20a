"""From a validated job and a ParallelContext to the pieces of a run: model, strategy, data, LR schedule.

The strategy (``strategies``) is picked from the job: how the replicas agree decides what
runs a step. The job's ``Precision`` goes from here to the model (its dtype) and the strategy.
Data is built once, for the context the strategy trains in (a strategy with ``own_context``
makes it: a parameter server's workers), and the learning-rate schedule drives the strategy's
optimizer.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from .. import log
from ..data.loader import TextBatches, TokenDataset
from ..data.sampler import DistributedSampler
from ..nn.gpt import GPT
from ..optim import WarmupCosine
from .config import Job, JobError
from .nonfinite import NonFinitePolicy
from .strategies import Strategy, make_strategy, strategy_class
from .validate import prepares_builtin_corpus

logger = log.get_logger(__name__)


@dataclass
class Run:
    job: Job
    strategy: Strategy
    lr_schedule: WarmupCosine | None  # None on ranks that only serve
    train_data: object | None
    eval_data: list | None  # (inputs, targets) batches of this dp replica
    identity: dict = field(default_factory=dict)  # fingerprint and provenance, set when the run starts (lifecycle)
    nonfinite: NonFinitePolicy | None = None  # train.on_nonfinite's counts (None on ranks that only serve)

    @property
    def ctx(self):
        return self.strategy.ctx

    @property
    def model(self):
        return self.strategy.model

    @property
    def trains(self) -> bool:
        return self.strategy.trains

    def checkpoint_extra(self) -> dict:
        """What an exact resume needs besides parameters and optimizer state (nothing on a server).

        No random state: dropout masks are keyed by the step and the data position
        (``nn.dropout_keys``); a load restores only the states named here, so random streams a
        checkpoint holds are left unread."""
        if not self.trains:
            return {}
        return {"schedule": self.lr_schedule, "data": self.train_data, "nonfinite": self.nonfinite,
                "model_config": self.job.model_config(), **self.identity, **self.strategy.checkpoint_extra()}


def compute_dtype(job: Job):
    """The model's dtype in the job's precision (a JobError where bf16 lacks ``ml_dtypes``)."""
    try:
        return job.precision.compute_dtype
    except ImportError:
        raise JobError(job.source, [("train.precision", "bf16 on CPUs needs ml_dtypes: pip install ml_dtypes")]) from None


def build_model(job: Job, ctx, dtype):
    if job.model.kind == "gpt":
        ep = ctx.expert_groups(job.parallel.ep)[0] if job.moe_config() is not None and job.parallel.ep > 1 else None
        model = GPT(job.gpt_config(), dtype=dtype, device=ctx.device, tp=ctx.tp, cp=ctx.cp, ep=ep)
        model.sequence_parallel = job.parallel.sequence_parallel
        model.recompute = job.model.recompute
        return model
    from ..nn.cnn import DigitsCNN

    if ctx.tp_size > 1:
        raise JobError(job.source, [("parallel.tp", "the cnn has no tensor-parallel layers; use tp = 1")])
    return DigitsCNN(channels=job.model.channels, seed=job.model.seed, dtype=dtype, device=ctx.device)


def build_data(job: Job, ctx):
    """(train batches, evaluation batches) of this dp replica; text is prepared once if asked."""
    if job.data.kind == "digits":
        from ..data.digits import DigitsBatches, load_digits_split

        split = load_digits_split(seed=job.train.seed)
        train = DigitsBatches(split.x_train, split.y_train, job.data.batch_size, ctx.dp_rank, ctx.dp_size,
                              seed=job.train.seed)
        rows = DistributedSampler(len(split.y_test), ctx.dp_size, ctx.dp_rank).eval_indices()  # each image once
        return train, [(split.x_test[rows], split.y_test[rows])]
    if prepares_builtin_corpus(job):
        from ..data.prepare import ensure_prepared

        ensure_prepared(job.data.path, comm=ctx.world, announce=logger.info)
    block = job.model.block_size
    train = TextBatches(TokenDataset(job.data.path, "train"), block, job.data.batch_size, ctx.dp_rank,
                        ctx.dp_size, seed=job.train.seed)
    val = TextBatches(TokenDataset(job.data.path, "val"), block, job.data.batch_size, ctx.dp_rank, ctx.dp_size,
                      seed=job.train.seed + 1)
    return train, [val.batch_at(k) for k in range(job.data.eval_batches)]  # the same windows every evaluation


def build(job: Job, ctx) -> Run:
    """The run of ``job`` on ``ctx`` (collective: the strategy broadcasts parameters, splits communicators)."""
    model = build_model(job, ctx, compute_dtype(job))
    data = None if strategy_class(job).own_context else build_data(job, ctx)  # else for the context it makes
    strategy = make_strategy(job, ctx, model, data[0] if data else None, job.precision)
    if not strategy.trains:  # a parameter server: it serves, nothing else
        return Run(job, strategy, None, None, None)
    train, evaluation = data or build_data(job, strategy.ctx)
    s = job.lr_schedule
    lr_schedule = WarmupCosine(strategy.optimizer, warmup_steps=min(s.warmup_steps, job.train.steps),
                               total_steps=job.train.steps, min_lr=s.min_lr)
    return Run(job, strategy, lr_schedule, train, evaluation, nonfinite=NonFinitePolicy(job.train))
