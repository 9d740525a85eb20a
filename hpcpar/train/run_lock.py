"""One run per checkpoint folder: the run holds ``run.lock`` in its checkpoint root while it lives.

World rank 0 takes an ``fcntl`` lock on the file (``flock``: the kernel drops it when the
holder dies, even by SIGKILL) and writes who holds it (host, pid, SLURM job id, start time);
a second run on the folder is refused with one line naming that holder before it writes
anything. A free lock whose record has no end names a holder that died: it is taken over
with one line (a requeued SLURM job continues). Where the file system has no working locks
(``flock`` fails) the record alone decides, and a holder that may be alive is never taken
over. Read-only commands (``hpcpar ckpt``, ``generate``) never take the lock.
"""
from __future__ import annotations

import errno
import fcntl
import json
import os
import subprocess
import time

from .. import log
from .config import JobError

LOCK_NAME = "run.lock"
NO_LOCKS = (errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL)  # flock not supported here
logger = log.get_logger(__name__)


class RunLocked(JobError):
    """Another run holds the checkpoint folder: exit 2, nothing written."""

    def __init__(self, source: str, root: str, holder: dict):
        super().__init__(source, [("checkpoint.dir", f"{root} is in use by another run ({describe(holder)}); "
                                                     f"one run per checkpoint folder: wait for it to end, stop it, "
                                                     f"or give this run another checkpoint.dir")])


def describe(holder: dict) -> str:
    if not holder:
        return "its holder has not written its name yet"
    slurm = f", SLURM job {holder['slurm_job_id']}" if holder.get("slurm_job_id") else ""
    return f"pid {holder.get('pid')} on {holder.get('host')}{slurm}, since {holder.get('started')}"


def own_record() -> dict:
    """Who this process is, as the lock file records it."""
    return {"host": os.uname().nodename, "pid": os.getpid(), "boot_id": _boot_id(), "pid_start": _start_ticks(os.getpid()),
            "slurm_job_id": os.environ.get("SLURM_JOB_ID"), "ended": None,
            "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}


def _boot_id() -> str | None:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return None


def _start_ticks(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (a pid reused later has another)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def holder_alive(holder: dict) -> bool | None:
    """True or False where it can be told (this host and boot, or SLURM), None where it cannot."""
    if holder.get("ended"):
        return False
    if holder.get("host") == os.uname().nodename and holder.get("boot_id") == _boot_id():
        ticks = _start_ticks(int(holder.get("pid") or 0))
        return ticks is not None and ticks == holder.get("pid_start")
    job = holder.get("slurm_job_id")
    if job and job == os.environ.get("SLURM_JOB_ID"):
        return False  # this job's earlier instance: SLURM requeued it, so it is gone
    if job:
        return _slurm_job_running(job)
    return None


def _slurm_job_running(job: str) -> bool | None:
    try:
        state = subprocess.run(["squeue", "-h", "-j", job, "-o", "%T"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if state.returncode != 0:
        return False if "Invalid job id" in state.stderr else None
    return state.stdout.strip() in ("RUNNING", "COMPLETING", "SUSPENDED", "CONFIGURING")


class RunLock:
    """The lock on one checkpoint root, held by this process (world rank 0) from ``take`` to ``release``."""

    def __init__(self, root: str, source: str):
        self.root, self.source = root, source
        self.path = os.path.join(root, LOCK_NAME)
        self.fd = None
        self.record = None

    def take(self) -> str | None:
        """Take the lock or raise ``RunLocked``; returns the line to log about it (a takeover), or None."""
        os.makedirs(self.root, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            line = self._lock(fd)
        except BaseException:
            os.close(fd)
            raise
        self.fd, self.record = fd, own_record()
        self._write(self.record)
        return line

    def _lock(self, fd: int) -> str | None:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise RunLocked(self.source, self.root, _read_soon(fd)) from None
        except OSError as error:
            if error.errno not in NO_LOCKS:
                raise
            return self._without_locks(_read(fd), error)
        previous = _read(fd)
        if not previous or previous.get("ended"):
            return None
        if holder_alive(previous) and previous.get("host") != os.uname().nodename:
            # a lock free here while its holder runs elsewhere: this file system's locks are node-local
            raise RunLocked(self.source, self.root, previous)
        return f"{self.path}: took over the lock of a run that ended without releasing it ({describe(previous)})"

    def _without_locks(self, previous: dict, error: OSError) -> str:
        alive = holder_alive(previous) if previous else False
        if alive is not False:
            raise RunLocked(self.source, self.root, previous)
        taken = f"; took over from {describe(previous)}, which is gone" if previous else ""
        return (f"{self.path}: this file system has no working locks ({os.strerror(error.errno)}): one run per "
                f"folder rests on the holder's record alone{taken}")

    def _write(self, record: dict) -> None:
        data = (json.dumps(record, sort_keys=True) + "\n").encode()
        os.ftruncate(self.fd, 0)
        os.pwrite(self.fd, data, 0)
        os.fsync(self.fd)

    def moved(self) -> None:
        """The root was moved aside (``--overwrite``) with this lock file in it: end the record there
        and hold a lock in the new root."""
        if self.fd is not None:
            self.release()
            self.take()

    def release(self) -> None:
        """Mark the record ended (the next run starts without a takeover line) and drop the lock."""
        if self.fd is None:
            return
        try:
            self._write({**self.record, "ended": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())})
        finally:
            os.close(self.fd)  # closing the last descriptor drops the flock
            self.fd = None


def _read(fd: int) -> dict:
    try:
        text = os.pread(fd, 65536, 0).decode()
        return json.loads(text) if text.strip() else {}
    except (OSError, ValueError):
        return {}


def _read_soon(fd: int, wait_s: float = 2.0) -> dict:
    """The holder's record; a holder that has just taken the lock writes it within moments."""
    deadline = time.monotonic() + wait_s
    while True:
        record = _read(fd)
        if record or time.monotonic() > deadline:
            return record
        time.sleep(0.05)


def take_run_lock(job, world, lock: RunLock | None = None, create: bool = True) -> RunLock | None:
    """World rank 0 takes the lock of ``job``'s checkpoint root (``world``: an mpi4py communicator);
    a refusal is the same ``JobError`` on every rank (collective). With ``create`` false a root that
    does not exist yet is left alone (a run refused later writes nothing): call again, with the lock
    returned, before the run writes there. Returns the lock on rank 0 (held or not yet), None elsewhere."""
    outcome = ("ok", None)
    if world.Get_rank() == 0:
        lock = lock or RunLock(job.checkpoint.dir, job.source)
        if lock.fd is None and (create or os.path.isdir(lock.root)):
            try:
                outcome = ("ok", lock.take())
            except RunLocked as refused:
                outcome = ("refused", refused.problems)
    outcome = world.bcast(outcome, root=0) if world.Get_size() > 1 else outcome
    if outcome[0] == "refused":
        raise JobError(job.source, outcome[1])
    if outcome[1] and world.Get_rank() == 0:
        logger.warning(outcome[1])
    return lock
