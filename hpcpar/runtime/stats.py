"""What every communication call adds to ``comm.stats``: calls, bytes given, wire bytes, seconds."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable


# ----------------------------------------------------------------------------------------
# Counters
# ----------------------------------------------------------------------------------------
# Every operation a Communicator records, and the families a name stands for in the queries:
# ``calls("allreduce")`` counts blocking and non-blocking all-reduces, ``calls("iallreduce")``
# the non-blocking ones alone.
OPS = ("barrier", "allreduce", "iallreduce", "reduce_scatter", "ireduce_scatter", "allgather", "iallgather",
       "broadcast", "alltoall", "alltoallv", "send", "isend", "recv", "irecv", "bcast_object", "allgather_object", "gather_object",
       "allreduce_object", "send_object", "recv_object")
FAMILIES = {"allreduce": ("allreduce", "iallreduce"), "send": ("send", "isend"), "recv": ("recv", "irecv")}


def ring_wire_bytes(op: str, nbytes: int, size: int) -> int:
    """Bytes one rank sends over the network for ``op`` given ``nbytes``, under ring algorithms.

    With n = ``size`` ranks and B the bytes the call was given on this rank:

    - all-reduce (B = the whole buffer): reduce-scatter then all-gather, 2(n-1)/n x B;
    - reduce-scatter (B = the whole input, in even or uneven pieces): (n-1)/n x B; all-gather (B = this rank's piece,
      n x B the result): (n-1) x B, that is (n-1)/n of the full size; an uneven all-gather (``iallgather``, B =
      the whole result): (n-1)/n x B, on average over the ranks;
    - broadcast (B = the buffer): pipelined along a chain, (n-1)/n x B per rank on average;
    - send: B; receive: 0 (counted on the sender); barrier: 0;
    - all-to-all: what leaves this rank, given by the call (``wire=``): (n-1)/n x B for equal blocks,
      the rows sent to other ranks for the variable one (``alltoallv``);
    - pickled objects as their array counterparts, with B their pickled size (a gather's
      root receives, the others send B).

    Rounded down to whole bytes; 0 when n = 1. A model of the traffic, not a measurement:
    MPI libraries pick other algorithms for small messages (recursive doubling, trees).
    """
    n = size
    if n <= 1 or op in ("barrier", "recv", "irecv", "recv_object"):
        return 0
    if op in ("allreduce", "iallreduce", "allreduce_object"):
        return 2 * (n - 1) * nbytes // n
    if op in ("reduce_scatter", "ireduce_scatter", "iallgather", "broadcast", "bcast_object"):
        return (n - 1) * nbytes // n
    if op in ("allgather", "allgather_object"):
        return (n - 1) * nbytes
    return nbytes  # send, isend, send_object, gather_object (a non-root rank's contribution)


@dataclass
class CallRecord:
    """One finished call (or the wait of a non-blocking one), as a listener of CommStats hears it."""

    comm: str  # the communicator's name: world, dp, pp, tp, ...
    op: str
    start: float  # time.perf_counter() of this rank
    end: float
    nbytes: int  # given to the call
    wire_bytes: int  # sent by this rank under ring algorithms (0 for a wait)
    peer: int = -1  # point-to-point: the other rank, in this communicator
    tag: int = -1
    wait: bool = False  # the wait that completed a non-blocking call


@dataclass
class OpCount:
    calls: int = 0
    bytes: int = 0  # what the calls were given on this rank
    wire_bytes: int = 0  # what this rank sends on the network under ring algorithms (ring_wire_bytes)
    seconds: float = 0.0


@dataclass
class CommStats:
    """Per-operation counters of one communicator of ``size`` ranks.

    ``bytes(op)`` is what the calls were given on this rank (the buffer of an all-reduce, this
    rank's piece of an all-gather); ``wire_bytes(op)`` is what this rank sends on the network for
    them under ring algorithms (``ring_wire_bytes``). Queries take an operation of ``OPS`` or a
    family of ``FAMILIES``; any other name raises ValueError listing the known ones.
    """

    size: int = 1
    name: str = ""
    ops: dict = field(default_factory=dict)
    listener: Callable[[CallRecord], None] | None = None  # hears every call: a trace (hpcpar.runtime.trace)

    def add(self, op: str, nbytes: int, seconds: float, wire: int | None = None, peer: int = -1,
            tag: int = -1, start: float | None = None) -> None:
        """One call of ``seconds``; ``start`` (its ``time.perf_counter()`` at the start) places it
        in a listener's timeline, which would otherwise end it now."""
        count = self.ops.setdefault(op, OpCount())
        wire = ring_wire_bytes(op, int(nbytes), self.size) if wire is None else int(wire)
        count.calls += 1
        count.bytes += int(nbytes)
        count.wire_bytes += wire
        count.seconds += seconds
        if self.listener is not None:
            begin = time.perf_counter() - seconds if start is None else start
            self.listener(CallRecord(self.name, op, begin, begin + seconds, int(nbytes), wire, peer, tag))

    def add_seconds(self, op: str, seconds: float, peer: int = -1, tag: int = -1, nbytes: int = 0,
                    start: float | None = None) -> None:
        """The time a non-blocking call spent in its wait (``start`` as for ``add``)."""
        self.ops.setdefault(op, OpCount()).seconds += seconds
        if self.listener is not None:
            begin = time.perf_counter() - seconds if start is None else start
            self.listener(CallRecord(self.name, op, begin, begin + seconds, nbytes, 0, peer, tag, wait=True))

    def _counts(self, op: str) -> list[OpCount]:
        names = FAMILIES.get(op, (op,))
        if op not in FAMILIES and op not in OPS and op not in self.ops:
            known = ", ".join(sorted(set(OPS) | set(self.ops)))
            raise ValueError(f"unknown communication op {op!r}; known: {known}")
        return [self.ops[name] for name in names if name in self.ops]

    def calls(self, op: str) -> int:
        return sum(c.calls for c in self._counts(op))

    def bytes(self, op: str) -> int:
        return sum(c.bytes for c in self._counts(op))

    def wire_bytes(self, op: str) -> int:
        return sum(c.wire_bytes for c in self._counts(op))

    def seconds(self, op: str) -> float:
        return sum(c.seconds for c in self._counts(op))

    @property
    def total_seconds(self) -> float:
        return sum(c.seconds for c in self.ops.values())

    @property
    def total_bytes(self) -> int:
        return sum(c.bytes for c in self.ops.values())

    @property
    def total_wire_bytes(self) -> int:
        return sum(c.wire_bytes for c in self.ops.values())

    def reset(self) -> None:
        self.ops.clear()

    def as_dict(self) -> dict:
        return {op: vars(c).copy() for op, c in sorted(self.ops.items())}
