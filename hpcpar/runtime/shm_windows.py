"""Buffers in MPI shared-memory windows, allocated and freed collectively on a node.

``MPI.Win.Allocate_shared`` on a node communicator gives each rank a segment that every
other rank of the node can read and write directly (``Win.Shared_query``). A buffer made
here is this rank's segment as a NumPy array; the node's other ranks made theirs in the
same collective call, so "buffer #k" names one segment per rank and a rank can add up the
peers' buffers without any message. Allocation is collective over the node, in the same
order on every rank (as collectives are); so is freeing (``SharedWindows.collect``).

Every window is opened for passive access (``Lock_all``) at once, so that ``Win.Sync``,
the memory barrier the MPI standard asks for around direct loads and stores, is legal.
"""
from __future__ import annotations

import os
import weakref
from dataclasses import dataclass, field

import numpy as np
from mpi4py import MPI

_NONCONTIGUOUS = {"alloc_shared_noncontig": "true"}  # page-aligned segments, each near its rank
_MARGIN = 64 << 20  # /dev/shm room left for everything else


class ShmUnavailable(RuntimeError):
    """A shared-memory window could not be made on this node (the caller falls back to MPI)."""


@dataclass
class Segment:
    """One collectively allocated buffer: this rank's bytes and views of every rank's."""

    ident: int
    nbytes: int
    window: MPI.Win
    views: list  # per node rank: a uint8 array over its segment (index: node rank)
    address: int = 0  # where this rank's segment starts (to recognise it in an array)
    arrays: dict = field(default_factory=dict)  # dtype -> per-rank typed views, made on first use
    plans: dict = field(default_factory=dict)  # what the collectives prepared for this buffer (hpcpar.runtime.shm)

    def typed(self, dtype, count: int) -> list[np.ndarray]:
        """Every rank's segment as ``count`` elements of ``dtype``."""
        dtype = np.dtype(dtype)
        cached = self.arrays.get(dtype)
        if cached is None:
            cached = self.arrays[dtype] = [v[: self.nbytes - self.nbytes % dtype.itemsize].view(dtype) for v in self.views]
        return [a[:count] for a in cached]


def shm_free_bytes(path: str = "/dev/shm") -> int | None:
    """Free bytes of the shared-memory file system, None where there is none to ask.

    MPICH maps windows from files there; a tmpfs smaller than a window (64 MiB is Docker's
    default) lets the allocation succeed and kills the process with SIGBUS on first touch.
    """
    try:
        stats = os.statvfs(path)
    except (OSError, AttributeError):
        return None
    return stats.f_bavail * stats.f_frsize


class SharedWindows:
    """The shared-memory buffers of one node communicator."""

    def __init__(self, node: MPI.Comm):
        self.node = node
        self.rank, self.size = node.Get_rank(), node.Get_size()
        self.segments: dict[int, Segment] = {}
        self._by_address: dict[int, Segment] = {}
        self._next_ident = 0
        self._dead: set[int] = set()  # buffers the garbage collector dropped here

    def allocate(self, nbytes: int) -> Segment:
        """A new segment of ``nbytes`` on every rank (collective over the node).

        Raises ShmUnavailable on every rank when any rank lacks room for it.
        """
        self.collect()
        free = shm_free_bytes()
        room = free is None or free >= nbytes * self.size + _MARGIN  # every rank's segment of this node
        if not self.node.allreduce(room, op=MPI.LAND):
            raise ShmUnavailable(f"/dev/shm has too little room for {self.size} x {nbytes} bytes")
        try:
            window = MPI.Win.Allocate_shared(max(nbytes, 1), 1, info=MPI.Info.Create(items=_NONCONTIGUOUS),
                                             comm=self.node)
        except MPI.Exception as exc:
            raise ShmUnavailable(f"MPI_Win_allocate_shared failed: {exc}") from exc
        window.Lock_all(MPI.MODE_NOCHECK)
        views = []
        for rank in range(self.size):
            memory, _ = window.Shared_query(rank)
            views.append(np.frombuffer(memory, dtype=np.uint8, count=nbytes))
        segment = Segment(self._next_ident, nbytes, window, views, address=_address(views[self.rank]))
        self._next_ident += 1
        self.segments[segment.ident] = segment
        return segment

    def array(self, count: int, dtype) -> np.ndarray:
        """A zeroed array of this rank's new segment, recognised by ``find`` (collective)."""
        dtype = np.dtype(dtype)
        segment = self.allocate(count * dtype.itemsize)
        mine = np.frombuffer(segment.window.Shared_query(self.rank)[0], dtype=dtype, count=count)
        mine[...] = 0
        self._by_address[segment.address] = segment
        weakref.finalize(mine, self._dead.add, segment.ident)
        return mine

    def find(self, x) -> Segment | None:
        """The segment ``x`` is exactly (same start, same bytes), or None."""
        if not isinstance(x, np.ndarray) or not x.flags.c_contiguous:
            return None
        segment = self._by_address.get(_address(x))
        return segment if segment is not None and segment.nbytes == x.nbytes else None

    def release(self, segment: Segment) -> None:
        """Free a segment this code owns (not one handed out by ``array``); collective."""
        self._free(segment)

    def collect(self) -> None:
        """Free, together, the buffers dropped on every rank of the node (collective).

        Freeing must be collective (``MPI_Win_free`` waits for the node), but a buffer dies when
        the garbage collector drops it, at a different moment on each rank. So a dead buffer is
        only marked, and the next allocation (``allocate`` calls this first) frees together the
        buffers that are dead on every rank.
        """
        dead = self.node.allgather(sorted(self._dead))
        everywhere = set(dead[0]).intersection(*map(set, dead[1:]))
        for ident in sorted(everywhere):
            self._dead.discard(ident)
            self._free(self.segments[ident])

    def close(self) -> None:
        """Free every segment (collective); arrays of them must no longer be used."""
        for ident in sorted(self.segments):
            self._free(self.segments[ident])

    def _free(self, segment: Segment) -> None:
        self.segments.pop(segment.ident, None)
        if self._by_address.get(segment.address) is segment:
            del self._by_address[segment.address]
        segment.views.clear()
        segment.arrays.clear()
        segment.plans.clear()
        segment.window.Unlock_all()
        segment.window.Free()


def _address(array: np.ndarray) -> int:
    return array.__array_interface__["data"][0]
