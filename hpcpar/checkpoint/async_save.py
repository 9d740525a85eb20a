"""Checkpoints written in the background: the state is copied to host memory on the caller's
thread, then a thread writes and commits it on a communicator of its own while training goes on.

One save at a time per process: ``wait()`` blocks until the pending ones are committed (``save``
calls it first, and the first background save registers it to run at exit). A thread may call MPI
only under ``MPI.THREAD_MULTIPLE``; ``writer.save`` writes synchronously where MPI gives less.
"""
from __future__ import annotations

import atexit
import os
import sys
import threading

_pending: list = []
_async_comm = {}
_exit_registered: list = []


class AsyncSave:
    """A save being written by ``thread``; ``wait()`` returns its step folder or raises its error."""

    def __init__(self, thread: threading.Thread, job):
        self.thread, self.job, self.error = thread, job, None

    def __str__(self) -> str:
        return f"{self.job.step_dir} (being written in the background)"

    def wait(self) -> str:
        self.thread.join()
        if self in _pending:
            _pending.remove(self)
        if self.error is not None:
            raise self.error
        return self.job.step_dir


def wait() -> None:
    """Block until every asynchronous save of this process is committed."""
    for handle in list(_pending):
        handle.wait()


def wait_at_exit() -> None:
    """``wait`` as the process ends (atexit, registered by the first asynchronous save, not on
    import). Python prints an error raised here and still exits with status 0, so a job whose
    last checkpoint failed would look like a success: the failure is one line on stderr and the
    process ends with status 1 at once (the error reached every rank, so every rank does)."""
    try:
        wait()
    except BaseException as error:  # noqa: BLE001 - reported, then the status says it
        sys.stdout.flush()
        sys.stderr.write(f"hpcpar: a checkpoint saved in the background failed while the process was ending; "
                         f"that step is not committed ({type(error).__name__}: {error})\n")
        sys.stderr.flush()
        os._exit(1)


def start(job, ctx) -> AsyncSave:
    """Run ``job`` (a ``writer.SaveJob`` holding host copies) on a thread; collective over ``ctx.world``."""
    comm = _async_comm.get(id(ctx.world.mpi))
    if comm is None:  # the writer thread gets its own communicator: no mixing with training's collectives
        comm = _async_comm[id(ctx.world.mpi)] = ctx.world.mpi.Dup()

    def write():
        try:
            job.run(comm)
        except BaseException as error:  # noqa: BLE001 - re-raised by wait() on the caller's thread
            handle.error = error

    thread = threading.Thread(target=write, name=f"hpcpar-checkpoint-{job.step}", daemon=False)
    handle = AsyncSave(thread, job)
    if not _exit_registered:
        _exit_registered.append(atexit.register(wait_at_exit))
    _pending.append(handle)
    thread.start()
    return handle
