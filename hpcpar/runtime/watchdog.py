"""Stall watchdog: a wait that lasts too long names the ranks that have not arrived.

Fail-fast ends a job when a rank raises; a rank that never raises but never arrives either
(stuck in a long computation, a deadlock, a collective called out of order) leaves the
others waiting in silence. Like Horovod's stall inspector, every wait on a ``Communicator``
is polled, and one that lasts ``HPCPAR_STALL_S`` seconds (default 60; 0 turns the watchdog
off) starts a census of where each rank is, which the lowest rank that has arrived reports,
again every ``HPCPAR_STALL_S``; with ``HPCPAR_STALL_ABORT_S`` set, a wait that lasts that long
raises ``StallError``, which fail-fast turns into an abort of the job. A rank whose program has
ended answers censuses from its exit (``answer_at_exit``), so a rank stalled on it raises
``PeerLeft``. docs/architecture.md ("The stall watchdog"): the census, the report, the exit.
"""
from __future__ import annotations

import atexit
import sys
import time

import numpy as np
from mpi4py import MPI

from .failfast import seconds_from_env

WATCHDOG_TAG = 32000  # below 32767, the least tag upper bound MPI guarantees; no hpcpar channel uses it
COLLECTIVES = ("allreduce", "iallreduce", "reduce_scatter", "allgather", "broadcast", "barrier", "ireduce_scatter",
               "iallgather")
_FIRST_CHECK_S = 1.0  # a wait shorter than this never looks at the watchdog's messages
_CHECK_EVERY_S = 0.25
_GRACE_S = 1.0  # after announcing, how long answers may take before the report
_EXIT_POLL_S = 0.01  # how often a rank waiting at its exit looks for censuses


class StallError(RuntimeError):
    """A wait outlasted HPCPAR_STALL_ABORT_S; the message is the stall report."""


class PeerLeft(StallError):
    """A rank this one waits for in a collective has ended its program: the wait can never end."""


LEFT = len(COLLECTIVES)  # the operation number of a notice from a rank that has left its program
ASK = LEFT + 1  # a point-to-point wait asking its peer whether it has left (a live peer ignores it)


def stall_seconds() -> tuple[float | None, float | None]:
    """(HPCPAR_STALL_S, HPCPAR_STALL_ABORT_S); ValueError naming a variable that is not a number >= 0."""
    return seconds_from_env("HPCPAR_STALL_S", 60.0), seconds_from_env("HPCPAR_STALL_ABORT_S", None)


class Waiting:
    """What a rank waits for: collective #seq, or a message from/to a peer."""

    def __init__(self, kind: str, op: str, seq: int = -1, peer: int = -1, tag: int = -1):
        self.kind, self.op, self.seq, self.peer, self.tag = kind, op, seq, peer, tag

    @classmethod
    def collective(cls, op: str, seq: int) -> "Waiting":
        return cls("collective", op, seq=seq)

    @classmethod
    def point_to_point(cls, op: str, peer: int, tag: int) -> "Waiting":
        return cls("p2p", op, peer=peer, tag=tag)


_by_handle: dict = {}  # MPI communicator handle -> its watchdog


class StallWatchdog:
    """The census for one MPI communicator (``comm``: the first hpcpar Communicator over it)."""

    def __init__(self, comm, warn_seconds: float, abort_seconds: float | None):
        self.comm, self.warn_seconds, self.abort_seconds = comm, warn_seconds, abort_seconds
        self.collectives_called = 0  # numbers each collective; every rank calls them in one order
        self.heard: dict[int, tuple[int, str]] = {}  # rank -> (collective #, op) it last said it waits in
        self._announced = -1  # the collective # this rank last announced
        self._sends: list = []  # outstanding notices (and their buffers)
        self.reports: list[str] = []  # what this rank printed, for tests and logs

    @classmethod
    def for_communicator(cls, comm) -> "StallWatchdog | None":
        """The watchdog of ``comm``'s MPI communicator, shared by every hpcpar wrapper of it
        (so all of them number its collectives alike); None when HPCPAR_STALL_S=0."""
        warn, abort = stall_seconds()
        if not warn and not abort:
            return None
        if abort and (not warn or warn > abort):
            warn = abort  # the census must have run when the abort comes
        key = MPI._handleof(comm.mpi)
        watchdog = _by_handle.get(key)
        # A freed communicator's handle is reused by MPI for a new one: its watchdog is stale.
        stale = watchdog is not None and watchdog.comm.mpi == MPI.COMM_NULL
        if watchdog is None or stale or (watchdog.warn_seconds, watchdog.abort_seconds) != (warn, abort):
            watchdog = _by_handle[key] = cls(comm, warn, abort)
        return watchdog

    def next_collective(self, op: str) -> Waiting:
        self.collectives_called += 1
        return Waiting.collective(op, self.collectives_called)

    # ----- the wait ------------------------------------------------------------------
    def wait(self, request, waiting: Waiting, pause=None) -> None:
        """Complete ``request``, checking on the stall every quarter second after the first.

        ``pause(seconds waited)`` runs between polls (the yield wait policy); None spins.
        """
        start = time.perf_counter()
        next_check, next_report = start + min(_FIRST_CHECK_S, self.warn_seconds), start + self.warn_seconds
        asked = False
        while not request.Test():
            now = time.perf_counter()
            if pause is not None:
                pause(now - start)
            if now < next_check:
                continue
            next_check = now + _CHECK_EVERY_S
            waited = now - start
            self._listen(waiting)
            if waited >= self.warn_seconds and waiting.kind == "collective":
                self._announce(waiting)
            elif waited >= self.warn_seconds and not asked and waiting.peer >= 0:
                self._ask(waiting.peer)
                asked = True
            if self.abort_seconds is not None and waited >= max(self.abort_seconds, self.warn_seconds + _GRACE_S):
                raise StallError(self.describe(waiting, waited))
            if now >= next_report + (_GRACE_S if waiting.kind == "collective" else 0.0):
                next_report += self.warn_seconds
                if self._reporter(waiting):
                    self._report(self.describe(waiting, waited))
        self._finish_sends()

    # ----- messages -------------------------------------------------------------------
    def _listen(self, waiting: Waiting) -> None:
        """Take in every notice that has come; answer one about the collective this rank waits in."""
        notice = np.empty(2, dtype=np.int64)
        status = MPI.Status()
        while self.comm.mpi.Iprobe(source=MPI.ANY_SOURCE, tag=WATCHDOG_TAG, status=status):
            self.comm.mpi.Recv(notice, source=status.Get_source(), tag=WATCHDOG_TAG)
            seq, op, source = int(notice[0]), int(notice[1]), status.Get_source()
            if op == ASK:
                continue  # this rank has not left
            if op == LEFT:
                left = f"hpcpar: rank {self._who(source)} of communicator '{self.comm.name}' has ended its program"
                if waiting.kind == "collective" and waiting.seq > seq:
                    raise PeerLeft(f"{left} after its collective #{seq} there, while rank {self._who(self.comm.rank)} "
                                   f"waits in {waiting.op} #{waiting.seq}, which can never complete")
                if waiting.kind != "collective" and waiting.peer == source:
                    raise PeerLeft(f"{left}, while rank {self._who(self.comm.rank)} waits in {waiting.op} "
                                   f"(tag {waiting.tag}) for it, which can never complete")
                continue
            self.heard[status.Get_source()] = (seq, COLLECTIVES[op])
            if waiting.kind == "collective" and seq == waiting.seq:
                self._announce(waiting)

    def _ask(self, peer: int) -> None:
        """Ask the peer of a point-to-point wait whether it has left (it answers only if so)."""
        question = np.array([-1, ASK], dtype=np.int64)
        self._sends.append((self.comm.mpi.Isend(question, dest=peer, tag=WATCHDOG_TAG), question))

    def answer_as_left(self) -> None:
        """At exit: answer each notice that has come with "left after collective #N" (N: the
        collectives this rank called here)."""
        notice = np.empty(2, dtype=np.int64)
        status = MPI.Status()
        while self.comm.mpi.Iprobe(source=MPI.ANY_SOURCE, tag=WATCHDOG_TAG, status=status):
            self.comm.mpi.Recv(notice, source=status.Get_source(), tag=WATCHDOG_TAG)
            if int(notice[1]) != LEFT:
                answer = np.array([self.collectives_called, LEFT], dtype=np.int64)
                self._sends.append((self.comm.mpi.Isend(answer, dest=status.Get_source(), tag=WATCHDOG_TAG), answer))

    def _announce(self, waiting: Waiting) -> None:
        """Tell every other rank: I wait in collective #seq (once per collective)."""
        if self._announced == waiting.seq:
            return
        self._announced = waiting.seq
        notice = np.array([waiting.seq, COLLECTIVES.index(waiting.op)], dtype=np.int64)
        for rank in range(self.comm.size):
            if rank != self.comm.rank:
                self._sends.append((self.comm.mpi.Isend(notice, dest=rank, tag=WATCHDOG_TAG), notice))

    def _finish_sends(self) -> None:
        """Notices are two numbers: sent eagerly, so completing them never waits on the peer."""
        if self._sends:
            MPI.Request.Waitall([request for request, _ in self._sends])
            self._sends = []

    # ----- the report -----------------------------------------------------------------
    def arrived(self, waiting: Waiting) -> list[int]:
        return sorted({self.comm.rank} | {r for r, (seq, _) in self.heard.items() if seq == waiting.seq})

    def _reporter(self, waiting: Waiting) -> bool:
        """One report per stall: the lowest rank that has arrived (each rank for its own p2p wait)."""
        return waiting.kind != "collective" or self.comm.rank == self.arrived(waiting)[0]

    def describe(self, waiting: Waiting, waited: float) -> str:
        comm = self.comm
        head = (f"hpcpar: stall: rank {self._who(comm.rank)} of communicator '{comm.name}' "
                f"has waited {waited:.0f} s")
        if waiting.kind != "collective":
            direction = "to receive from" if "recv" in waiting.op else "to send to"
            return f"{head} {direction} rank {self._who(waiting.peer)} (tag {waiting.tag}) in {waiting.op}"
        arrived = self.arrived(waiting)
        missing = []
        for rank in range(comm.size):
            if rank in arrived:
                continue
            seq, op = self.heard.get(rank, (None, None))
            where = "no word: computing, or waiting elsewhere" if seq is None else f"last heard in {op} #{seq}"
            missing.append(f"rank {self._who(rank)} ({where})")
        return (f"{head} in {waiting.op} #{waiting.seq}; arrived: ranks {', '.join(map(self._who, arrived))}; "
                f"not arrived: {'; '.join(missing) if missing else 'none (the collective is slow, not stalled)'}")

    def _who(self, rank: int) -> str:
        """``r`` or ``r (world w)`` when the communicator is not the world."""
        if self.comm.mpi.Compare(MPI.COMM_WORLD) in (MPI.IDENT, MPI.CONGRUENT):
            return str(rank)
        world = MPI.Group.Translate_ranks(self.comm.mpi.Get_group(), [rank], MPI.COMM_WORLD.Get_group())[0]
        return f"{rank} (world {world})"

    def _report(self, text: str) -> None:
        self.reports.append(text)
        sys.stderr.write(text + "\n")
        sys.stderr.flush()


_exit_barrier = None  # the communicator of the exit barrier, once answer_at_exit has run


def answer_at_exit() -> None:
    """Register (once; collective over the world the first time) the exit barrier: at exit,
    before mpi4py's ``MPI_Finalize``, this rank waits for every rank to reach its own exit,
    answering censuses meanwhile (``StallWatchdog.answer_as_left``)."""
    global _exit_barrier
    if _exit_barrier is None:
        _exit_barrier = MPI.COMM_WORLD.Dup()
        atexit.register(_wait_for_everyone_to_leave)


def _wait_for_everyone_to_leave() -> None:
    if MPI.Is_finalized() or _exit_barrier is None:
        return
    everyone = _exit_barrier.Ibarrier()
    while True:
        watchdogs = [w for w in _by_handle.values() if w.comm.mpi != MPI.COMM_NULL]
        for watchdog in watchdogs:
            watchdog.answer_as_left()
        if everyone.Test():
            break
        time.sleep(_EXIT_POLL_S)
    for watchdog in watchdogs:
        watchdog._finish_sends()
