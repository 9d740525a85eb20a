"""The life of a run across steps and restarts: stop signals, resume, checkpoints, requeue.

On SIGTERM or SIGUSR1 (SLURM's warning before the time limit, or a preemption) every rank
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

    def agreed(self, world) -> bool:
        self.everyone = bool(world.allreduce(np.array([1.0 if self.signal else 0.0]), "max")[0])
        return self.everyone


def stop_reason(run, stop: StopRequest, began: float) -> str | None:
    """Why every rank stops after this step (a signal, ``train.max_seconds``), or None; collective."""
    limit = run.job.train.max_seconds
    out_of_time = limit is not None and time.perf_counter() - began > limit
    if stop.agreed(run.ctx.world):
        return f"signal {signal.Signals(stop.signal).name}" if stop.signal else "a signal on another rank"
    if bool(run.ctx.world.allreduce(np.array([float(out_of_time)]), "max")[0]):
        return "train.max_seconds"
    return None


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


def load_latest(run, wanted: bool | None) -> dict | None:
    """Load the latest valid checkpoint when the job resumes and there is one (collective)."""
    c = run.job.checkpoint
    if not ((c.resume if wanted is None else wanted) and checkpoint.list_steps(c.dir)):
        return None
    return run.strategy.load_latest(c.dir, run.checkpoint_extra())


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
