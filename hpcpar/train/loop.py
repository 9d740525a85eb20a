"""``hpcpar train JOB.toml``: the training loop, the same for every layout and strategy.

    mpiexec -n 4 hpcpar train jobs/gpt-3d.toml --set train.steps=50
    sbatch slurm/train.sbatch jobs/gpt-3d.toml

Per step: this dp replica's rows of the global batch -> the strategy's step (forward,
backward, gradient exchange) -> its finish (clip, optimizer step) -> the LR schedule. Rank 0
logs step, loss, learning rate, tokens/s, the step split into compute / communication /
pipeline idle, and peak memory per rank, appends metrics to a JSONL file, evaluates on the
validation split, and checkpoints every ``checkpoint.interval`` steps and at the end. A stop
signal or ``train.max_seconds`` ends the run at a step boundary with a checkpoint
(``lifecycle``). Parameter-server ranks serve instead (``Strategy.serve``).
"""
from __future__ import annotations

import sys
import time
import warnings

import numpy as np

from .. import checkpoint
from ..dist.context import init
from ..dist.topology import PlacementWarning
from .build import Run, build
from .config import Job
from .evaluate import evaluate, sample_text
from .lifecycle import StopRequest, load_latest, requeue_if_slurm, save_checkpoint, stop_reason
from .report import Logger, peak_memory_mb


def train(job: Job, resume: bool | None = None, stop: StopRequest | None = None) -> dict:
    """Train ``job`` on every rank of the world; returns the last logged metrics (on every trainer).

    ``resume`` overrides ``checkpoint.resume``; ``stop`` is the signal catcher
    (one is installed when not given).
    """
    stop = stop or StopRequest()
    run = start(job)
    if not run.trains:  # a parameter server: loads with the workers, serves until each has stopped
        load_latest(run, resume)
        run.strategy.serve(lambda step: save_checkpoint(run, step, final=True))
        return {}
    log = Logger(job, run.ctx, job.train.steps)
    info = load_latest(run, resume)
    if info is not None:
        log.line(f"resumed from {info['step_dir']} (written by layout {info['layout']})")
    step = start_step = info["step"] if info is not None else 0
    last, reason, began = {"step": step}, None, time.perf_counter()
    while step < job.train.steps and reason is None:
        started = time.perf_counter()
        inputs, targets = run.train_data.batch_at(step)
        run.train_data.step = step + 1
        loss = run.strategy.train_step(inputs, targets)
        run.strategy.finish_step(job.optimizer.grad_clip, loss)
        lr = run.strategy.optimizer.lr
        run.lr_schedule.step()
        step += 1
        if step % job.train.log_interval == 0 or step in (job.train.steps, start_step + 1):
            last = step_record(run, step, loss, lr, time.perf_counter() - started)
            log.step(last)
        if job.train.eval_interval and step % job.train.eval_interval == 0 and step < job.train.steps:
            metrics = evaluate(run)
            log.record({"step": step, **metrics})
            log.line(f"step {step}: " + ", ".join(f"{k} {v:.4f}" for k, v in metrics.items()))
        interval = job.checkpoint.interval
        if interval and step % interval == 0 and step < job.train.steps and run.strategy.checkpoint_allowed(step):
            save_checkpoint(run, step)
        reason = stop_reason(run, stop, began)

    def save_final():
        log.line(f"checkpoint {save_checkpoint(run, step, final=True)}")
    run.strategy.finish_training(save_final if step > start_step or reason else None)
    checkpoint.wait()
    if reason is not None:
        log.line(f"stopped at step {step} ({reason}); checkpoint saved")
        requeue_if_slurm(run, stop)
        return {**last, "stopped": reason}
    return {**last, **final_report(run, step, log)}


def start(job: Job) -> Run:
    """The context and the run; rank 0 prints the resolved job, the grid and the placement."""
    p = job.parallel
    with warnings.catch_warnings():  # the placement report below carries the warning
        warnings.simplefilter("ignore", PlacementWarning)
        # A parameter-server job's grid holds the workers: the servers come from the same world.
        ctx = init(dp=None if p.mode == "ps" else p.dp, pp=p.pp, tp=p.tp, device=job.train.device, shm=p.shm,
                   node_size=p.node_size)
    if ctx.rank == 0:
        for notice in job.notices:
            print(f"hpcpar train: notice: {notice}", file=sys.stderr, flush=True)
        print(job.describe(), flush=True)
        print(ctx.grid_table(), flush=True)
        print(ctx.placement_report(), flush=True)
        print(f"shared-memory collectives: {ctx.shm_description()}", flush=True)
    return build(job, ctx)


def step_record(run, step: int, loss: float, lr: float, step_s: float) -> dict:
    """The metrics of a logged step: the loss averaged over dp, peak memory of every rank (collective)."""
    stats, ctx = run.strategy.stats, run.ctx
    tokens = run.job.data.batch_size * (run.job.model.block_size if run.job.model.kind == "gpt" else 1)
    return {"step": step, "loss": float(ctx.dp.allreduce(np.array([loss]), "mean")[0]), "lr": lr,
            "tokens_per_s": tokens / step_s, "step_s": step_s, "compute_s": stats.get("compute_s", 0.0),
            "comm_s": stats.get("comm_s", 0.0), "idle_s": stats.get("idle_s", 0.0),
            "peak_mem_mb": ctx.world.allgather_object(round(peak_memory_mb(), 1)), "time": time.time(),
            **({"skipped_steps": stats["skipped_steps"]} if "skipped_steps" in stats else {})}


def final_report(run, step: int, log: Logger) -> dict:
    """Evaluation after the last step, and text sampled from a GPT when the job asks for it."""
    metrics = evaluate(run)
    log.record({"step": step, **metrics})
    log.line(", ".join(f"{k} {v:.4f}" for k, v in metrics.items()) + f" after {step} steps")
    if run.job.model.kind == "gpt" and run.job.train.sample_tokens:
        text = sample_text(run, run.job.train.sample_tokens)
        log.line("--- sampled from the model ---\n" + text + "\n------------------------------")
    return metrics
