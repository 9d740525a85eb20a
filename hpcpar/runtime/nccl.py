"""The Communicator API on device buffers over NVIDIA's NCCL (through CuPy's ``cupy.cuda.nccl``).

``NcclCommunicator`` is a ``Communicator`` (same calls, same ``CommStats`` counters, same
watchdog and wait policy, same fail-fast) whose array calls on device buffers go to NCCL;
host (NumPy) buffers, barriers and the pickled ``*_object`` calls stay on MPI. Every NCCL call
runs on the communicator's own stream, ordered against the caller's stream by events, never by
a device-wide sync; ``isend`` and ``irecv`` are queued and issued together as one NCCL group.
docs/gpu.md ("The NCCL communicator") gives the bootstrap, the streams and events, blocking and
non-blocking calls, point-to-point matching by order, and the dtypes.

What CuPy provides is reached through a ``DeviceRuntime``; ``cupy_runtime()`` builds the real
one and the tests pass a double (an NCCL over MPI on the transfer guard's device arrays that
checks every buffer's stream order, ``tests/nccl_double.py``).
"""
from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from .. import backend
from . import debug
from .comm import Communicator, Handle, Waiting, _into, _reduce_op, check_allreduce_args
from .device_transport import _require_contiguous

BACKENDS = ("auto", "mpi", "nccl")

# dtype name -> the NCCL constant's name in cupy.cuda.nccl (bfloat16 only where the module has it)
NCCL_DTYPES = {"int8": "NCCL_INT8", "uint8": "NCCL_UINT8", "int32": "NCCL_INT32", "uint32": "NCCL_UINT32",
               "int64": "NCCL_INT64", "uint64": "NCCL_UINT64", "float16": "NCCL_FLOAT16",
               "bfloat16": "NCCL_BFLOAT16", "float32": "NCCL_FLOAT32", "float64": "NCCL_FLOAT64"}
# "mean" sums and divides afterwards on the consumer's stream, as the MPI path does (NCCL_AVG
# needs NCCL 2.10 and would round differently from the MPI communicator).
NCCL_OPS = {"sum": "NCCL_SUM", "mean": "NCCL_SUM", "max": "NCCL_MAX", "min": "NCCL_MIN"}


@dataclass(frozen=True)
class DeviceRuntime:
    """What the NCCL communicator needs from CuPy (``cupy_runtime``) or from a test double."""

    nccl: Any  # get_unique_id(), groupStart(), groupEnd(), the NCCL_* constants
    connect: Callable  # (size, unique_id, rank, mpi_comm) -> an object with NcclCommunicator's calls
    stream: Callable  # () -> a new non-blocking stream (synchronize, wait_event)
    event: Callable  # () -> a new event (record(stream), synchronize(), done)
    current_stream: Callable  # () -> the stream work is being enqueued on
    is_device: Callable  # array -> bool
    pointer: Callable = lambda array: array.data.ptr  # what NCCL's calls take for a buffer
    handle: Callable = lambda stream: stream.ptr  # what NCCL's calls take for a stream


def _cupy_nccl():
    """``cupy.cuda.nccl`` when CuPy sees a GPU and was built with NCCL, else None."""
    cupy = backend.cupy_module()
    if cupy is None or backend.gpu_count() == 0:
        return None
    try:
        from cupy.cuda import nccl

        if not getattr(nccl, "available", True):  # CuPy built without NCCL exposes a stub
            return None
        nccl.get_version()  # loads libnccl: a missing or broken library fails here, not in the first call
    except Exception:  # noqa: BLE001 - ImportError, a missing libnccl, CUDA errors: no NCCL
        return None
    return nccl


def nccl_available() -> bool:
    return _cupy_nccl() is not None


def cupy_runtime() -> DeviceRuntime:
    """The real runtime: CuPy's streams and events, NCCL through ``cupy.cuda.nccl``."""
    nccl = _cupy_nccl()
    if nccl is None:
        raise backend.DeviceError("parallel.backend = \"nccl\" needs a GPU and a CuPy built with NCCL "
                           "(pip install 'cupy-cuda12x' and NCCL: python -m cupyx.tools.install_library "
                           "--library nccl --cuda 12.x); or use parallel.backend = \"mpi\"")
    cupy = backend.cupy_module()
    return DeviceRuntime(
        nccl=nccl,
        connect=lambda size, unique_id, rank, mpi_comm: nccl.NcclCommunicator(size, unique_id, rank),
        stream=lambda: cupy.cuda.Stream(non_blocking=True),
        event=lambda: cupy.cuda.Event(disable_timing=True),
        current_stream=cupy.cuda.get_current_stream,
        is_device=backend.is_gpu_array,
    )


def choose_backend(requested: str, device: str, cuda_aware: bool, have_nccl: bool | None = None,
                   ranks_per_node: int | None = None, gpus: int | None = None) -> str:
    """``nccl`` or ``mpi`` for ``parallel.backend = requested`` on ``device``.

    ``auto``: NCCL on GPUs when CuPy has it and each of the node's ``ranks_per_node`` ranks has
    a GPU of its own among its ``gpus`` (NCCL refuses two ranks on one GPU), else MPI (CUDA-aware
    when the library is, else with host staging; ``describe_backend`` says which;
    ``shared_gpus`` why). ``nccl`` without a GPU, without CuPy's NCCL or on shared GPUs is an
    error naming the fix.
    """
    if requested not in BACKENDS:
        raise ValueError(f"parallel.backend must be one of {BACKENDS}, got {requested!r}")
    have_nccl = nccl_available() if have_nccl is None else have_nccl
    on_device = device in ("cuda", "guard")  # guard: the CuPy path on CPUs (hpcpar.guard), with an NCCL double
    sharing = shared_gpus(ranks_per_node, gpus) if device == "cuda" else None
    if requested == "nccl":
        if not on_device:
            raise backend.DeviceError("parallel.backend = \"nccl\" needs train.device = \"cuda\" (NCCL moves GPU "
                                      "buffers only); use parallel.backend = \"auto\" or \"mpi\" on CPUs")
        if sharing:
            raise backend.DeviceError(f"parallel.backend = \"nccl\" needs a GPU per rank, but {sharing}; launch at "
                                      f"most {gpus} ranks per node, or use parallel.backend = \"auto\" or \"mpi\"")
        if not have_nccl:
            cupy_runtime()  # raises the message naming the fix
        return "nccl"
    if requested == "auto" and on_device and have_nccl and not sharing:
        return "nccl"
    return "mpi"


def shared_gpus(ranks_per_node: int | None, gpus: int | None) -> str | None:
    """Why a node's ranks share GPUs ("4 ranks on this node share 2 GPUs"), or None when each has its own."""
    if not ranks_per_node or not gpus or ranks_per_node <= gpus:
        return None
    return f"{ranks_per_node} ranks on this node share {gpus} GPU{'s' if gpus > 1 else ''}"


def describe_backend(comm: Communicator, device: str) -> str:
    """One line for ``hpcpar info``: what moves this communicator's buffers."""
    if isinstance(comm, NcclCommunicator):
        return "NCCL (own stream, events)"
    if device != "cuda":
        return "MPI"
    if comm.cuda_aware:
        mode = "non-blocking" if comm.device_nonblocking else "blocking"
        return f"CUDA-aware MPI ({mode} collectives on device buffers)"
    return "MPI, device buffers staged through pinned host buffers"


class _EventRequest:
    """The NCCL calls behind a handle, polled like an MPI request (``Test``/``Wait``).

    Point-to-point calls are queued until the communicator issues them as one group: the first
    test or wait of any of their handles issues the queue.
    """

    def __init__(self, comm: "NcclCommunicator", done=None):
        self._comm, self.done = comm, done

    @property
    def issued(self) -> bool:
        return self.done is not None

    def _issue(self) -> None:
        if self.done is None:
            self._comm._flush()

    def Test(self) -> bool:  # noqa: N802 - mpi4py's name
        self._issue()
        return bool(self.done.done)

    def Wait(self) -> None:  # noqa: N802 - mpi4py's name
        """Spin until the event has completed (the spin policy; ``yield`` polls ``Test`` politely).

        Polled, not ``event.synchronize()``: the host learns the call is done, and the consumer is
        still ordered after it by the event it waits on (``_hand_over``), never by this wait."""
        while not self.Test():
            pass


@dataclass
class _Queued:
    """An isend or irecv waiting for its group: the call, and the event of its producer."""

    kind: str  # "send" or "recv"
    array: Any
    peer: int
    ready: Any  # event recorded on the producing stream at the call
    request: _EventRequest


class NcclCommunicator(Communicator):
    """A Communicator whose array calls on device buffers run on NCCL (docs/gpu.md, "The NCCL communicator")."""

    def __init__(self, mpi_comm, name: str = "world", *, runtime: DeviceRuntime, cuda_aware: bool | None = None,
                 wait_policy: str = "spin", device_nonblocking: bool | None = None):
        super().__init__(mpi_comm, name, cuda_aware=cuda_aware, wait_policy=wait_policy,
                         device_nonblocking=device_nonblocking)
        self.runtime = runtime
        self.stream = runtime.stream()
        unique_id = runtime.nccl.get_unique_id() if self.rank == 0 else None
        unique_id = self.mpi.bcast(unique_id, root=0)  # the bootstrap: not an hpcpar call, not counted
        self.nccl = runtime.connect(self.size, unique_id, self.rank, self.mpi)
        self._queue: list[_Queued] = []

    def __repr__(self) -> str:
        return f"NcclCommunicator({self.name}, rank {self.rank} of {self.size})"

    def close(self) -> None:
        """Destroy the NCCL communicator (its connections and device buffers: each layout of
        ``hpcpar compare`` builds its own), then free the MPI side; collective, a second call does
        nothing. What is still queued goes out first, and its end is waited for as any call's
        (watchdog, wait policy), so destroying never waits on work a peer will not match."""
        if self.nccl is not None:
            self._flush()
            done = self.runtime.event()
            done.record(self.stream)
            self._wait(_EventRequest(self, done), self._next_collective("close"))
            self.nccl.destroy()
            self.nccl = None
        super().close()

    # ----- streams and events --------------------------------------------------------
    def _after_producer(self):
        """The communication stream waits for the work enqueued so far on the current stream."""
        ready = self.runtime.event()
        ready.record(self.runtime.current_stream())
        return ready

    def _run(self, call):
        """Run ``call(stream handle)`` on the communication stream after the producer; return its event."""
        self._flush()
        self.stream.wait_event(self._after_producer())
        call(self.runtime.handle(self.stream))
        done = self.runtime.event()
        done.record(self.stream)
        return done

    def _hand_over(self, done) -> None:
        """The consumer's stream waits for the communication before it touches the result."""
        self.runtime.current_stream().wait_event(done)

    def _complete(self, op: str, done, start: float, nbytes: int) -> None:
        """A blocking call: wait on the host (watchdog, wait policy), order the consumer, count it."""
        self._wait(_EventRequest(self, done), self._next_collective(op))
        self._hand_over(done)
        self.stats.add(op, nbytes, time.perf_counter() - start, start=start)

    def _dtype(self, array):
        name = NCCL_DTYPES.get(np.dtype(array.dtype).name)
        code = getattr(self.runtime.nccl, name, None) if name else None
        if code is None:
            raise TypeError(f"{self.name}: NCCL cannot move {array.dtype} buffers (known: {', '.join(NCCL_DTYPES)})")
        return code

    def _native(self, array) -> bool:
        """Whether NCCL takes ``array`` as it is: on the device, in a dtype this NCCL has."""
        if not self.runtime.is_device(array):
            return False
        name = NCCL_DTYPES.get(np.dtype(array.dtype).name)
        return name is not None and hasattr(self.runtime.nccl, name)

    def _op(self, op: str):
        _reduce_op(op)
        return getattr(self.runtime.nccl, NCCL_OPS[op])

    # ----- collectives --------------------------------------------------------------
    def allreduce(self, x, op: str = "sum", out=None):
        if not self.runtime.is_device(x):
            return super().allreduce(x, op, out)
        handle = self._start_allreduce("allreduce", x, op, out)
        return handle.wait()

    def iallreduce(self, x, op: str = "sum", out=None) -> Handle:
        if not self.runtime.is_device(x):
            return super().iallreduce(x, op, out)
        return self._start_allreduce("iallreduce", x, op, out)

    def _start_allreduce(self, name: str, x, op: str, out) -> Handle:
        """Enqueue the all-reduce (widened to float32 where this NCCL lacks the dtype); a handle."""
        if not self._native(x):
            wide = x.astype(np.float32)
            inner = self._start_allreduce(name, wide, op, None)
            return _then(inner, lambda result: _into(out, result.astype(x.dtype)))
        check_allreduce_args(name, x, op, out)
        self._flush()  # a peer may need a queued send before it joins the check
        debug.check_collective(self, name, x)
        start = time.perf_counter()
        xp = backend.get_array_module(x)
        x = x if x.flags.c_contiguous else xp.ascontiguousarray(x)  # NCCL reads x.size elements from the pointer
        out = xp.empty(x.shape, dtype=x.dtype) if out is None else out
        nccl_op, dtype, pointer = self._op(op), self._dtype(x), self.runtime.pointer
        done = self._run(lambda stream: self.nccl.allReduce(pointer(x), pointer(out), x.size, dtype, nccl_op, stream))
        waiting = self._next_collective(name)

        def finish():
            self._hand_over(done)
            if op == "mean":
                out[...] /= self.size
            return out

        if name == "iallreduce":
            self.stats.add(name, x.nbytes, time.perf_counter() - start, start=start)
            return Handle(self, name, _EventRequest(self, done), finish, waiting, keepalive=x, nbytes=x.nbytes)
        self._wait(_EventRequest(self, done), waiting)
        result = finish()
        self.stats.add(name, x.nbytes, time.perf_counter() - start, start=start)
        return _Done(result)

    def reduce_scatter(self, x, op: str = "sum"):
        if not self._native(x):
            if self.runtime.is_device(x):
                return self.reduce_scatter(x.astype(np.float32), op).astype(x.dtype)
            return super().reduce_scatter(x, op)
        self._flush()  # a peer may need a queued send before it joins the check
        debug.check_collective(self, "reduce_scatter", x)
        if x.shape[0] % self.size:
            raise ValueError(f"reduce_scatter: first axis {x.shape[0]} is not divisible by {self.size} ranks")
        start = time.perf_counter()
        xp = backend.get_array_module(x)
        x = x if x.flags.c_contiguous else xp.ascontiguousarray(x)
        out = xp.empty((x.shape[0] // self.size,) + x.shape[1:], dtype=x.dtype)
        nccl_op, dtype, pointer = self._op(op), self._dtype(x), self.runtime.pointer
        done = self._run(lambda s: self.nccl.reduceScatter(pointer(x), pointer(out), out.size, dtype, nccl_op, s))
        self._complete("reduce_scatter", done, start, x.nbytes)
        if op == "mean":
            out /= self.size
        return out

    def allgather(self, x, out=None):
        if not self._native(x):
            return super().allgather(x, out)
        xp = backend.get_array_module(x)
        x = x if x.flags.c_contiguous else xp.ascontiguousarray(x)
        if out is not None:
            if out.size != self.size * x.size or out.dtype != x.dtype:
                raise ValueError(f"allgather: out has {out.size} {out.dtype}, needs {self.size} x {x.size} {x.dtype}")
            _require_contiguous(out, "allgather")
        self._flush()  # a peer may need a queued send before it joins the check
        debug.check_collective(self, "allgather", x)
        start = time.perf_counter()
        out = xp.empty((self.size,) + x.shape, dtype=x.dtype) if out is None else out
        dtype, pointer = self._dtype(x), self.runtime.pointer
        done = self._run(lambda stream: self.nccl.allGather(pointer(x), pointer(out), x.size, dtype, stream))
        self._complete("allgather", done, start, x.nbytes)
        return out

    def broadcast(self, x, root: int = 0):
        if not self._native(x):
            return super().broadcast(x, root)
        self._flush()  # a peer may need a queued send before it joins the check
        debug.check_collective(self, "broadcast", x)
        _require_contiguous(x, "broadcast")
        start = time.perf_counter()
        dtype, pointer = self._dtype(x), self.runtime.pointer
        done = self._run(lambda stream: self.nccl.broadcast(pointer(x), pointer(x), x.size, dtype, root, stream))
        self._complete("broadcast", done, start, x.nbytes)
        return x

    def barrier(self) -> None:
        self._flush()
        super().barrier()

    # ----- point-to-point: queued, issued as one group -------------------------------
    def isend(self, x, dest: int, tag: int = 0, *, _op_name: str = "isend") -> Handle:
        if not self._native(x):
            return super().isend(x, dest, tag, _op_name=_op_name)
        start = time.perf_counter()
        x = x if x.flags.c_contiguous else backend.get_array_module(x).ascontiguousarray(x)
        request = self._enqueue("send", x, dest)
        self.stats.add(_op_name, x.nbytes, time.perf_counter() - start, start=start, peer=dest, tag=tag)
        return Handle(self, _op_name, request, self._receiver(request, x), Waiting.point_to_point(_op_name, dest, tag),
                      keepalive=x, nbytes=x.nbytes)

    def irecv(self, buf, source: int, tag: int = 0, *, _op_name: str = "irecv") -> Handle:
        if not self._native(buf):
            return super().irecv(buf, source, tag, _op_name=_op_name)
        _require_contiguous(buf, _op_name)
        start = time.perf_counter()
        request = self._enqueue("recv", buf, source)
        self.stats.add(_op_name, buf.nbytes, time.perf_counter() - start, start=start, peer=source, tag=tag)
        return Handle(self, _op_name, request, self._receiver(request, buf),
                      Waiting.point_to_point(_op_name, source, tag), nbytes=buf.nbytes)

    def _enqueue(self, kind: str, array, peer: int) -> _EventRequest:
        request = _EventRequest(self)
        self._queue.append(_Queued(kind, array, peer, self._after_producer(), request))
        return request

    def _receiver(self, request: _EventRequest, array):
        def finish():
            self._hand_over(request.done)
            return array
        return finish

    def _flush(self) -> None:
        """Issue the queued sends and receives as one NCCL group on the communication stream."""
        if not self._queue:
            return
        queued, self._queue = self._queue, []
        for item in queued:
            self.stream.wait_event(item.ready)
        stream, pointer = self.runtime.handle(self.stream), self.runtime.pointer
        with self.group():
            for item in queued:
                call = self.nccl.send if item.kind == "send" else self.nccl.recv
                call(pointer(item.array), item.array.size, self._dtype(item.array), item.peer, stream)
        done = self.runtime.event()
        done.record(self.stream)
        for item in queued:
            item.request.done = done

    @contextlib.contextmanager
    def group(self):
        """NCCL's group: the calls inside are issued and progressed together."""
        self.runtime.nccl.groupStart()
        try:
            yield
        finally:
            self.runtime.nccl.groupEnd()

    # ----- the rest goes through MPI -------------------------------------------------
    # Whatever this rank waits for, a peer may need one of the queued sends first (a pipeline
    # stage waits for a header over MPI while its neighbour waits for the queued activation):
    # every wait, blocking MPI call and object call issues the queue first.
    def _wait(self, request, waiting) -> None:
        self._flush()
        super()._wait(request, waiting)

    def _collective(self, op, arrays, blocking, nonblocking, library_path=False) -> None:
        self._flush()
        super()._collective(op, arrays, blocking, nonblocking, library_path)

    def _object_call(self, op, obj, call, **kwargs):
        self._flush()
        return super()._object_call(op, obj, call, **kwargs)

    def like(self, mpi_comm, name: str) -> "NcclCommunicator":
        return NcclCommunicator(mpi_comm, name, runtime=self.runtime, cuda_aware=self.cuda_aware,
                                wait_policy=self.wait_policy, device_nonblocking=self.device_nonblocking)


class _Done:
    """A finished call in a handle's clothes: ``wait()`` gives the result."""

    def __init__(self, result):
        self._result = result
        self.done = True

    def wait(self):
        return self._result

    def test(self, start_queued: bool = True) -> bool:
        return True


def _then(handle, after):
    """``handle`` whose result passes through ``after`` when it is waited for."""
    if isinstance(handle, _Done):
        return _Done(after(handle.wait()))
    inner = handle._finish
    handle._finish = lambda: after(inner())
    return handle

