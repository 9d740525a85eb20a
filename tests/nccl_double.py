"""A double of ``cupy.cuda.nccl`` for CPUs: NCCL's calls over MPI, on the transfer guard's device arrays.

``runtime()`` gives the ``DeviceRuntime`` that ``hpcpar.runtime.nccl.NcclCommunicator`` (and
``init(backend="nccl", runtime=...)``) runs on. Buffers and streams are passed as the guard's
arrays and streams themselves (CuPy passes pointers). What the double checks on every call,
where a GPU would silently race or hang:

- stream order: NCCL reads each input buffer on the stream it is given; ``guard.check_ready``
  raises ``StreamOrderError`` unless that stream is ordered after the work that wrote the buffer
  (an event recorded on the producer, waited on by the communication stream). Outputs are marked
  as written by that stream, so a consumer that reads them without waiting on the communication
  stream's event fails the guard's own checks;
- the call itself: count and datatype agree with the buffer (NCCL reads ``count`` elements of
  that type from a pointer, whatever the array is), the buffers are device arrays, and the
  peers agree on the unique id at bootstrap;
- point-to-point: NCCL has no tags and matches by order, so the double sends on one MPI tag and
  the receiver checks the next message's size against its buffer; a send outside a group is a
  synchronous send (NCCL's send waits for the receiver), so paired sends that are not grouped
  hang as they would on a GPU (under the test's timeout).

``calls`` counts the NCCL calls made (by name), ``groups`` the groups issued.
"""
from __future__ import annotations

import os
from collections import Counter

import numpy as np
from mpi4py import MPI

from hpcpar import guard
from hpcpar.runtime.nccl import DeviceRuntime
from hpcpar.guard.array import mark_written

available = True
NCCL_INT8, NCCL_UINT8, NCCL_INT32, NCCL_UINT32, NCCL_INT64, NCCL_UINT64 = 0, 1, 2, 3, 4, 5
NCCL_FLOAT16, NCCL_FLOAT32, NCCL_FLOAT64 = 6, 7, 8  # like CuPy without NCCL_BFLOAT16: bfloat16 is widened
NCCL_SUM, NCCL_PROD, NCCL_MAX, NCCL_MIN = 0, 1, 2, 3
DTYPES = {NCCL_INT8: np.int8, NCCL_UINT8: np.uint8, NCCL_INT32: np.int32, NCCL_UINT32: np.uint32,
          NCCL_INT64: np.int64, NCCL_UINT64: np.uint64, NCCL_FLOAT16: np.float16, NCCL_FLOAT32: np.float32,
          NCCL_FLOAT64: np.float64}
OPS = {NCCL_SUM: MPI.SUM, NCCL_PROD: MPI.PROD, NCCL_MAX: MPI.MAX, NCCL_MIN: MPI.MIN}
P2P_TAG = 7

calls: Counter = Counter()
groups = 0
_group: list | None = None  # the point-to-point calls of the open group


class DoubleError(RuntimeError):
    """A call NCCL would not take (or would take and corrupt)."""


def get_version() -> int:
    return 22304  # NCCL 2.23.4's code


def get_unique_id() -> tuple:
    return tuple(int(b) - 128 for b in os.urandom(128))  # NCCL_UNIQUE_ID_BYTES chars


def groupStart() -> None:  # noqa: N802 - NCCL's name
    global _group
    if _group is not None:
        raise DoubleError("groupStart inside a group (the double does not nest groups)")
    _group = []


def groupEnd() -> None:  # noqa: N802 - NCCL's name
    """Issue the group: every send at once (synchronous sends: NCCL's wait for the receiver), then the
    receives in order; NCCL progresses a group's calls together."""
    global _group, groups
    if _group is None:
        raise DoubleError("groupEnd without groupStart")
    pending, _group = _group, None
    groups += 1
    requests = [comm.mpi.Issend(data, dest=peer, tag=P2P_TAG)
                for kind, comm, data, peer, _ in pending if kind == "send"]
    for kind, comm, data, peer, _ in pending:
        if kind == "recv":
            comm.receive(data, peer)
    MPI.Request.Waitall(requests)
    for kind, comm, data, peer, (array, stream) in pending:
        if kind == "recv":
            mark_written(array, stream)


class NcclCommunicator:
    """``cupy.cuda.nccl.NcclCommunicator(ndev, commId, rank)`` over a duplicate of ``mpi_comm``."""

    def __init__(self, ndev: int, commId: tuple, rank: int, mpi_comm):  # noqa: N803 - CuPy's names
        self.mpi = mpi_comm.Dup()  # its own matching space: never confused with the MPI communicator's traffic
        if (ndev, rank) != (self.mpi.Get_size(), self.mpi.Get_rank()):
            raise DoubleError(f"NcclCommunicator({ndev}, id, {rank}) on MPI rank {self.mpi.Get_rank()} of "
                              f"{self.mpi.Get_size()}")
        if len(set(self.mpi.allgather(tuple(commId)))) != 1:
            raise DoubleError("the ranks of one NCCL communicator hold different unique ids (bootstrap broken)")
        calls["init"] += 1

    # ----- the checks ----------------------------------------------------------------
    def _buffer(self, array, count: int, datatype: int, what: str):
        if not isinstance(array, guard.ndarray):
            raise DoubleError(f"{what}: NCCL takes device buffers only, got {type(array).__name__}")
        if DTYPES.get(datatype) != array.dtype:
            raise DoubleError(f"{what}: datatype {datatype} for a {array.dtype} buffer")
        if count > array.size:
            raise DoubleError(f"{what}: count {count} > the buffer's {array.size} elements")
        return array._a.reshape(-1)[:count]

    def _read(self, array, count, datatype, stream, what):
        data = self._buffer(array, count, datatype, what)
        guard.check_ready(array, stream)  # the stream NCCL runs on must be ordered after the buffer's producer
        return data

    # ----- collectives -----------------------------------------------------------------
    def allReduce(self, sendbuf, recvbuf, count, datatype, op, stream):  # noqa: N802
        calls["allReduce"] += 1
        send = self._read(sendbuf, count, datatype, stream, "allReduce")
        recv = self._buffer(recvbuf, count, datatype, "allReduce")
        self.mpi.Allreduce(MPI.IN_PLACE if sendbuf is recvbuf else send, recv, OPS[op])
        mark_written(recvbuf, stream)

    def reduceScatter(self, sendbuf, recvbuf, recvcount, datatype, op, stream):  # noqa: N802
        calls["reduceScatter"] += 1
        send = self._read(sendbuf, recvcount * self.mpi.Get_size(), datatype, stream, "reduceScatter")
        recv = self._buffer(recvbuf, recvcount, datatype, "reduceScatter")
        self.mpi.Reduce_scatter_block(send, recv, OPS[op])
        mark_written(recvbuf, stream)

    def allGather(self, sendbuf, recvbuf, count, datatype, stream):  # noqa: N802
        calls["allGather"] += 1
        send = self._read(sendbuf, count, datatype, stream, "allGather")
        recv = self._buffer(recvbuf, count * self.mpi.Get_size(), datatype, "allGather")
        self.mpi.Allgather(send, recv)
        mark_written(recvbuf, stream)

    def broadcast(self, sendbuff, recvbuff, count, datatype, root, stream):
        calls["broadcast"] += 1
        if self.mpi.Get_rank() == root:
            data = self._read(sendbuff, count, datatype, stream, "broadcast")
            if sendbuff is not recvbuff:
                self._buffer(recvbuff, count, datatype, "broadcast")[...] = data
        self.mpi.Bcast(self._buffer(recvbuff, count, datatype, "broadcast"), root=root)
        mark_written(recvbuff, stream)

    # ----- point-to-point ------------------------------------------------------------------
    def send(self, sendbuf, count, datatype, peer, stream):
        calls["send"] += 1
        data = self._read(sendbuf, count, datatype, stream, "send")
        if _group is None:
            self.mpi.Ssend(data, dest=peer, tag=P2P_TAG)  # NCCL's send waits for the receiver
        else:
            _group.append(("send", self, np.array(data), peer, (sendbuf, stream)))

    def recv(self, recvbuf, count, datatype, peer, stream):
        calls["recv"] += 1
        data = self._buffer(recvbuf, count, datatype, "recv")
        if _group is None:
            self.receive(data, peer)
            mark_written(recvbuf, stream)
        else:
            _group.append(("recv", self, data, peer, (recvbuf, stream)))

    def receive(self, data: np.ndarray, peer: int) -> None:
        """The next message from ``peer`` (order-matched, as NCCL), which must fill ``data`` exactly."""
        status = MPI.Status()
        self.mpi.Probe(source=peer, tag=P2P_TAG, status=status)
        if status.Get_count(MPI.BYTE) != data.nbytes:
            raise DoubleError(f"recv from {peer}: the next message has {status.Get_count(MPI.BYTE)} bytes, the buffer "
                              f"{data.nbytes} (NCCL matches sends and receives by order: the pair's orders differ)")
        self.mpi.Recv(data, source=peer, tag=P2P_TAG)

    def abort(self) -> None:
        pass

    def destroy(self) -> None:
        calls["destroy"] += 1
        self.mpi.Free()


def runtime() -> DeviceRuntime:
    """The NCCL communicator's runtime on this double and the guard's streams and events."""
    import sys

    return DeviceRuntime(
        nccl=sys.modules[__name__],
        connect=lambda size, unique_id, rank, mpi_comm: NcclCommunicator(size, unique_id, rank, mpi_comm),
        stream=lambda: guard.Stream(non_blocking=True),
        event=lambda: guard.Event(disable_timing=True),
        current_stream=guard.get_current_stream,
        is_device=lambda array: isinstance(array, guard.ndarray),
        pointer=lambda array: array,
        handle=lambda stream: stream,
    )
