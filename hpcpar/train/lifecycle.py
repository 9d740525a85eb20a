"""The life of a run across steps and restarts: its start, stop signals, checkpoints, requeue.

``start`` begins a run by the resume policy (``resume``): the run's fingerprint (``identity``),
the verdict every rank shares, the load, the LR schedule taken from the job, and the run
folder's provenance. On SIGTERM or SIGUSR1 (SLURM's warning before the time limit, or a preemption) every rank
agrees at the next step boundary (never mid-step), a checkpoint is saved, and under SLURM the
job asks to be requeued; the requeued job resumes from that checkpoint.
"""
from __future__ import annotations

import os
import signal
import subprocess
import time

import numpy as np

from .. import checkpoint, log
from ..checkpoint.manifest import layout_words
from . import identity, resume
from .resume import Request
from .run_lock import take_run_lock

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
logger = log.get_logger(__name__)


class StopRequest:
    """Remembers a stop signal; the ranks agree on it at step boundaries (never mid-step).

    The handler only sets a flag: a rank may get the signal several times (from SLURM, from
    the launcher, and SIGTERM again when ``scontrol requeue`` ends the job after the save).
    """

    def __init__(self):
        self.signal = None
        self.everyone = False  # True once the ranks agreed to stop on a signal (the same on every rank)
        for sig in STOP_SIGNALS:
            signal.signal(sig, self._handle)

    def _handle(self, signum, frame):
        self.signal = signum

    def ignore_later_signals(self) -> None:
        """The run is over: a stop signal from now on has nothing to stop, and is ignored until the
        process ends. For a process that ends with its run (``hpcpar train``): Python's shutdown
        puts back the default action of every signal it handles, so a SIGUSR1 that SLURM sends just
        as the run ends would kill the finished rank, and the job would end with the signal's status."""
        for sig in STOP_SIGNALS:
            signal.signal(sig, signal.SIG_IGN)


def after_step(run, stop: StopRequest, began: float, action: int = 0) -> tuple[str | None, int]:
    """What every rank does after a step (collective: one all-reduce): (why the run stops at this
    step boundary, a signal or ``train.max_seconds``, or None; the ``train.on_nonfinite`` action,
    ``nonfinite``'s CONTINUE, REWIND or STOP, agreed as the strongest of the ranks' ``action``)."""
    limit = run.job.train.max_seconds
    out_of_time = limit is not None and time.perf_counter() - began > limit
    signal_flag, time_flag, agreed_action = run.ctx.world.allreduce(
        np.array([1.0 if stop.signal else 0.0, float(out_of_time), float(action)]), "max")
    stop.everyone = bool(signal_flag)
    if stop.everyone:
        reason = f"signal {signal.Signals(stop.signal).name}" if stop.signal else "a signal on another rank"
    else:
        reason = "train.max_seconds" if time_flag else None
    return reason, int(agreed_action)


def save_checkpoint(run, step: int, final: bool = False):
    """Checkpoint ``step`` through the strategy (asynchronously if asked, never the last one): the
    step folder, or an asynchronous save's handle."""
    c = run.job.checkpoint
    try:
        checkpoint.wait()  # an earlier asynchronous save's error is that save's, not this one's
    except checkpoint.CheckpointError as error:
        checkpoint_failed(run, error)
    try:
        return run.strategy.save(c.dir, step, run.checkpoint_extra(), keep=c.keep, asynchronous=c.async_ and not final)
    except checkpoint.CheckpointError as error:
        checkpoint_failed(run, error)
        return f"step {step} not written"


def checkpoint_failed(run, error) -> None:
    """``checkpoint.on_error``: "stop" raises the error (every rank has it), "warn" logs it once and training goes on."""
    if run.job.checkpoint.on_error == "stop":
        raise error
    if run.ctx.rank == 0:
        logger.warning(f"{error} (checkpoint.on_error = \"warn\": training goes on; the latest checkpoint is "
                       f"still the previous one)")


def start(run, request: Request, lock=None) -> dict | None:
    """Start the run by the resume policy (collective): the fingerprint, the verdict (a refusal raises
    ``ResumeRefused`` on every rank before anything is written), the load, the run folder's provenance,
    and rank 0's lines about it. ``lock``: rank 0's ``RunLock`` on the checkpoint root (taken here
    when the root is new, before anything is written; it follows the root when ``--overwrite``
    moves the old one aside). Returns the load's info, or None for a fresh run."""
    world, job = run.strategy.world_ctx.world, run.job
    data = data_identity(job) if world.rank == 0 else None
    current = identity.fingerprint(job, world.bcast_object(data, root=0))
    decision = resume.agree(run, request, current, lock)
    take_run_lock(job, world.mpi, lock)  # a new root is made here, by the run that holds it
    hosts = sorted(set(world.allgather_object(os.uname().nodename)))
    info = resume.load(run, decision)
    resumed = info is not None and not decision.weights_only
    schedule = adopt_job_schedule(run) if resumed and info["step"] < job.train.steps else None  # else: nothing to do
    weights_from = info["step_dir"] if info is not None and decision.weights_only else None
    loaded_id = ((info["extra"].get("provenance") or {}).get("run_id") if resumed else None)  # the step's own run
    record = identity.provenance(job, loaded_id or decision.run_id, world.size, hosts, started_from=weights_from)
    run.identity = {"fingerprint": current, "provenance": record}
    if world.rank != 0:
        return info
    identity.write_run_folder(job.checkpoint.dir, job, record, current)
    for line in decision.lines:
        logger.info(line)
    if info is not None:
        say_resumed(run, info, decision, current)
    if schedule:
        logger.info(schedule)
    return info


def say_resumed(run, info: dict, decision, current: dict) -> None:
    """Rank 0: the step folder, step and fingerprint loaded, then one line per allowed change."""
    saved = info["extra"].get("fingerprint") or current
    if decision.weights_only:
        logger.info(f"initialised from the weights of {info['step_dir']} (step {info['source_step']}, {identity.describe(saved)}); "
                    f"a new run starts at step 0 with fresh optimizer state")
        return
    logger.info(f"resumed from {info['step_dir']} (step {info['step']}, {identity.describe(saved)}, written by "
                f"{layout_words(info['layout'])}, run {run.identity['provenance']['run_id']})")
    saved_job = (info["extra"].get("provenance") or {}).get("job")
    for line in identity.changes(saved_job, run.job, info["layout"], run.ctx.layout if run.trains else info["layout"],
                                 saved, current):
        logger.info(line)


def adopt_job_schedule(run) -> str | None:
    """The job is the source of truth for the LR schedule: after a load its values replace the
    checkpoint's (the step count stays). Returns the line naming what changed (None: nothing)."""
    s, job = run.lr_schedule, run.job
    if s is None:
        return None
    wanted = {"optimizer.lr": float(job.optimizer.lr), "train.steps": job.train.steps,
              "lr_schedule.warmup_steps": min(job.lr_schedule.warmup_steps, job.train.steps),
              "lr_schedule.min_lr": float(job.lr_schedule.min_lr)}
    saved = {"optimizer.lr": s.base_lr, "train.steps": s.total_steps, "lr_schedule.warmup_steps": s.warmup_steps,
             "lr_schedule.min_lr": s.min_lr}
    changed = [f"{k} {saved[k]:g} -> {wanted[k]:g}" for k in wanted if saved[k] != wanted[k]]
    s.base_lr, s.total_steps = wanted["optimizer.lr"], wanted["train.steps"]
    s.warmup_steps, s.min_lr = wanted["lr_schedule.warmup_steps"], wanted["lr_schedule.min_lr"]
    s.optimizer.lr = s.lr_at(s.step_count)
    if not changed:
        return None
    return (f"learning-rate schedule from the job, not the checkpoint: {', '.join(changed)} (from step "
            f"{s.step_count} on, lr now {s.optimizer.lr:.3g})")


def data_identity(job) -> dict | None:
    """The identity of the job's token file (None for the digits, which are built in)."""
    if job.data.kind != "text":
        return None
    from ..data.identity import file_identity

    return file_identity(job.data.path)


def requeue_if_slurm(run, stop: StopRequest) -> None:
    """After a signal under SLURM: ask to run the job again (it resumes from the checkpoint just written)."""
    job_id = os.environ.get("SLURM_JOB_ID")
    if not stop.everyone or not job_id:
        return
    run.ctx.world.barrier()  # requeueing ends the job at once: every rank must be done first
    if run.ctx.rank == 0:
        # Requeueing ends this run by force and the launcher says so in words that look like a
        # failure: the line before tells the user they are expected.
        logger.info(f"requeueing SLURM job {job_id}: the checkpoint is saved and the requeued job resumes from it; "
                    f"lines that follow such as '*** JOB {job_id} ON ... CANCELLED AT ... DUE TO JOB REQUEUE ***' "
                    f"(srun) or 'BAD TERMINATION OF ONE OF YOUR APPLICATION PROCESSES' (mpiexec) are expected")
        result = subprocess.run(["scontrol", "requeue", job_id], capture_output=True, text=True)
        if result.returncode == 0:
            logger.info(f"requeue of SLURM job {job_id}: requested")
        else:
            logger.warning(f"requeue of SLURM job {job_id}: {result.stderr.strip()}")
