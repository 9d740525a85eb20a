"""Array communication on NumPy and CuPy buffers, with every call counted.

A ``Communicator`` wraps one mpi4py communicator. Array calls take NumPy or CuPy arrays:
CuPy buffers go straight to MPI when the MPI library is CUDA-aware (after a device
synchronize, since MPI reads device memory outside CuPy's stream order; in blocking
collectives unless the library is known to take device buffers in non-blocking ones:
``DEVICE_NONBLOCKING``) and are staged through reused host buffers otherwise
(``HostStaging``); ``hpcpar.dist.nccl`` has the same API over NCCL. Calls that move pickled
Python objects have their own names (``*_object``) so they are never mistaken for the array path.

Every call adds to ``comm.stats`` (calls, the bytes it was given, the bytes this rank sends on
the wire under ring algorithms, seconds), so the layers above can report a communication share
and the traffic, and tests can assert exact counts.
"""
from __future__ import annotations

import ctypes
import functools
import os
import pickle
import re
import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
from mpi4py import MPI

from .. import host
from ..backend import copy_to_device, copy_to_host, get_array_module, is_gpu_array, pinned_empty, synchronize
from . import debug
from .waiting import polite_pause, wait_politely
from .watchdog import StallWatchdog, Waiting

REDUCE_OPS = {"sum": MPI.SUM, "mean": MPI.SUM, "max": MPI.MAX, "min": MPI.MIN}
WAIT_POLICIES = ("spin", "yield")


# ----------------------------------------------------------------------------------------
# Facts about the MPI library
# ----------------------------------------------------------------------------------------
def query_cuda_aware() -> bool:
    """Whether MPI accepts device pointers: ``HPCPAR_CUDA_AWARE=0|1`` or the library's own answer.

    mpi4py does not wrap ``MPIX_Query_cuda_support``, so it is called through ctypes on
    the already loaded libmpi (reached through mpi4py's extension module). Unknown means no:
    staging through host memory is always correct, only slower.
    """
    override = os.environ.get("HPCPAR_CUDA_AWARE")
    if override is not None:
        if override not in ("0", "1"):
            raise ValueError(f"HPCPAR_CUDA_AWARE must be 0 or 1, got {override!r}")
        return override == "1"
    try:
        query = ctypes.CDLL(MPI.__file__).MPIX_Query_cuda_support
    except (OSError, AttributeError):
        return False
    query.restype = ctypes.c_int
    return bool(query())


# Whether a CUDA-aware MPI takes device buffers in NON-BLOCKING collectives, by library and
# version: (library name as MPI_Get_library_version starts, first version, last version or None,
# verdict). What is not listed counts as no: a blocking collective is always correct, a
# non-blocking one on device memory where the library does not support it reads garbage.
DEVICE_NONBLOCKING = (
    # Open MPI's FAQ for v4.x and earlier (open-mpi.org/faq/?category=runcuda): device pointers
    # work in send/receive and blocking collectives, not in non-blocking collectives.
    ("Open MPI", (1, 7), (4, 99), False),
    # Open MPI 5's coll/cuda component stages reductions on GPU buffers for the blocking calls;
    # its documentation promises nothing for the non-blocking ones.
    ("Open MPI", (5, 0), None, False),
    # MPICH 4's GPU support (yaksa) moves and reduces device buffers in every communication
    # call through one datatype engine, non-blocking collectives included.
    ("MPICH", (4, 0), None, True),
)


def library_version(text: str | None = None) -> tuple[str, tuple[int, ...]]:
    """(library, version) from MPI_Get_library_version's ``text``: ("MPICH", (4, 2, 0)), ("Open MPI", (4, 1, 5))."""
    text = MPI.Get_library_version() if text is None else text
    for name in ("Open MPI", "CRAY MPICH", "MVAPICH", "MPICH", "Intel(R) MPI"):  # Cray's MPICH numbers its own versions
        if name in text:
            match = re.search(r"(\d+(?:\.\d+)+)", text[text.index(name):])
            return name, tuple(int(p) for p in match.group(1).split(".")) if match else ()
    return text.split()[0] if text.split() else "unknown", ()


def device_nonblocking_supported(library: str | None = None, version: tuple | None = None) -> bool:
    """Whether non-blocking collectives may take device buffers: ``HPCPAR_DEVICE_NONBLOCKING=0|1``,
    else ``DEVICE_NONBLOCKING`` for this library and version (unknown: no)."""
    override = os.environ.get("HPCPAR_DEVICE_NONBLOCKING")
    if override not in (None, ""):
        if override not in ("0", "1"):
            raise ValueError(f"HPCPAR_DEVICE_NONBLOCKING must be 0 or 1, got {override!r}")
        return override == "1"
    if library is None:
        library, version = library_version()
    for name, first, last, verdict in DEVICE_NONBLOCKING:
        if library == name and tuple(version[:len(first)]) >= first and (last is None or tuple(version[:2]) <= last):
            return verdict
    return False


def default_wait_policy(node_size: int, cpus: int | None = None) -> str:
    """``yield`` when more ranks than CPUs share the node, else ``spin``; ``HPCPAR_WAIT`` overrides.

    ``cpus``: the CPUs the node's ranks may run on (default: this process's, see
    ``host.usable_cpus``: affinity and cgroup quota, not ``os.cpu_count()``). MPICH
    busy-polls inside blocking waits; oversubscribed, three spinning ranks halved the
    fourth one's compute (525 -> 1080 ms for a matmul), so waits must give the core away.
    """
    policy = os.environ.get("HPCPAR_WAIT")
    if policy is not None:
        if policy not in WAIT_POLICIES:
            raise ValueError(f"HPCPAR_WAIT must be one of {WAIT_POLICIES}, got {policy!r}")
        return policy
    return "yield" if node_size > (host.usable_cpus() if cpus is None else cpus) else "spin"


# ----------------------------------------------------------------------------------------
# Counters
# ----------------------------------------------------------------------------------------
# Every operation a Communicator records, and the families a name stands for in the queries:
# ``calls("allreduce")`` counts blocking and non-blocking all-reduces, ``calls("iallreduce")``
# the non-blocking ones alone.
OPS = ("barrier", "allreduce", "iallreduce", "reduce_scatter", "allgather", "broadcast",
       "send", "isend", "recv", "irecv", "bcast_object", "allgather_object", "gather_object",
       "allreduce_object", "send_object", "recv_object")
FAMILIES = {"allreduce": ("allreduce", "iallreduce"), "send": ("send", "isend"), "recv": ("recv", "irecv")}


def ring_wire_bytes(op: str, nbytes: int, size: int) -> int:
    """Bytes one rank sends over the network for ``op`` given ``nbytes``, under ring algorithms.

    With n = ``size`` ranks and B the bytes the call was given on this rank:

    - all-reduce (B = the whole buffer): reduce-scatter then all-gather, 2(n-1)/n x B;
    - reduce-scatter (B = the whole input): (n-1)/n x B; all-gather (B = this rank's piece,
      n x B the result): (n-1) x B, that is (n-1)/n of the full size;
    - broadcast (B = the buffer): pipelined along a chain, (n-1)/n x B per rank on average;
    - send: B; receive: 0 (counted on the sender); barrier: 0;
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
    if op in ("reduce_scatter", "broadcast", "bcast_object"):
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
    listener: Callable[[CallRecord], None] | None = None  # hears every call: a trace (hpcpar.dist.trace)

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


# ----------------------------------------------------------------------------------------
# Buffers: contiguity and host staging
# ----------------------------------------------------------------------------------------
def _require_contiguous(array, what: str) -> None:
    if not array.flags.c_contiguous:
        raise ValueError(
            f"{what}: the buffer must be C-contiguous (shape {array.shape}, strides {array.strides}); "
            "pass xp.ascontiguousarray(x) and read the result from the returned array")


@functools.lru_cache(maxsize=None)
def _is_bfloat16(dtype) -> bool:
    """bfloat16 (ml_dtypes on CPUs) has no MPI datatype: it moves as 16-bit words, reduces in float32.

    Cached: NumPy computes ``dtype.name`` anew each time, ~3 us, more than a small all-reduce.
    """
    return np.dtype(dtype).name == "bfloat16"


class HostStaging:
    """Host buffers for staging device buffers through an MPI that is not CUDA-aware, reused.

    A call takes a buffer at least as large as it needs from the free ones (the smallest that
    fits) and gives it back when it finishes; only when none fits is one allocated (pinned
    when CuPy is there: ``backend.pinned_empty``), rounded up to a power of two so that
    buckets of about the same size share buffers. Non-blocking calls in flight hold theirs,
    so DDP's overlapping buckets never share one. ``allocations``, ``reuses`` and
    ``bytes_allocated`` count what happened (the tests check that a second step allocates
    nothing).
    """

    def __init__(self):
        self._free: list[np.ndarray] = []
        self.allocations = 0
        self.reuses = 0
        self.bytes_allocated = 0

    def acquire(self, nbytes: int) -> np.ndarray:
        fitting = [i for i, b in enumerate(self._free) if b.nbytes >= nbytes]
        if fitting:
            self.reuses += 1
            return self._free.pop(min(fitting, key=lambda i: self._free[i].nbytes))
        size = 1 << max(12, (max(nbytes, 1) - 1).bit_length())
        self.allocations += 1
        self.bytes_allocated += size
        return pinned_empty(size)

    def release(self, buffer: np.ndarray) -> None:
        self._free.append(buffer)


class _Staged:
    """The buffer MPI actually touches for ``array``: the array itself, or a host copy.

    ``device`` is where results go back to on the GPU when staged; ``buffer`` is what MPI is
    handed (bfloat16 as raw 16-bit words: only data-movement calls see it, reductions of
    bfloat16 go through float32 in the Communicator). A staged buffer comes from the
    communicator's ``HostStaging`` and goes back to it in ``finish``, which every user calls
    once the call is complete (``copy_out=False``: a send buffer, nothing comes back).

    Before MPI or the staging copy reads device memory the whole device is synchronized, not
    only the current stream: CuPy arrays do not remember the stream that wrote them, so an
    event on "the producing stream" could only be recorded on the current one, and buffers
    here are also written on other streams (an NCCL communicator's stream when a pipeline's
    tied-weights or a parameter server's MPI communicator shares a buffer with it, a user's
    ``cupy.cuda.Stream``). hpcpar computes on one stream, so the device sync waits for the
    same work a stream sync would; it only costs more where other streams are busy, and
    those are exactly the cases a stream sync gets wrong.
    """

    def __init__(self, array, comm: "Communicator", copy_in: bool = True, copy_out: bool = True):
        self.device = array if is_gpu_array(array) else None
        self._pool, self._raw, self._copy_out = None, None, copy_out
        if self.device is None:
            self.host = array
            return
        synchronize(array)
        if comm.cuda_aware:
            self.host = array
            return
        self._pool = comm.staging
        self._raw = self._pool.acquire(array.nbytes)
        self.host = self._raw[:array.nbytes].view(array.dtype).reshape(array.shape)
        if copy_in:
            copy_to_host(array, self.host)

    @property
    def staged(self) -> bool:
        return self._raw is not None

    @property
    def buffer(self):
        return self.host.view(np.uint16) if _is_bfloat16(self.host.dtype) else self.host

    def finish(self):
        """Copy a staged result back to the device buffer, free the host buffer; return the user-visible array."""
        if self._raw is not None:
            if self._copy_out:
                copy_to_device(self.host, self.device)
            self._pool.release(self._raw)
            self._raw = None
            self.host = self.device
        return self.host if self.device is None else self.device


# ----------------------------------------------------------------------------------------
# Handles for non-blocking calls
# ----------------------------------------------------------------------------------------
class Handle:
    """A pending non-blocking call; ``wait()`` completes it and returns the result array."""

    def __init__(self, comm: "Communicator", op: str, request, finish, waiting: Waiting, keepalive=None,
                 nbytes: int = 0):
        self._comm, self._op, self._request, self._finish, self._waiting = comm, op, request, finish, waiting
        self._keepalive = keepalive
        self._nbytes = nbytes
        self._result = None
        self.done = False

    def test(self) -> bool:
        if not self.done and self._request.Test():
            self._complete()
        return self.done

    def wait(self):
        if not self.done:
            start = time.perf_counter()
            self._comm._wait(self._request, self._waiting)
            self._comm.stats.add_seconds(self._op, time.perf_counter() - start, peer=self._waiting.peer,
                                         tag=self._waiting.tag, nbytes=self._nbytes, start=start)
            self._complete()
        return self._result

    def _complete(self) -> None:
        self._result = self._finish()
        self._keepalive = None
        self.done = True


def wait_all(handles) -> list:
    return [h.wait() for h in handles]


# ----------------------------------------------------------------------------------------
# The communicator
# ----------------------------------------------------------------------------------------
class Communicator:
    """One MPI communicator with counted array collectives and point-to-point calls."""

    def __init__(self, mpi_comm: MPI.Comm, name: str = "world", *, cuda_aware: bool | None = None,
                 wait_policy: str = "spin", device_nonblocking: bool | None = None):
        if wait_policy not in WAIT_POLICIES:
            raise ValueError(f"wait_policy must be one of {WAIT_POLICIES}, got {wait_policy!r}")
        self.mpi = mpi_comm
        self.name = name
        self.rank = mpi_comm.Get_rank()
        self.size = mpi_comm.Get_size()
        self.cuda_aware = query_cuda_aware() if cuda_aware is None else cuda_aware
        # Device buffers in non-blocking collectives (DEVICE_NONBLOCKING); matters only when CUDA-aware.
        self.device_nonblocking = device_nonblocking_supported() if device_nonblocking is None else device_nonblocking
        self.staging = HostStaging()  # host buffers for device buffers when MPI is not CUDA-aware
        self.wait_policy = wait_policy
        self.stats = CommStats(size=self.size, name=name)
        self.watchdog = StallWatchdog.for_communicator(self)  # None: HPCPAR_STALL_S=0
        self.shm = None  # the shared-memory path (hpcpar.dist.shm), attached by hpcpar.init when on

    def __repr__(self) -> str:
        return f"Communicator({self.name}, rank {self.rank} of {self.size})"

    # ----- waiting ------------------------------------------------------------------
    def _wait(self, request, waiting: Waiting) -> None:
        if self.watchdog is not None:
            self.watchdog.wait(request, waiting, polite_pause if self.wait_policy == "yield" else None)
        elif self.wait_policy == "spin":
            request.Wait()
        else:
            wait_politely(request)

    def _blocking(self) -> bool:
        """Whether collectives may use MPI's blocking calls: spinning, and no watchdog to poll."""
        return self.wait_policy == "spin" and self.watchdog is None

    def _device_blocking(self, *arrays) -> bool:
        """Whether these buffers go to MPI as device pointers that only its blocking collectives
        take (a CUDA-aware library not known to take them in non-blocking ones): then the call is
        blocking and the watchdog cannot poll it."""
        return self.cuda_aware and not self.device_nonblocking and any(is_gpu_array(a) for a in arrays)

    def _collective(self, op: str, arrays, blocking, nonblocking, library_path: bool = False) -> None:
        """Run ``blocking()`` or wait for the request ``nonblocking()`` starts (counted as collective #k).

        ``library_path``: the blocking call is also what a spinning rank without a watchdog uses.
        """
        waiting = self._next_collective(op)
        if self._device_blocking(*arrays) or (library_path and self._blocking()):
            blocking()
        else:
            self._wait(nonblocking(), waiting)

    def _next_collective(self, op: str) -> Waiting:
        return self.watchdog.next_collective(op) if self.watchdog is not None else Waiting.collective(op, -1)

    def barrier(self) -> None:
        start = time.perf_counter()
        waiting = self._next_collective("barrier")
        if self._blocking():
            self.mpi.Barrier()
        else:
            self._wait(self.mpi.Ibarrier(), waiting)
        self.stats.add("barrier", 0, time.perf_counter() - start, start=start)

    # ----- collectives --------------------------------------------------------------
    def allreduce(self, x, op: str = "sum", out=None):
        """Reduce ``x`` over all ranks; ``out=x`` reduces in place. ``mean`` divides by size."""
        if _is_bfloat16(x.dtype):
            return _into(out, self.allreduce(x.astype(np.float32), op).astype(x.dtype))
        if self.shm is not None and (result := self.shm.allreduce(x, op, out)) is not None:
            return result
        start = time.perf_counter()
        staged, finish = self._prepare_allreduce("allreduce", x, op, out)
        # Spinning without a watchdog: the library's blocking path, what raw MPI users time.
        self._collective("allreduce", [staged.buffer],
                         lambda: self.mpi.Allreduce(MPI.IN_PLACE, staged.buffer, REDUCE_OPS[op]),
                         lambda: self.mpi.Iallreduce(MPI.IN_PLACE, staged.buffer, REDUCE_OPS[op]), library_path=True)
        result = finish()
        self.stats.add("allreduce", x.nbytes, time.perf_counter() - start, start=start)
        return result

    def iallreduce(self, x, op: str = "sum", out=None) -> Handle:
        """Start an all-reduce; the returned handle's ``wait()`` gives the result."""
        if _is_bfloat16(x.dtype):
            handle = self.iallreduce(x.astype(np.float32), op)
            inner = handle._finish
            handle._finish = lambda: _into(out, inner().astype(x.dtype))
            return handle
        if self.shm is not None and (handle := self.shm.iallreduce(x, op, out)) is not None:
            return handle
        start = time.perf_counter()
        staged, finish = self._prepare_allreduce("iallreduce", x, op, out)
        if self._device_blocking(staged.buffer):  # done now: the library takes device buffers only in Allreduce
            self.mpi.Allreduce(MPI.IN_PLACE, staged.buffer, REDUCE_OPS[op])
            request = MPI.REQUEST_NULL
        else:
            request = self.mpi.Iallreduce(MPI.IN_PLACE, staged.buffer, REDUCE_OPS[op])
        self.stats.add("iallreduce", x.nbytes, time.perf_counter() - start, start=start)
        return Handle(self, "iallreduce", request, finish, self._next_collective("iallreduce"), nbytes=x.nbytes)

    def _prepare_allreduce(self, name: str, x, op: str, out):
        """Check, copy ``x`` into ``out`` (unless in place) and stage it; return (staged, finish)."""
        check_allreduce_args(name, x, op, out)
        debug.check_collective(self, name, x)
        if out is None:
            out = get_array_module(x).empty(x.shape, dtype=x.dtype)
        if out is not x:
            out[...] = x
        staged = _Staged(out, self)

        def finish():
            result = staged.finish()
            if op == "mean":
                result /= self.size
            return result

        return staged, finish

    def reduce_scatter(self, x, op: str = "sum"):
        """Reduce ``x`` (first axis divisible by size) and return this rank's 1/size block of rows."""
        mpi_op = _reduce_op(op)
        if _is_bfloat16(x.dtype):
            return self.reduce_scatter(x.astype(np.float32), op).astype(x.dtype)
        debug.check_collective(self, "reduce_scatter", x)
        if x.shape[0] % self.size:
            raise ValueError(f"reduce_scatter: first axis {x.shape[0]} is not divisible by {self.size} ranks")
        if self.shm is not None and (result := self.shm.reduce_scatter(x, op)) is not None:
            return result
        start = time.perf_counter()
        xp = get_array_module(x)
        x = x if x.flags.c_contiguous else xp.ascontiguousarray(x)
        out = xp.empty((x.shape[0] // self.size,) + x.shape[1:], dtype=x.dtype)
        send, recv = _Staged(x, self, copy_out=False), _Staged(out, self, copy_in=False)
        self._collective("reduce_scatter", [send.buffer, recv.buffer],
                         lambda: self.mpi.Reduce_scatter_block(send.buffer, recv.buffer, mpi_op),
                         lambda: self.mpi.Ireduce_scatter_block(send.buffer, recv.buffer, mpi_op))
        send.finish()
        result = recv.finish()
        if op == "mean":
            result /= self.size
        self.stats.add("reduce_scatter", x.nbytes, time.perf_counter() - start, start=start)
        return result

    def allgather(self, x, out=None):
        """Concatenate every rank's ``x`` (same shape everywhere) along a new first axis.

        ``out``: a C-contiguous array of ``size * x.size`` elements of x's dtype (any shape)
        to receive the result, e.g. a flat buffer the blocks belong in; returned.
        """
        xp = get_array_module(x)
        x = x if x.flags.c_contiguous else xp.ascontiguousarray(x)
        if out is not None:
            if out.size != self.size * x.size or out.dtype != x.dtype:
                raise ValueError(f"allgather: out has {out.size} {out.dtype}, needs {self.size} x {x.size} {x.dtype}")
            _require_contiguous(out, "allgather")
            if self.shm is not None and self.shm.allgather(x, out) is not None:
                return out
        debug.check_collective(self, "allgather", x)
        start = time.perf_counter()
        out = xp.empty((self.size,) + x.shape, dtype=x.dtype) if out is None else out
        send, recv = _Staged(x, self, copy_out=False), _Staged(out, self, copy_in=False)
        self._collective("allgather", [send.buffer, recv.buffer], lambda: self.mpi.Allgather(send.buffer, recv.buffer),
                         lambda: self.mpi.Iallgather(send.buffer, recv.buffer))
        send.finish()
        result = recv.finish()
        self.stats.add("allgather", x.nbytes, time.perf_counter() - start, start=start)
        return result

    def broadcast(self, x, root: int = 0):
        """Overwrite ``x`` on every rank with root's ``x``, in place; returns ``x``."""
        debug.check_collective(self, "broadcast", x)
        _require_contiguous(x, "broadcast")
        start = time.perf_counter()
        staged = _Staged(x, self, copy_in=self.rank == root, copy_out=self.rank != root)
        self._collective("broadcast", [staged.buffer], lambda: self.mpi.Bcast(staged.buffer, root=root),
                         lambda: self.mpi.Ibcast(staged.buffer, root=root))
        staged.finish()
        self.stats.add("broadcast", x.nbytes, time.perf_counter() - start, start=start)
        return x

    # ----- point-to-point -----------------------------------------------------------
    def send(self, x, dest: int, tag: int = 0) -> None:
        self.isend(x, dest, tag, _op_name="send").wait()

    def recv(self, buf, source: int, tag: int = 0):
        """Receive into the preallocated ``buf`` (shape and dtype agreed ahead); returns it."""
        return self.irecv(buf, source, tag, _op_name="recv").wait()

    def isend(self, x, dest: int, tag: int = 0, *, _op_name: str = "isend") -> Handle:
        start = time.perf_counter()
        x = x if x.flags.c_contiguous else get_array_module(x).ascontiguousarray(x)
        staged = _Staged(x, self, copy_out=False)
        request = self.mpi.Isend(staged.buffer, dest=dest, tag=tag)
        self.stats.add(_op_name, x.nbytes, time.perf_counter() - start, start=start, peer=dest, tag=tag)
        # The staged host copy must outlive the request: finish hands it back once the send is complete.
        return Handle(self, _op_name, request, staged.finish, Waiting.point_to_point(_op_name, dest, tag),
                      keepalive=staged, nbytes=x.nbytes)

    def irecv(self, buf, source: int, tag: int = 0, *, _op_name: str = "irecv") -> Handle:
        _require_contiguous(buf, _op_name)
        start = time.perf_counter()
        staged = _Staged(buf, self, copy_in=False)
        request = self.mpi.Irecv(staged.buffer, source=source, tag=tag)
        self.stats.add(_op_name, buf.nbytes, time.perf_counter() - start, start=start, peer=source, tag=tag)
        return Handle(self, _op_name, request, staged.finish, Waiting.point_to_point(_op_name, source, tag),
                      nbytes=buf.nbytes)

    # ----- pickled Python objects (separate names: never the array path) -------------
    def bcast_object(self, obj, root: int = 0):
        return self._object_call("bcast_object", obj, lambda: self.mpi.bcast(obj, root=root), wire_of_result=True)

    def allgather_object(self, obj) -> list:
        return self._object_call("allgather_object", obj, lambda: self.mpi.allgather(obj))

    def gather_object(self, obj, root: int = 0):
        return self._object_call("gather_object", obj, lambda: self.mpi.gather(obj, root=root),
                                 sends=self.rank != root)

    def allreduce_object(self, obj, op: str = "sum"):
        return self._object_call("allreduce_object", obj, lambda: self.mpi.allreduce(obj, op=_reduce_op(op)))

    def send_object(self, obj, dest: int, tag: int = 0) -> None:
        self._object_call("send_object", obj, lambda: self.mpi.send(obj, dest=dest, tag=tag), peer=dest, tag=tag)

    def recv_object(self, source: int, tag: int = 0):
        return self._object_call("recv_object", None, lambda: self.mpi.recv(source=source, tag=tag), peer=source,
                                 tag=tag)

    def _object_call(self, op: str, obj, call, *, wire_of_result: bool = False, sends: bool = True, peer: int = -1,
                     tag: int = -1):
        """Run ``call``; count ``obj``'s pickled size (a broadcast's wire bytes from the root's object)."""
        start = time.perf_counter()
        result = call()
        nbytes = len(pickle.dumps(obj)) if obj is not None else 0
        wire = ring_wire_bytes(op, len(pickle.dumps(result)) if wire_of_result else nbytes, self.size) if sends else 0
        self.stats.add(op, nbytes, time.perf_counter() - start, start=start, wire=wire, peer=peer, tag=tag)
        return result

    # ----- structure ----------------------------------------------------------------
    def split(self, color: int, key: int, name: str) -> "Communicator":
        return self.like(self.mpi.Split(color, key), name)

    def like(self, mpi_comm: MPI.Comm, name: str) -> "Communicator":
        """A communicator of the same kind and settings over ``mpi_comm`` (NCCL stays NCCL)."""
        return Communicator(mpi_comm, name, cuda_aware=self.cuda_aware, wait_policy=self.wait_policy,
                            device_nonblocking=self.device_nonblocking)


def check_allreduce_args(name: str, x, op: str, out) -> None:
    """The checks every all-reduce path makes: a known op, and ``out`` (if given) like ``x`` and C-contiguous."""
    _reduce_op(op)
    if out is not None:
        if out.shape != x.shape or out.dtype != x.dtype:
            raise ValueError(f"{name}: out has shape {out.shape} {out.dtype}, x has {x.shape} {x.dtype}")
        _require_contiguous(out, name)


def _into(out, result):
    """``result`` written into ``out`` when one was given (the in-place contract), else itself."""
    if out is None:
        return result
    out[...] = result
    return out


def _reduce_op(op: str):
    try:
        return REDUCE_OPS[op]
    except KeyError:
        raise ValueError(f"reduce op must be one of {sorted(REDUCE_OPS)}, got {op!r}") from None
