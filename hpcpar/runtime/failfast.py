"""Fail fast, never hang: an uncaught exception on any rank aborts the whole job.

With plain ``python`` an exception on one rank leaves the others waiting forever in their
next collective. Here the failing rank prints ``rank R of N`` and its traceback once, then
calls ``MPI_Abort``, which ends every rank with a non-zero exit (as ``python -m mpi4py`` does).
"""
from __future__ import annotations

import contextlib
import os
import runpy
import sys
import threading
import time
import traceback

ABORT_EXIT_CODE = 1
# Seconds between printing the traceback and MPI_Abort. The launcher forwards a rank's
# stderr through its proxy asynchronously; an immediate abort kills the proxy first about
# once in 25 failures on a loaded machine, and the job then ends with no message at all.
ABORT_GRACE_DEFAULT_S = 0.5


def seconds_from_env(name: str, default: float | None) -> float | None:
    """The number of seconds in the environment variable ``name`` (``default`` when unset or
    empty); ValueError naming the variable when it is not a number >= 0."""
    value = os.environ.get(name)
    if value in (None, ""):
        return default
    try:
        seconds = float(value)
    except ValueError:
        raise ValueError(f"{name} must be a number of seconds, got {value!r}") from None
    if not seconds >= 0:  # nan too
        raise ValueError(f"{name} must be >= 0 seconds, got {value!r}")
    return seconds


def abort_grace_seconds() -> float:
    """HPCPAR_ABORT_GRACE_S; ValueError when it is not a number >= 0 (the commands check it first)."""
    return seconds_from_env("HPCPAR_ABORT_GRACE_S", ABORT_GRACE_DEFAULT_S)


def _grace_while_aborting() -> float:
    try:
        return abort_grace_seconds()
    except ValueError:  # never fail while ending the job: a bad value means the default
        return ABORT_GRACE_DEFAULT_S


class ExitStatus(Exception):
    """Leave with this exit status on every rank, without an abort.

    For verdicts every rank reaches alike without communicating (a bad job file, a failed
    ``hpcpar ckpt verify``): no rank waits for another, so nothing needs killing, and the
    message was already printed once.
    """

    def __init__(self, code: int):
        super().__init__(code)
        self.code = code


class UsageError(ExitStatus):
    """Bad input that every rank finds alike (a missing script, a layout that does not fit):
    the ``hpcpar`` command prints ``message`` once, on rank 0, and every rank exits 2."""

    def __init__(self, message: str, code: int = 2):
        super().__init__(code)
        self.message = message

    def __str__(self) -> str:
        return self.message


@contextlib.contextmanager
def agreed_verdict(prog: str, errors: tuple, comm=None):
    """``with agreed_verdict("hpcpar train", (JobError,)): job = load(...)``: a check every rank
    makes on its own (a job file, a data file, the device) ends with the same verdict on every rank.

    Ranks can see different things: a path one node has and another lacks, a node whose
    environment sets ``HPCPAR_DEVICE``. A rank that raised ``UsageError`` alone would exit while the
    others went on into their next collective and waited there forever. Here every rank learns each
    rank's outcome (one small all-gather over ``comm``, default the world) and, when any raised one
    of ``errors``, every rank raises the same ``UsageError``: the message of the lowest rank that
    found a problem, naming the ranks and hosts when not every rank found it. Other exceptions
    pass (fail-fast aborts the job on them)."""
    problem = None
    try:
        yield
    except errors as error:
        problem = str(error)
    from .. import log

    mine = (problem, os.uname().nodename)
    if comm is None and log.world_size() == 1:  # one rank (MPI's count, else the launcher's): MPI need not start
        everyone = [mine]
    else:
        from mpi4py import MPI

        comm = comm or MPI.COMM_WORLD
        everyone = comm.allgather(mine) if comm.Get_size() > 1 else [mine]
    found = [rank for rank, (text, _) in enumerate(everyone) if text is not None]
    if not found:
        return
    message = f"{prog}: error: {everyone[found[0]][0]}"
    if len(found) < len(everyone):
        others = [rank for rank in range(len(everyone)) if rank not in found]
        hosts = [host for _, host in everyone]
        message += (f" (found by {ranks_on_hosts(found, hosts)}; {ranks_on_hosts(others, hosts)} found no problem: "
                    f"the ranks see different files or settings)")
    raise UsageError(message)


def ranks_on_hosts(ranks: list, hosts: list) -> str:
    """"ranks 1, 3 on node2" for messages naming some ranks (``hosts``: every rank's host)."""
    names = sorted({hosts[rank] for rank in ranks})
    shown = ", ".join(map(str, ranks[:8])) + (f", ... ({len(ranks)} in all)" if len(ranks) > 8 else "")
    return f"rank{'s' if len(ranks) > 1 else ''} {shown} on {', '.join(names[:4])}{' ...' if len(names) > 4 else ''}"


def _abort(exc_type, exc, tb) -> None:
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    if getattr(exc, "report_elsewhere", False) and world.Get_size() > 1:
        # Every rank found the same fault and a lower one reports it: end without repeating it
        # (after the reporter's own grace, so that its report is what the user sees).
        time.sleep(2 * _grace_while_aborting())
        world.Abort(ABORT_EXIT_CODE)
    lines = traceback.format_exception(exc_type, exc, tb)
    header = f"hpcpar: rank {world.Get_rank()} of {world.Get_size()} failed (host {os.uname().nodename}, pid {os.getpid()}):\n"
    sys.stderr.write(header + "".join(lines))
    sys.stderr.flush()
    sys.stdout.flush()
    if world.Get_size() > 1:
        time.sleep(_grace_while_aborting())
        world.Abort(ABORT_EXIT_CODE)
    os._exit(ABORT_EXIT_CODE)


_exiting = False  # set once this process aborts the job for a non-zero exit


def _exit_everywhere(stop: SystemExit) -> None:
    """A non-zero exit while other ranks may wait in MPI: one line, then MPI_Abort with the code."""
    module = sys.modules.get("mpi4py.MPI")
    if module is None or not module.Is_initialized() or module.Is_finalized() or module.COMM_WORLD.Get_size() == 1:
        return  # no peer can be waiting on this process through MPI: a plain exit
    global _exiting
    if _exiting:  # nested fail_fast blocks (hpcpar run's inside the command's): one line, one abort
        return
    _exiting = True
    world = module.COMM_WORLD
    code = stop.code if isinstance(stop.code, int) else ABORT_EXIT_CODE
    reason = stop.code if isinstance(stop.code, str) else f"exit status {stop.code}"
    sys.stdout.flush()
    sys.stderr.write(f"hpcpar: rank {world.Get_rank()} of {world.Get_size()} exited: {reason}\n")
    sys.stderr.flush()
    time.sleep(_grace_while_aborting())
    world.Abort(code)


def _thread_hook(args) -> None:
    if args.exc_type is not SystemExit:
        _abort(args.exc_type, args.exc_value, args.exc_traceback)


def install() -> None:
    """Make uncaught exceptions, in the main thread or any other, abort the MPI job."""
    sys.excepthook = _abort
    threading.excepthook = _thread_hook


FAIL_FAST_VARIABLE = "HPCPAR_FAIL_FAST"


def install_for_init(enabled: bool, world_size: int) -> tuple[bool, str]:
    """``hpcpar.init``'s part: in a job of several ranks, an uncaught exception aborts it, as
    under ``hpcpar run``, so that a plain ``python script.py`` does not leave the other ranks
    waiting. Only Python's own hooks are replaced (an application's, IPython's or a test
    runner's stay). Returns whether fail-fast is wanted here (not turned off, several ranks)
    and what was done, for ``hpcpar info``."""
    if not enabled:
        return False, "left alone (init(fail_fast=False))"
    if os.environ.get(FAIL_FAST_VARIABLE, "1") == "0":
        return False, f"left alone ({FAIL_FAST_VARIABLE}=0)"
    if world_size == 1:
        return False, "left alone (one rank: no other waits on it)"
    return True, _install_unless_taken()


def _install_unless_taken() -> str:
    kept = []
    if sys.excepthook in (sys.__excepthook__, _abort):
        sys.excepthook = _abort
    else:
        kept.append("sys.excepthook")
    if threading.excepthook in (threading.__excepthook__, _thread_hook):
        threading.excepthook = _thread_hook
    else:
        kept.append("threading.excepthook")
    if len(kept) == 2:
        return "left alone (the application's own sys.excepthook and threading.excepthook)"
    return ("on: an uncaught exception on any rank aborts the job"
            + (f" (the application's own {kept[0]} kept)" if kept else ""))


@contextlib.contextmanager
def fail_fast():
    """``with fail_fast(): main()`` — any exception leaving the block aborts every rank.

    ``ExitStatus`` (a verdict every rank reaches alike) and ``SystemExit`` pass through as
    plain exits, without a traceback. A non-zero ``SystemExit`` once MPI runs with other ranks
    could be one rank's alone (``sys.exit(1)`` in a script), and the others would wait for it
    forever: that rank prints one line (not a traceback) and aborts the job with its code.
    """
    try:
        yield
    except ExitStatus:
        raise
    except SystemExit as stop:
        if stop.code not in (None, 0):
            _exit_everywhere(stop)
        raise
    except BaseException:  # noqa: BLE001 - KeyboardInterrupt too: never leave peers waiting
        _abort(*sys.exc_info())


def run_script(path: str, args: list[str]) -> None:
    """``hpcpar run SCRIPT.py ARGS``: run a user's script as ``__main__`` under fail-fast."""
    with agreed_verdict("hpcpar run", (FileNotFoundError,)):  # a script one node lacks: every rank exits 2
        if not os.path.isfile(path):
            raise FileNotFoundError(f"no such script {path!r}")
    sys.argv = [path, *args]
    sys.path.insert(0, os.path.dirname(os.path.abspath(path)))
    install()
    with fail_fast():
        runpy.run_path(path, run_name="__main__")
