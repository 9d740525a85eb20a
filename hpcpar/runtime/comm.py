"""Array communication on NumPy and CuPy buffers, with every call counted.

A ``Communicator`` wraps one mpi4py communicator. Array calls take NumPy or CuPy arrays:
CuPy buffers go straight to MPI when the MPI library is CUDA-aware (after a device
synchronize, since MPI reads device memory outside CuPy's stream order; in blocking
collectives unless the library is known to take device buffers in non-blocking ones:
``DEVICE_NONBLOCKING``) and are staged through reused host buffers otherwise
(``HostStaging``; both in ``device_transport.py``); ``hpcpar.runtime.nccl`` has the same API
over NCCL. Calls that move pickled Python objects have their own names (``*_object``) so they
are never mistaken for the array path.

Every call adds to ``comm.stats`` (``stats.py``: calls, the bytes it was given, the bytes this
rank sends on the wire under ring algorithms, seconds), so the layers above can report a communication share
and the traffic, and tests can assert exact counts.
"""
from __future__ import annotations

import itertools
import math
import os
import pickle
import time

import numpy as np
from mpi4py import MPI

from .. import host
from ..backend import get_array_module, is_gpu_array
from . import debug
from .device_transport import (HostStaging, _is_bfloat16, _require_contiguous, _Staged, device_nonblocking_supported,
                               query_cuda_aware)
from .stats import CommStats, ring_wire_bytes
from .waiting import polite_pause, wait_politely
from .watchdog import StallWatchdog, Waiting

REDUCE_OPS = {"sum": MPI.SUM, "mean": MPI.SUM, "max": MPI.MAX, "min": MPI.MIN}
WAIT_POLICIES = ("spin", "yield")


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

    def test(self, start_queued: bool = True) -> bool:
        """Whether the call has completed (then its result is ready). ``start_queued=False`` only
        looks: a call an NCCL communicator still holds in its queue (issued with the next group)
        reads as not done rather than being issued alone, which would split the group."""
        if self.done or (not start_queued and not getattr(self._request, "issued", True)):
            return self.done
        if self._request.Test():
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
        self.shm = None  # the shared-memory path (hpcpar.runtime.shm), attached by hpcpar.init when on

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
        if _is_bfloat16(x.dtype):  # MPI has no bfloat16: reduced as a float32 copy, in place
            wide = x.astype(np.float32)
            self.allreduce(wide, op, out=wide)
            return _narrowed(wide, x.dtype, out)
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
        if _is_bfloat16(x.dtype):  # as in allreduce: one float32 copy in flight per call
            wide = x.astype(np.float32)
            handle = self.iallreduce(wide, op, out=wide)
            inner = handle._finish
            handle._finish = lambda: _narrowed(inner(), x.dtype, out)
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

    def ireduce_scatter(self, x, counts, out, op: str = "sum") -> Handle:
        """Start reducing the flat ``x`` and scattering it in consecutive pieces of ``counts[r]``
        elements to rank r (uneven, some may be 0); ``out`` (``counts[self.rank]`` elements,
        C-contiguous) receives this rank's piece. The handle's ``wait()`` returns ``out``."""
        mpi_op = _reduce_op(op)
        counts = [int(c) for c in counts]
        if _is_bfloat16(x.dtype) or len(counts) != self.size or sum(counts) != x.size or out.size != counts[self.rank]:
            raise ValueError(f"ireduce_scatter: {x.size} {x.dtype} elements cannot go out as {counts} over "
                             f"{self.size} ranks into {out.size}")
        _require_contiguous(x, "ireduce_scatter")
        _require_contiguous(out, "ireduce_scatter")
        debug.check_collective(self, "ireduce_scatter", x)
        start = time.perf_counter()
        send, recv = _Staged(x, self, copy_out=False), _Staged(out, self, copy_in=False)
        if self._device_blocking(send.buffer, recv.buffer):
            self.mpi.Reduce_scatter(send.buffer, recv.buffer, counts, mpi_op)
            request = MPI.REQUEST_NULL
        else:
            request = self.mpi.Ireduce_scatter(send.buffer, recv.buffer, counts, mpi_op)

        def finish():
            send.finish()
            result = recv.finish()
            if op == "mean":
                result /= self.size
            return result

        self.stats.add("ireduce_scatter", x.nbytes, time.perf_counter() - start, start=start)
        return Handle(self, "ireduce_scatter", request, finish, self._next_collective("ireduce_scatter"),
                      keepalive=send, nbytes=x.nbytes)

    def iallgather(self, x, counts, out, label: str = "") -> Handle:
        """Start gathering every rank's flat ``x`` (``counts[r]`` elements on rank r, uneven, some
        may be 0) into consecutive pieces of the C-contiguous ``out`` of their sum (ZeRO-3's unit:
        ``parallel.zero_params``); ``label`` names the call in ``HPCPAR_DEBUG``'s check, which
        compares ``out``'s shape (the same on every rank). The handle's ``wait()`` returns ``out``."""
        counts = [int(c) for c in counts]
        if len(counts) != self.size or sum(counts) != out.size or x.size != counts[self.rank] or x.dtype != out.dtype:
            raise ValueError(f"iallgather: {x.size} {x.dtype} elements on rank {self.rank} cannot gather as {counts} "
                             f"into {out.size} {out.dtype}")
        _require_contiguous(x, "iallgather")
        _require_contiguous(out, "iallgather")
        debug.check_collective(self, f"iallgather {label}".rstrip(), out)
        start = time.perf_counter()
        send, recv = _Staged(x, self, copy_out=False), _Staged(out, self, copy_in=False)
        displacements = [0, *itertools.accumulate(counts)][:-1]
        receive = [recv.buffer, (counts, displacements)]
        if self._device_blocking(send.buffer, recv.buffer):
            self.mpi.Allgatherv(send.buffer, receive)
            request = MPI.REQUEST_NULL
        else:
            request = self.mpi.Iallgatherv(send.buffer, receive)
        # Counted by the gathered size (every rank's the same), as a reduce-scatter by its input.
        self.stats.add("iallgather", out.nbytes, time.perf_counter() - start, start=start)
        def finish():
            send.finish()
            return recv.finish()

        return Handle(self, "iallgather", request, finish, self._next_collective("iallgather"), keepalive=send,
                      nbytes=out.nbytes)

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

    def alltoall(self, x):
        """Block r of ``x`` (first axis: size blocks of equal rows) to rank r; returns the blocks
        received, in rank order (the counts a variable all-to-all exchanges first). Counted by the
        bytes given; the wire bytes are the blocks that leave this rank, (n-1)/n of them."""
        if x.shape[0] % self.size:
            raise ValueError(f"alltoall: first axis {x.shape[0]} is not divisible by {self.size} ranks")
        xp = get_array_module(x)
        x = x if x.flags.c_contiguous else xp.ascontiguousarray(x)
        debug.check_collective(self, "alltoall", x)
        start = time.perf_counter()
        out = xp.empty_like(x)
        send, recv = _Staged(x, self, copy_out=False), _Staged(out, self, copy_in=False)
        self._collective("alltoall", [send.buffer, recv.buffer], lambda: self.mpi.Alltoall(send.buffer, recv.buffer),
                         lambda: self.mpi.Ialltoall(send.buffer, recv.buffer))
        send.finish()
        result = recv.finish()
        self.stats.add("alltoall", x.nbytes, time.perf_counter() - start,
                       wire=x.nbytes // self.size * (self.size - 1), start=start)
        return result

    def alltoallv(self, x, send_rows, recv_rows):
        """Rows of ``x`` to each rank: the first ``send_rows[0]`` to rank 0, the next ``send_rows[1]``
        to rank 1, ...; returns the ``sum(recv_rows)`` rows received, rank 0's first (expert
        parallelism's dispatch and combine: ``autograd.ops.experts``). The counts must agree with
        the peers' (``alltoall`` them first). Counted by the bytes given; the wire bytes are those
        sent to other ranks, exactly."""
        if _is_bfloat16(x.dtype):  # MPI has no bfloat16: moved as its 16-bit patterns (nothing is summed)
            return self.alltoallv(x.view(np.uint16), send_rows, recv_rows).view(x.dtype)
        send_rows, recv_rows = [int(c) for c in send_rows], [int(c) for c in recv_rows]
        if len(send_rows) != self.size or len(recv_rows) != self.size or sum(send_rows) != x.shape[0]:
            raise ValueError(f"alltoallv: {x.shape[0]} rows cannot go out as {send_rows} (receiving {recv_rows}) "
                             f"over {self.size} ranks")
        xp = get_array_module(x)
        x = x if x.flags.c_contiguous else xp.ascontiguousarray(x)
        row = math.prod(x.shape[1:])
        out = xp.empty((sum(recv_rows),) + x.shape[1:], dtype=x.dtype)
        start = time.perf_counter()
        send, recv = _Staged(x, self, copy_out=False), _Staged(out, self, copy_in=False)
        sent = [(send.buffer, ([c * row for c in send_rows], _starts(send_rows, row))),
                (recv.buffer, ([c * row for c in recv_rows], _starts(recv_rows, row)))]
        self._collective("alltoallv", [send.buffer, recv.buffer], lambda: self.mpi.Alltoallv(*sent),
                         lambda: self.mpi.Ialltoallv(*sent))
        send.finish()
        result = recv.finish()
        others = (sum(send_rows) - send_rows[self.rank]) * row * x.itemsize
        self.stats.add("alltoallv", x.nbytes, time.perf_counter() - start, wire=others, start=start)
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
    def split(self, color: int | None, key: int, name: str) -> "Communicator | None":
        """A communicator of this kind over the ranks that pass the same ``color``, ordered by
        ``key`` (collective over this one); None on a rank whose ``color`` is None (MPI's
        UNDEFINED: the rank joins no group). Nothing frees it by itself: the caller closes it,
        or hands it to the context it was derived from (``ParallelContext.adopt``)."""
        sub = self.mpi.Split(MPI.UNDEFINED if color is None else color, key)
        return None if sub == MPI.COMM_NULL else self.like(sub, name)

    def dup(self, name: str) -> "Communicator":
        """A communicator of this kind over the same ranks whose messages never match this one's
        (collective); freed like ``split``'s."""
        return self.like(self.mpi.Dup(), name)

    def close(self) -> None:
        """Free the MPI communicator and its shared-memory state (collective over its ranks),
        for one this program made (``split``, ``dup``, ``hpcpar.init``): never the world it was
        given. It must no longer be used; a second call does nothing."""
        if self.shm is not None:
            self.shm.close()
        if self.mpi != MPI.COMM_NULL:
            self.mpi.Free()  # mpi4py sets the handle to COMM_NULL

    def like(self, mpi_comm: MPI.Comm, name: str) -> "Communicator":
        """A communicator of the same kind and settings over ``mpi_comm`` (NCCL stays NCCL)."""
        return Communicator(mpi_comm, name, cuda_aware=self.cuda_aware, wait_policy=self.wait_policy,
                            device_nonblocking=self.device_nonblocking)


def _starts(counts, row: int) -> list[int]:
    """Element offsets of consecutive pieces of ``counts`` rows of ``row`` elements each."""
    return [0, *itertools.accumulate(c * row for c in counts)][:-1]


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


def _narrowed(wide, dtype, out):
    """A float32 result back in ``dtype``: cast into ``out`` when one was given, else a new array."""
    return wide.astype(dtype) if out is None else _into(out, wide)


def _reduce_op(op: str):
    try:
        return REDUCE_OPS[op]
    except KeyError:
        raise ValueError(f"reduce op must be one of {sorted(REDUCE_OPS)}, got {op!r}") from None
