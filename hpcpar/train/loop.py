"""``hpcpar train JOB.toml``: the training loop, the same for every layout and strategy.

    mpiexec -n 4 hpcpar train jobs/gpt-3d.toml --set train.steps=50
    sbatch slurm/train.sbatch jobs/gpt-3d.toml

Per step: this dp replica's rows of the global batch -> the strategy's step (forward,
backward, gradient exchange) -> its finish (clip, the finiteness check, optimizer step) -> the
LR schedule -> what ``train.on_nonfinite`` does about a step that was not finite. Rank 0
logs step, loss, learning rate, tokens/s, the step split into compute / communication /
pipeline idle, and peak memory per rank, appends metrics to a JSONL file, evaluates on the
validation split, and checkpoints every ``checkpoint.interval`` steps and at the end. A stop
signal or ``train.max_seconds`` ends the run at a step boundary with a checkpoint
(``lifecycle``). Parameter-server ranks serve instead (``Strategy.serve``).
"""
from __future__ import annotations

import time
import warnings

import numpy as np

from .. import checkpoint, log as logs
from ..backend import to_host
from ..runtime.context import agreed, init
from ..runtime.topology import PlacementWarning
from ..runtime.trace import Tracer
from ..nn.dropout_keys import DropoutKey, dropout_key
from ..optim import check_precision
from .build import Run, build
from . import identity
from .config import Job, JobError
from .evaluate import evaluate, sample_text
from .lifecycle import StopRequest, adopt_job_schedule, after_step, requeue_if_slurm, save_checkpoint, start
from .moe_metrics import moe_record
from .nonfinite import REWIND, STOP, RunDiverged
from .resume import Request
from .run_lock import take_run_lock
from .strategies import strategy_class
from .report import Logger

logger = logs.get_logger(__name__)


def train(job: Job, resume: Request | str | None = None, stop: StopRequest | None = None,
          progress: str = "auto") -> dict:
    """Train ``job`` on every rank of the world; returns the last logged metrics (on every trainer).

    ``resume`` is the resume policy (a ``Request``, or auto/never/must/PATH) over ``checkpoint.resume``;
    ``stop`` is the signal catcher (one is installed when not given); ``progress`` is how rank 0
    shows it: auto, bar, log or none (``Progress``).
    """
    stop = stop or StopRequest()
    same_job_everywhere(job)  # before init: ranks holding other jobs would build other grids and models
    from mpi4py import MPI

    lock = take_run_lock(job, MPI.COMM_WORLD, create=False)  # one run per checkpoint folder (lifecycle.start too)
    try:
        return train_holding_lock(job, resume, stop, progress, lock)
    finally:
        if lock is not None:
            lock.release()


def train_holding_lock(job: Job, resume, stop: StopRequest, progress: str, lock) -> dict:
    """``train``'s run once its checkpoint folder is its own (``lock``: rank 0's, None elsewhere)."""
    ctx = start_context(job)
    with Logger(job, ctx, job.train.steps, progress) as log:  # first: with a bar, every line goes above it
        describe(job, ctx)
        run = build(job, ctx)
        if ctx.rank == 0:
            logger.info(f"strategy: {run.strategy.describe()}")
        tracer = start_trace(run)
        info = start(run, resume if isinstance(resume, Request) else Request(resume), lock)
        step = start_step = info["step"] if info is not None else 0
        if not run.trains:  # a parameter server: loaded with the workers, serves until each has stopped
            run.strategy.serve(lambda step: save_checkpoint(run, step, final=True))
            finish_trace(run, tracer, log)
            return {}
        if start_step >= job.train.steps:
            log.line(f"nothing to do: the checkpoint is at step {start_step}, train.steps = {job.train.steps}")
            run.strategy.finish_training(None)
            finish_trace(run, tracer, log)
            return {"step": start_step, "nothing_to_do": True}
        log.begin(run.ctx, start_step, info["step_dir"] if start_step else None, run.identity)
        if start_step == 0 and job.train.on_nonfinite == "rewind":  # the first steps can rewind too
            log.line(f"checkpoint {save_checkpoint(run, 0)} (the initial weights: train.on_nonfinite = \"rewind\")")
        last, reason, began = {"step": step}, None, time.perf_counter()
        while step < job.train.steps and reason is None:
            started = time.perf_counter()
            loss, lr, health = train_one_step(run, step)
            step += 1
            last = report_step(run, log, step, start_step, loss, lr, time.perf_counter() - started) or last
            action = run.nonfinite.decide(health, mean_loss(run, loss) if run.nonfinite.watches_spikes else None)
            reason, action = after_step(run, stop, began, action)
            if action == REWIND:
                step = rewind(run, log, step)
                continue
            if action == STOP:
                diverged(run, step)
            if not health.taken and not health.overflow:
                say_skipped(run, log, step)
            between_steps(run, log, step)

        def save_final():
            log.line(f"checkpoint {save_checkpoint(run, step, final=True)}")
        run.strategy.finish_training(save_final if step > start_step or reason else None)
        checkpoint.wait()
        finish_trace(run, tracer, log)
        if reason is not None:
            log.line(f"stopped at step {step} ({reason}); checkpoint saved")
            log.close()  # requeueing ends the job at once
            requeue_if_slurm(run, stop)
            return {**last, "stopped": reason}
        log.progress.close()  # the bar ends before the last lines: they follow it
        return {**last, **final_report(run, step, log)}


def step_masks(run: Run, step: int):
    """The dropout masks of step ``step`` for this replica's rows (a context): every forward of
    that step draws them, here and in whatever else trains steps of a run (compare, the planner's
    counted step). Without it a pipeline's stages, whose layers draw by the key in force, refuse
    to run dropout."""
    return dropout_key(DropoutKey(step, run.train_data.first_sample))


def train_one_step(run: Run, step: int) -> tuple:
    """Step ``step`` (counted from 0): the strategy's step and finish, the LR schedule; (loss, lr,
    the step's ``optim.StepHealth``), the loss a 0-d array on the device (``report_step`` reads
    it at log steps)."""
    inputs, targets = run.train_data.batch_at(step)
    run.train_data.step = step + 1
    trace = run.strategy.trace
    with trace.step(step + 1), step_masks(run, step):
        loss = run.strategy.train_step(inputs, targets)
        with trace.span("optimizer", "optimizer"):  # clip and step; the exchange of ps and local SGD
            health = run.strategy.finish_step(run.job.optimizer.grad_clip, loss)
    lr = run.strategy.optimizer.lr
    run.lr_schedule.step()
    return loss, lr, health


def mean_loss(run: Run, loss) -> float:
    """The step's loss averaged over dp, on every rank (collective: what the spike trigger watches)."""
    return float(run.ctx.dp_cp.allreduce(np.array([float(to_host(loss))]), "mean")[0])


def agreed_why(run: Run) -> str:
    """The first rank's words for a REWIND or STOP every rank agreed on (collective: on that path only)."""
    return next((why for why in run.ctx.world.allgather_object(run.nonfinite.why) if why), "another rank's step")


def rewind(run: Run, log: Logger, step: int) -> int:
    """``train.on_nonfinite = "rewind"`` after ``step``: the newest checkpoint loaded, the data of
    the steps after it skipped; returns the step it continues from (collective). Stops the run
    (``diverged``) when the rewinds are used up or nothing was saved yet."""
    policy, job = run.nonfinite, run.job
    why = agreed_why(run)
    if not policy.may_rewind():
        diverged(run, step, f"{why}; {policy.rewinds} rewind(s) made (train.max_rewinds = {policy.max_rewinds})")
    checkpoint.wait()  # an asynchronous save still writing is the newest checkpoint
    skipped = run.train_data.skipped  # the load brings back the checkpoint's, before earlier rewinds
    info = run.strategy.load_latest(job.checkpoint.dir, run.checkpoint_extra())
    if info is None:
        diverged(run, step, f"{why}; no checkpoint to rewind to yet (checkpoint.interval = {job.checkpoint.interval})")
    back_to = info["step"]
    run.train_data.skipped = skipped + step - back_to  # and the batches of steps back_to + 1 .. step
    run.train_data.step = back_to
    policy.rewound()
    adopt_job_schedule(run)  # the job's LR schedule, whatever segment wrote that checkpoint
    log.line(f"step {step}: {why}; rewound to step {back_to} ({info['step_dir']}) and skipping the "
             f"{step - back_to} batch(es) of steps {back_to + 1}..{step} (rewind {policy.rewinds} of "
             f"{policy.max_rewinds})")
    log.record({"step": step, "event": "rewind", "to_step": back_to, "skipped_batches": step - back_to,
                "rewinds": policy.rewinds, "reason": why, "time": time.time()})
    return back_to


def say_skipped(run: Run, log: Logger, step: int) -> None:
    """``train.on_nonfinite = "skip"``: a line for a skipped step (a loss scaler's overflows go unsaid)."""
    policy = run.nonfinite
    log.line(f"step {step}: {policy.why}; the step was skipped ({policy.in_row} in a row, train.max_skipped = "
             f"{policy.max_skipped})")


def diverged(run: Run, step: int, why: str | None = None):
    """End the run for ``train.on_nonfinite`` after ``step`` (collective): a ``RunDiverged`` on every
    rank, naming the step, what was not finite and the checkpoint that is left; nothing is saved."""
    why = why or agreed_why(run)
    checkpoint.wait()  # an asynchronous save of an earlier, finite step completes
    world = run.ctx.world
    latest = world.bcast_object(checkpoint.latest_step(run.job.checkpoint.dir) if world.rank == 0 else None, root=0)
    left = f"the latest checkpoint is step {latest}" if latest is not None else "no checkpoint was written"
    policy = run.job.train.on_nonfinite
    raise RunDiverged(f"step {step}: {why}; train.on_nonfinite = \"{policy}\": the run stops without saving "
                      f"({left})")


def tokens_per_step(job: Job) -> int:
    return job.data.batch_size * (job.model.block_size if job.model.kind == "gpt" else 1)


def report_step(run: Run, log: Logger, step: int, start_step: int, loss, lr: float,
                seconds: float) -> dict | None:
    """After ``step``: at a log interval (and the run's first and last step) its metrics record,
    returned (collective); the progress display moves on every step, with the dp-mean loss when
    a bar shows it (collective too: rank 0 asked for it at ``Logger.begin``)."""
    record = None
    if step % run.job.train.log_interval == 0 or step in (run.job.train.steps, start_step + 1):
        record = step_record(run, step, float(to_host(loss)), lr, seconds, log.peak_memory_mb())
        log.step(record)
        loss = record["loss"]
    elif log.every_loss:  # one device-to-host copy of the loss per step, only with a live bar
        loss = float(run.ctx.dp_cp.allreduce(np.array([float(to_host(loss))]), "mean")[0])
    else:
        loss = None  # not read: it stays on the device
    log.progress.step(step, loss, tokens_per_step(run.job), seconds)
    return record


def between_steps(run: Run, log: Logger, step: int) -> None:
    """Evaluation and the periodic checkpoint when ``step`` is due for them (collective); both logged."""
    job = run.job
    if job.train.eval_interval and step % job.train.eval_interval == 0 and step < job.train.steps:
        metrics = evaluate(run)
        log.record({"step": step, **metrics})
        log.line(f"step {step}: " + ", ".join(f"{k} {v:.4f}" for k, v in metrics.items()))
    interval = job.checkpoint.interval
    if interval and step % interval == 0 and step < job.train.steps:
        log.line(f"checkpoint {save_checkpoint(run, step)}")


def context_options(job: Job) -> dict:
    """``init``'s keyword arguments from the job besides the grid: the device and how the ranks
    communicate (every context a job's steps run in is built with them: training, ``hpcpar compare``)."""
    p = job.parallel
    return dict(device=job.train.device, shm=p.shm, node_size=p.node_size, backend=p.backend,
                device_nonblocking=p.device_nonblocking)


def same_job_everywhere(job: Job) -> None:
    """A JobError on every rank unless every rank of the world holds ``job``'s settings (collective):
    a job file rewritten while the ranks read it, or one that differs between nodes."""
    from mpi4py import MPI

    differ = identity.ranks_with_another_job(job, MPI.COMM_WORLD)
    if differ:
        raise JobError(job.source, [("", f"world rank(s) {differ} read another job than rank 0 (a job file that changed "
                                         f"while the ranks read it, or that differs between nodes); every rank must "
                                         f"train the same job")])


def start_context(job: Job):
    """The context of the job's grid (a strategy with ``own_context``, a parameter server, splits
    the one its workers train in off this context of the whole world)."""
    p = job.parallel
    with warnings.catch_warnings():  # the placement report (describe) carries the warning
        warnings.simplefilter("ignore", PlacementWarning)
        sizes = {**p.grid_sizes(), "dp": None if strategy_class(job).own_context else p.dp}
        ctx = init(**sizes, **context_options(job))
    # before anything allocates; agreed, since a node's CuPy can lack a dtype another node's has: one
    # line on every rank, never one rank leaving the others in build's first collective
    precision = job.precision
    agreed(ctx.world.mpi, f"train.precision = {precision.name!r}",
           lambda: check_precision(ctx.device, precision), "give every node the same CuPy")
    return ctx


def describe(job: Job, ctx) -> None:
    """Rank 0 logs the resolved job, the grid and the placement (and notices about the job file)."""
    if ctx.rank == 0:
        for notice in job.notices:
            logger.warning(notice)
        logger.info(job.describe())
        logger.info(ctx.grid_table())
        logger.info(ctx.placement_report())
        logger.info(f"shared-memory collectives: {ctx.shm_description()}")


def start_trace(run: Run) -> Tracer | None:
    """With ``train.trace``: every rank records its spans, clocks measured against rank 0 (collective)."""
    if not run.job.train.trace:
        return None
    tracer = Tracer(run.strategy.world_ctx.world, steps=run.job.train.trace_steps)
    run.strategy.use_trace(tracer)
    return tracer


def finish_trace(run: Run, tracer: Tracer | None, log: Logger) -> None:
    """Write the trace of every rank into ``train.trace`` (collective)."""
    if tracer is None:
        return
    tracer.close()
    path = tracer.write(run.job.train.trace)
    if path is not None:
        log.line(f"trace of every rank: {path} (open it in https://ui.perfetto.dev)")


def step_record(run, step: int, loss: float, lr: float, step_s: float, peak_mb: float) -> dict:
    """The metrics of a logged step: the loss averaged over dp, peak memory of every rank (collective)."""
    stats, ctx = run.strategy.stats, run.ctx
    return {"step": step, "loss": float(ctx.dp_cp.allreduce(np.array([loss]), "mean")[0]), "lr": lr,
            "tokens_per_s": tokens_per_step(run.job) / step_s, "step_s": step_s, "compute_s": stats.get("compute_s", 0.0),
            "comm_s": stats.get("comm_s", 0.0), "idle_s": stats.get("idle_s", 0.0),
            "peak_mem_mb": ctx.world.allgather_object(round(peak_mb, 1)), "time": time.time(),
            **({"skipped_steps": stats["skipped_steps"]} if "skipped_steps" in stats else {}),
            **({"nonfinite_steps": run.nonfinite.skipped} if run.nonfinite.skipped else {}),
            **({"rewinds": run.nonfinite.rewinds} if run.nonfinite.rewinds else {}),
            **({"moe": moe_record(run.strategy.model, ctx.world, run.job.data.batch_size)}
               if run.job.moe_config() is not None else {})}


def final_report(run, step: int, log: Logger) -> dict:
    """Evaluation after the last step, and text sampled from a GPT when the job asks for it."""
    metrics = evaluate(run)
    log.record({"step": step, **metrics})
    log.line(", ".join(f"{k} {v:.4f}" for k, v in metrics.items()) + f" after {step} steps")
    if run.job.model.kind == "gpt" and run.job.train.sample_tokens:
        text = sample_text(run, run.job.train.sample_tokens)
        if run.ctx.rank == 0:  # the command's output, not a log line
            print("--- sampled from the model ---\n" + text + "\n------------------------------", flush=True)
    return metrics
