"""Shared-memory, hierarchical all-reduce: the node's memory bandwidth instead of MPI's copies.

MPI libraries move a one-node all-reduce through their own buffers (MPICH here: 64 MiB at 2
ranks in ~8-10 ms, where a memory copy takes ~3.5-6.5 ms). Here the ranks of a node keep their
buffers in an MPI shared-memory window (``shm_windows``) and reduce them in place, in parallel,
with no message: rank r sums slice r of the node's buffers in MPICH's order (``shm_reduce``; in C
through ``shm_kernel``, or NumPy), all-reduces it with rank r of every other node over MPI and
writes it into every buffer; counters in a small shared control window order the ranks.

A ``Communicator`` gets a ``ShmCollectives`` as ``comm.shm`` from ``hpcpar.init`` when the path is
on (the default on CPUs; off with ``init(shm=False)``, ``HPCPAR_SHM=0`` or the job key
``parallel.shm = false``). docs/architecture.md ("The shared-memory all-reduce") gives the steps,
the calls that take the path, the waiting, the agreement between ranks and the counting.
"""
from __future__ import annotations

import collections
import functools
import os
import time
from abc import ABC, abstractmethod

import numpy as np
from mpi4py import MPI

from ..backend import is_gpu_array
from . import debug, shm_kernel
from .comm import REDUCE_OPS, Handle, check_allreduce_args
from .stats import CommStats
from .waiting import polite_pause
from .shm_reduce import reduce_into, slices
from .shm_windows import SharedWindows, ShmUnavailable

SHM_VARIABLE = "HPCPAR_SHM"
DEFAULT_ON = True  # every MPI test passed with all collectives through it (2, 4, 2x2 ranks), and it is faster
MIN_BYTES = 64 << 10  # below: MPI's latency wins or ties (2 ranks: the path's ~11 us a call, MPICH 10-18 us at 32 KiB)
MAX_COPY_BYTES = 8 << 20  # above: copying a plain array in and out costs more than MPI saves
CHUNK_BYTES = 256 << 10  # NumPy's chunk: sources and sum fit a core's L2 (64 KiB-1 MiB measured: 256-512 KiB best)
UFUNCS = {"sum": np.add, "mean": np.add, "max": np.maximum, "min": np.minimum}
DTYPES = tuple(np.dtype(t) for t in (np.float32, np.float64, np.int32, np.int64))
_POSTED, _DONE, _RING = 0, 1, 2  # control words: ops posted, ops this rank finished, then (buffer, count) per op
_RING_OPS = 64  # ops in flight before posting waits
_CONTROL_WORDS = _RING + 2 * _RING_OPS
_SPIN_S = 0.01
_PLANS_KEPT = 16  # prepared slices per buffer


def shm_setting(enabled: bool | None = None) -> bool:
    """Whether the path is on: ``enabled`` if given, else HPCPAR_SHM (0 or 1), else DEFAULT_ON."""
    if enabled is not None:
        return bool(enabled)
    text = os.environ.get(SHM_VARIABLE, "")
    if text == "":
        return DEFAULT_ON
    if text not in ("0", "1"):
        raise ValueError(f"{SHM_VARIABLE} must be 0 or 1, got {text!r}")
    return text == "1"


def shared_zeros(comm, count: int, dtype, xp=np):
    """A zeroed buffer for repeated collectives on ``comm``: in the node's shared window when
    ``comm``'s shared-memory path takes buffers of this size, else ``xp.zeros``.

    Collective over ``comm``: every rank calls it, in the same order, with the same sizes.
    """
    shm = getattr(comm, "shm", None)
    if shm is not None and xp is np:
        buffer = shm.zeros(count, dtype)
        if buffer is not None:
            return buffer
    return xp.zeros(count, dtype=dtype)


class ShmCollectives:
    """The shared-memory path of one Communicator (``comm.shm``); set up at its first use."""

    def __init__(self, comm, node_color: int, min_bytes: int = MIN_BYTES, chunk_bytes: int = CHUNK_BYTES):
        self.comm, self.node_color = comm, node_color
        self.min_bytes, self.chunk_bytes = min_bytes, chunk_bytes
        self.stats = CommStats(size=comm.size, name=comm.name)  # the calls that took this path
        self.usable: bool | None = None  # None until the first call that could use it
        self.node = self.cross = self.windows = None
        self._control = self._scratch = None
        self._seq = 0
        self._queue: collections.deque = collections.deque()  # posted ops this rank has not finished

    # ----- set-up (collective over comm) ------------------------------------------------
    def _ready(self) -> bool:
        if self.usable is None:
            self.usable = self._set_up()
        return self.usable

    def _set_up(self) -> bool:
        mpi = self.comm.mpi
        node = mpi.Split(self.node_color, self.comm.rank)
        sizes = mpi.allgather(node.Get_size())
        if max(sizes) == 1 or len(set(sizes)) > 1:  # nothing to share, or no slice partners across nodes
            node.Free()
            return False
        windows = SharedWindows(node)
        try:
            control = windows.allocate(_CONTROL_WORDS * 8)
        except ShmUnavailable:
            control = None
        if not mpi.allreduce(control is not None, op=MPI.LAND):
            windows.close()
            node.Free()
            return False
        self.node, self.windows, self._control = node, windows, control
        self._words = control.typed(np.int64, _CONTROL_WORDS)
        self._words[node.Get_rank()][...] = 0
        self.rank, self.size = node.Get_rank(), node.Get_size()
        self.nodes = self.comm.size // self.size
        self.cross = mpi.Split(self.rank, self.comm.rank) if self.nodes > 1 else None
        node.Barrier()  # every control word is zero before anyone reads one
        return True

    def close(self) -> None:
        """Finish what is in flight and free the windows and communicators (collective over comm);
        buffers handed out must no longer be used. The path is off afterwards."""
        if self.usable:
            self._drain()
            self.windows.close()
            self.node.Free()
            if self.cross is not None:
                self.cross.Free()
        self.usable, self.node, self.cross, self.windows = False, None, None, None

    def describe(self) -> str:
        if self.usable is None:
            return "on (not used yet)"
        if not self.usable:
            return "off for this communicator (one rank per node, or nodes of unequal size)"
        return f"on: {self.nodes} node(s) x {self.size} ranks"

    # ----- buffers ------------------------------------------------------------------------
    def zeros(self, count: int, dtype):
        """A zeroed shared buffer of ``count`` elements (collective), or None when MPI will serve it."""
        dtype = np.dtype(dtype)
        if dtype not in DTYPES or count * dtype.itemsize < self.min_bytes or not self._ready():
            return None
        self._drain()
        try:
            buffer = self.windows.array(count, dtype)
        except ShmUnavailable:
            buffer = None
        return buffer if self.comm.mpi.allreduce(buffer is not None, op=MPI.LAND) else None

    def _scratch_for(self, nbytes: int):
        """The shared scratch buffer, grown to hold ``nbytes`` (collective), or None."""
        if self._scratch is None or self._scratch.nbytes < nbytes:
            self._drain()
            if self._scratch is not None:
                self.windows.release(self._scratch)
                self._scratch = None
            try:
                scratch = self.windows.allocate(1 << (nbytes - 1).bit_length())
            except ShmUnavailable:
                scratch = None
            if not self.comm.mpi.allreduce(scratch is not None, op=MPI.LAND):
                if scratch is not None:
                    self.windows.release(scratch)
                return None
            self._scratch = scratch
        return self._scratch

    def _takes(self, x, op: str) -> bool:
        return (isinstance(x, np.ndarray) and not is_gpu_array(x) and x.dtype in DTYPES
                and max(1, self.min_bytes) <= x.nbytes
                and not (op == "mean" and x.dtype.kind != "f") and self._ready())

    # ----- the collectives (None: not taken, the caller uses MPI) ---------------------------
    def allreduce(self, x, op: str = "sum", out=None):
        if x.nbytes < self.min_bytes:  # first, as it is the cheapest refusal: MPI's call checks the arguments
            return None
        check_allreduce_args("allreduce", x, op, out)
        if not self._takes(x, op):
            return None
        start = time.perf_counter()
        segment = self.windows.find(x) if out is x else None
        in_place = segment is not None  # x is a shared buffer: reduced where it lies
        if not in_place:
            if x.nbytes > MAX_COPY_BYTES:
                return None
            segment = self._scratch_for(x.nbytes)
            if segment is None:
                return None
        debug.check_collective(self.comm, "allreduce", x)
        waiting = self.comm._next_collective("allreduce")
        if not in_place:
            mine = segment.typed(x.dtype, x.size)[self.rank]
            mine[...] = x.reshape(-1)
        self.comm._wait(self._post(_Allreduce(self, segment, x.dtype, x.size, op)), waiting)
        if not in_place:
            out = np.empty_like(x) if out is None else out
            out.reshape(-1)[...] = mine
        self._count("allreduce", x.nbytes, time.perf_counter() - start, start)
        return x if in_place else out

    def iallreduce(self, x, op: str = "sum", out=None) -> Handle | None:
        if x.nbytes < self.min_bytes:
            return None
        check_allreduce_args("iallreduce", x, op, out)
        if out is not x or not self._takes(x, op):
            return None
        segment = self.windows.find(x)
        if segment is None:
            return None
        start = time.perf_counter()
        debug.check_collective(self.comm, "iallreduce", x)
        request = self._post(_Allreduce(self, segment, x.dtype, x.size, op))
        self._count("iallreduce", x.nbytes, time.perf_counter() - start, start)
        return Handle(self.comm, "iallreduce", request, lambda: x, self.comm._next_collective("iallreduce"),
                      nbytes=x.nbytes)

    def reduce_scatter(self, x, op: str = "sum"):
        """This rank's block of the reduced shared buffer ``x`` (a communicator on one node)."""
        if not self._takes(x, op):
            return None
        segment = self.windows.find(x)
        if segment is None or self.nodes != 1:
            return None
        start = time.perf_counter()
        debug.check_collective(self.comm, "reduce_scatter", x)
        waiting = self.comm._next_collective("reduce_scatter")
        result = np.empty(x.size // self.size, dtype=x.dtype)
        self.comm._wait(self._post(_ReduceScatter(self, segment, x.dtype, x.size, op, result)), waiting)
        self._count("reduce_scatter", x.nbytes, time.perf_counter() - start, start)
        return result.reshape((x.shape[0] // self.size,) + x.shape[1:])

    def allgather(self, x, out):
        """Every rank's ``x`` written into block r of the shared buffer ``out`` (a communicator on one node)."""
        if out is None or not self._takes(out, "sum") or x.dtype != out.dtype:
            return None
        segment = self.windows.find(out)
        if segment is None or self.nodes != 1 or out.size != x.size * self.size:
            return None
        start = time.perf_counter()
        debug.check_collective(self.comm, "allgather", x)
        waiting = self.comm._next_collective("allgather")
        self.comm._wait(self._post(_Allgather(self, segment, out.dtype, out.size, x)), waiting)
        self._count("allgather", x.nbytes, time.perf_counter() - start, start)
        return out

    def _count(self, name: str, nbytes: int, seconds: float, start: float) -> None:
        self.comm.stats.add(name, nbytes, seconds, start=start)
        self.stats.add(name, nbytes, seconds, start=start)

    # ----- flags: posting, progress, completion ------------------------------------------
    def _post(self, op) -> "_Request":
        if self._seq >= _RING_OPS and self._lowest(_DONE) <= self._seq - _RING_OPS:
            self._wait_until(lambda: self._lowest(_DONE) > self._seq - _RING_OPS)
        self._seq += 1
        op.seq = self._seq
        mine = self._words[self.rank]
        slot = _RING + 2 * (op.seq % _RING_OPS)
        mine[slot], mine[slot + 1] = op.segment.ident, op.count
        self._fence()  # the buffer's contents before the counter that announces them
        mine[_POSTED] = op.seq
        self._queue.append(op)
        self._progress()
        return _Request(self, op)

    def _progress(self) -> None:
        """Do this rank's part of the oldest posted ops whose buffers are ready everywhere."""
        while self._queue:
            op = self._queue[0]
            if op.cross_request is not None:
                if not op.cross_request.Test():
                    return
                op.cross_request = None
                op.after_cross()
            else:
                if self._lowest(_POSTED) < op.seq:
                    return
                self._fence()
                self._check_same_buffer(op)
                op.cross_request = op.work()
                if op.cross_request is not None:
                    continue
            self._fence()  # the slice written before the counter that says so
            self._words[self.rank][_DONE] = op.seq
            self._queue.popleft()

    def _complete(self, op) -> bool:
        self._progress()
        if op.seq > self._words[self.rank][_DONE] or self._lowest(_DONE) < op.seq:
            return False
        self._fence()  # the peers' slices after the counters that announced them
        return True

    def _lowest(self, word: int) -> int:
        return min(int(words[word]) for words in self._words)

    def _fence(self) -> None:
        self._control.window.Sync()

    def _check_same_buffer(self, op) -> None:
        slot = _RING + 2 * (op.seq % _RING_OPS)
        seen = [(int(words[slot]), int(words[slot + 1])) for words in self._words]
        if len(set(seen)) > 1:
            raise RuntimeError(
                f"shared-memory {op.name} #{op.seq} on '{self.comm.name}': the node's ranks passed different "
                f"buffers (shared buffer, element count by node rank: {seen}); buffers from shared_zeros must "
                "be used by every rank of the node in the same call")

    def _wait_until(self, condition) -> None:
        start = time.perf_counter()
        while True:
            self._progress()
            if condition():
                return
            polite_pause(time.perf_counter() - start)

    def _drain(self) -> None:
        """Finish every op in flight (before a collective window call, which would block them)."""
        if self._queue or self._lowest(_DONE) < self._seq:
            self._wait_until(lambda: not self._queue and self._lowest(_DONE) >= self._seq)


class _Request:
    """The MPI-request face of a posted op, for Handle and Communicator._wait."""

    def __init__(self, shm: ShmCollectives, op):
        self.shm, self.op = shm, op

    def Test(self) -> bool:  # noqa: N802 - mpi4py's name
        return self.shm._complete(self.op)

    def Wait(self) -> None:  # noqa: N802
        start = time.perf_counter()
        while not self.Test():
            waited = time.perf_counter() - start
            if waited > _SPIN_S:
                polite_pause(waited)


class _Op(ABC):
    """One collective on shared buffers: ``work`` does this rank's part once all have posted."""

    name = "op"

    def __init__(self, shm: ShmCollectives, segment, dtype, count: int, op: str = "sum"):
        self.shm, self.segment, self.dtype, self.count, self.op = shm, segment, np.dtype(dtype), count, op
        self.seq = 0
        self.cross_request = None

    @abstractmethod
    def work(self):
        """This rank's part; returns the MPI request of the inter-node step, or None."""

    def after_cross(self) -> None:
        """What is left once the inter-node step (if ``work`` started one) has completed."""

    def _reducer(self, sources: list, targets: list, divisor: int = 0):
        """A call setting every target to the op over ``sources`` in MPICH's order (divided unless
        ``divisor`` is 0): one native call where libhpcpar_shm.so does the op, else NumPy's chunk loop."""
        run = shm_kernel.prepare(sources, targets, self.op, divisor)
        if run is None:
            chunk = max(1, self.shm.chunk_bytes // self.dtype.itemsize)
            run = functools.partial(reduce_into, sources, targets, UFUNCS[self.op], divisor, chunk)
        return run

    def _divisor(self) -> int:
        return self.shm.comm.size if self.op == "mean" else 0


class _Allreduce(_Op):
    name = "allreduce"

    def work(self):
        own, node_sum, self.write_out = self._plan()
        node_sum()
        if self.write_out is None:  # one node: the node's sum was the result, written into every buffer
            return None
        return self.shm.cross.Iallreduce(MPI.IN_PLACE, own, REDUCE_OPS[self.op])

    def after_cross(self) -> None:
        """The final value of this rank's slice: divided for a mean, copied into every peer's buffer."""
        self.write_out()

    def _plan(self):
        """(this rank's slice, the node's sum of it, the write-out after the inter-node step or None),
        made at a buffer's first all-reduce and kept with it (DDP reduces the same buckets every step)."""
        key = ("allreduce", self.dtype, self.count, self.op)
        plan = self.segment.plans.get(key)
        if plan is None:
            shm = self.shm
            part = slice(*slices(self.count, shm.size, self.dtype.itemsize)[shm.rank])
            parts = [buffer[part] for buffer in self.segment.typed(self.dtype, self.count)]
            own, peers = parts[shm.rank], parts[:shm.rank] + parts[shm.rank + 1:]
            if shm.cross is None:
                plan = (own, self._reducer(parts, parts, self._divisor()), None)
            else:
                plan = (own, self._reducer(parts, [own]), self._reducer([own], [own] + peers, self._divisor()))
            if len(self.segment.plans) >= _PLANS_KEPT:  # the scratch buffer sees many sizes
                self.segment.plans.clear()
            self.segment.plans[key] = plan
        return plan


class _ReduceScatter(_Op):
    name = "reduce_scatter"

    def __init__(self, shm, segment, dtype, count, op, result):
        super().__init__(shm, segment, dtype, count, op)
        self.result = result

    def work(self):
        block = self.result.size
        first = self.shm.rank * block
        buffers = self.segment.typed(self.dtype, self.count)
        self._reducer([b[first: first + block] for b in buffers], [self.result], self._divisor())()
        return None


class _Allgather(_Op):
    name = "allgather"

    def __init__(self, shm, segment, dtype, count, block):
        super().__init__(shm, segment, dtype, count)
        self.block = block.reshape(-1)

    def work(self):
        first = self.shm.rank * self.block.size
        for buffer in self.segment.typed(self.dtype, self.count):
            buffer[first: first + self.block.size] = self.block
        return None
