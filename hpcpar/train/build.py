"""From a validated job and a ParallelContext to the pieces of a run: data, model, engine, optimizer.

The layout decides the engine: pp > 1 runs ``PipelineParallel`` (tp inside its layers, dp
around it); pp = 1 runs data parallelism (DDP or ZeRO-1; tp inside the model). Parameter
server and local SGD replace the all-reduce (``parallel.mode``).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..data.loader import TextBatches, TokenDataset
from ..nn.gpt import GPT
from ..optim import SGD, Adam, AdamW, DynamicLossScaler, MixedPrecision, WarmupCosine, precision_dtype
from ..parallel.compression import make_compressor
from ..parallel.zero import ZeroRedundancyOptimizer
from .config import Job, JobError
from .engines import DataParallelEngine, PipelineEngine


@dataclass
class Run:
    job: Job
    ctx: object
    model: object
    engine: object
    optimizer: object
    schedule: WarmupCosine
    train_data: object
    eval_data: object  # (inputs, targets) batches of this dp replica, or None
    amp: MixedPrecision | None
    mode: object | None  # parameter server / local SGD, when parallel.mode is not allreduce

    def extra_state(self) -> dict:
        """What an exact resume needs besides parameters and optimizer state."""
        extra = {"schedule": self.schedule, "data": self.train_data, "rng": self.model_rng,
                 "model_config": self.job.to_dict()["model"]}
        if self.amp is not None and self.amp.scaler is not None:
            extra["scaler"] = self.amp.scaler
        return extra

    @property
    def model_rng(self):
        return getattr(self.model, "rng", None) or np.random.default_rng(self.job.model.seed)

    def named_parameters(self):
        return self.amp.named_master_parameters() if self.amp is not None else self.engine.named_parameters()

    @property
    def checkpoint_target(self) -> tuple:
        """(named parameters, optimizer, context) that a checkpoint saves and loads. A parameter-server
        job saves over the whole world through its ParameterServer: the servers hold the parameters
        and optimizer state, the workers the rest (schedule, data position)."""
        if self.job.parallel.mode == "ps":
            return list(self.model.named_parameters()), self.mode.ps, self.mode.ps.world_ctx
        return self.named_parameters(), self.optimizer, self.ctx

    @property
    def trains(self) -> bool:
        """False on a parameter server's server ranks, which only serve."""
        return self.mode is None or self.mode.is_worker


def compute_dtype(job: Job):
    try:
        return precision_dtype(job.train.precision)
    except ImportError:
        raise JobError(job.source, [("train.precision", "bf16 on CPUs needs ml_dtypes: pip install ml_dtypes")]) from None


def build_model(job: Job, ctx, dtype):
    if job.model.kind == "gpt":
        model = GPT(job.gpt_config(), dtype=dtype, device=ctx.device, tp=ctx.tp)
        model.sequence_parallel = job.parallel.sequence_parallel
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
        rows = np.arange(len(split.y_test))[ctx.dp_rank::ctx.dp_size]  # every test image exactly once
        return train, [(split.x_test[rows], split.y_test[rows])]
    if job.data.prepare_if_missing:
        from ..data.prepare import ensure_prepared

        ensure_prepared(job.data.path, comm=ctx.world)
    block = job.model.block_size
    train = TextBatches(TokenDataset(job.data.path, "train"), block, job.data.batch_size, ctx.dp_rank,
                        ctx.dp_size, seed=job.train.seed)
    val = TextBatches(TokenDataset(job.data.path, "val"), block, job.data.batch_size, ctx.dp_rank, ctx.dp_size,
                      seed=job.train.seed + 1)
    return train, [val.batch_at(k) for k in range(job.data.eval_batches)]  # the same windows every evaluation


def make_optimizer(job: Job, named):
    """(optimizer class, its options) from the job's [optimizer] section."""
    o = job.optimizer
    decay = dict(weight_decay=o.weight_decay, no_decay=o.no_decay)  # groups by parameter name
    if o.name == "sgd":
        return SGD, dict(lr=o.lr, momentum=o.momentum, **decay)
    cls = AdamW if o.name == "adamw" else Adam
    return cls, dict(lr=o.lr, betas=tuple(o.betas), **decay)


def build(job: Job, ctx) -> Run:
    p = job.parallel
    dtype = compute_dtype(job)
    mixed = job.train.precision in ("fp16", "bf16")
    if mixed and p.mode == "ps":
        raise JobError(job.source, [("train.precision", f"{job.train.precision} runs with mode = \"allreduce\" or "
                                                        "\"local_sgd\" (the parameter server steps the model's own "
                                                        "parameters, not float32 masters); use fp32")])
    model = build_model(job, ctx, dtype)
    mode, amp = None, None
    if p.mode != "allreduce":  # parameter server or local SGD: they own the dp exchange and the step
        from ..parallel.modes import make_mode, mode_options

        amp = mixed_precision(job, model.named_parameters()) if mixed else None  # local SGD only, as checked
        cls, options = make_optimizer(job, model.named_parameters())
        mode = make_mode(p.mode, model, ctx, cls, options, max_grad_norm=job.optimizer.grad_clip, amp=amp,
                         **mode_options(p))
        if not mode.is_worker:  # a server rank: it serves until the workers stop, nothing else
            return Run(job, ctx, model, None, mode.optimizer, None, None, None, None, mode)
        ctx = mode.ctx  # the workers' own context (for ps: dp = world - servers)
    train, evaluation = build_data(job, ctx)
    if p.pp > 1:
        engine = PipelineEngine(model, ctx, schedule=p.schedule, micro_batches=p.micro_batches, chunks=p.chunks,
                                partition=p.partition, bucket_mb=p.bucket_mb, dp_average=not p.zero,
                                sample_input=_sample(train, p.micro_batches) if p.partition == "balanced" else None)
        if mixed:  # masters for this stage's parameters only
            amp = mixed_precision(job, engine.named_parameters())
            engine.pipe.backward_loss = amp.backward
    else:
        if mixed and amp is None:
            amp = mixed_precision(job, model.named_parameters())
        compressor = None
        if p.compression != "none":
            options = {"topk": {"ratio": p.compression_ratio}, "powersgd": {"rank": p.powersgd_rank}}
            compressor = make_compressor(p.compression, **options.get(p.compression, {}))
        engine = DataParallelEngine(model, ctx, micro_batches=p.micro_batches, bucket_mb=p.bucket_mb,
                                    overlap=p.overlap, compressor=compressor,
                                    reduce_gradients=mode is None and not p.zero,
                                    scale_loss=amp.backward if amp is not None else None)
    named = amp.named_master_parameters() if amp is not None else engine.named_parameters()
    cls, options = make_optimizer(job, named)
    if mode is not None:
        optimizer = mode.optimizer
    elif p.zero:
        optimizer = ZeroRedundancyOptimizer(named, ctx.dp, cls, **options)
    else:
        optimizer = cls(named, **options)
    schedule = WarmupCosine(optimizer, warmup_steps=min(job.schedule.warmup_steps, job.train.steps),
                            total_steps=job.train.steps, min_lr=job.schedule.min_lr)
    return Run(job, ctx, model, engine, optimizer, schedule, train, evaluation, amp, mode)


def mixed_precision(job: Job, named) -> MixedPrecision:
    """float32 masters for ``named``; fp16 scales the loss, bf16 (float32's range) needs no scaling."""
    return MixedPrecision(named, scaler=DynamicLossScaler() if job.train.precision == "fp16" else None)


def _sample(batches, micro_batches: int):
    inputs, _ = batches.batch_at(0)
    return inputs[: max(1, len(inputs) // micro_batches)]
