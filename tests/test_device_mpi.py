"""MPI with device buffers, on CPUs through the transfer guard: both ways a Communicator moves them.

- "CUDA-aware": the guard's arrays go to MPI as device buffers (mpi4py reads their
  ``__cuda_array_interface__``, which the guard refuses unless the host synchronized the stream
  that wrote them). Collectives are blocking unless the library is known to take device buffers
  in non-blocking ones (``DEVICE_NONBLOCKING``).
- "staged": copies through host buffers that are reused, never allocated per call.

Run at 1, 2 and 4 ranks.
"""
import numpy as np
import pytest

from hpcpar import guard
from hpcpar.runtime import Communicator, device_transport
from hpcpar.runtime.device_transport import DEVICE_NONBLOCKING, device_nonblocking_supported, library_version

xp = guard.xp
mpi = pytest.mark.mpi(min_size=1)


class Recorder:
    """An mpi4py communicator that notes which of its methods were called."""

    def __init__(self, comm):
        self._comm, self.called = comm, []

    def __getattr__(self, name):
        attribute = getattr(self._comm, name)
        if callable(attribute) and name[0].isupper():
            self.called.append(name)
        return attribute


def rank_data(rank, shape=(4, 3)):
    return np.random.default_rng(7 + rank).standard_normal(shape)


def device_communicator(world, cuda_aware, nonblocking=False):
    comm = Communicator(world, "world", cuda_aware=cuda_aware, device_nonblocking=nonblocking)
    comm.mpi = Recorder(world)
    return comm


def collectives(comm):
    """Every array call once on device buffers; the results on the host (explicit copies)."""
    n, r = comm.size, comm.rank
    x = xp.asarray(rank_data(r, (2 * n, 3)))
    out = [comm.allreduce(x), comm.iallreduce(x, "mean").wait(), comm.reduce_scatter(x), comm.allgather(x)]
    y = xp.asarray(rank_data(r, (3,)))
    out.append(comm.broadcast(y, root=n - 1))
    received = xp.empty((3,))
    handles = [comm.irecv(received, (r - 1) % n, tag=3), comm.isend(y * 2, (r + 1) % n, tag=3)]
    for handle in handles:
        handle.wait()
    out.append(received)
    return [guard.asnumpy(a) for a in out]


def expected(n, r):
    everyone = np.stack([rank_data(k, (2 * n, 3)) for k in range(n)])
    return [everyone.sum(0), everyone.mean(0), everyone.sum(0)[r * 2: r * 2 + 2], everyone,
            rank_data(n - 1, (3,)), rank_data(n - 1, (3,)) * 2]  # every rank sends the broadcast value, doubled


@mpi
@pytest.mark.parametrize("cuda_aware", [True, False], ids=["cuda-aware", "staged"])
def test_device_collectives_are_right(world, cuda_aware):
    comm = device_communicator(world, cuda_aware)
    implicit = guard.stats.implicit
    for got, want in zip(collectives(comm), expected(comm.size, comm.rank)):
        np.testing.assert_allclose(got, want, rtol=1e-13, atol=1e-14)
    assert guard.stats.implicit == implicit


@mpi
def test_cuda_aware_device_buffers_use_blocking_collectives_unless_known_safe(world):
    blocking = device_communicator(world, cuda_aware=True, nonblocking=False)
    collectives(blocking)
    assert {"Allreduce", "Reduce_scatter_block", "Allgather", "Bcast"} <= set(blocking.mpi.called)
    assert not {"Iallreduce", "Ireduce_scatter_block", "Iallgather", "Ibcast"} & set(blocking.mpi.called)
    nonblocking = device_communicator(world, cuda_aware=True, nonblocking=True)
    collectives(nonblocking)
    assert {"Iallreduce", "Ireduce_scatter_block", "Iallgather", "Ibcast"} <= set(nonblocking.mpi.called)
    host = device_communicator(world, cuda_aware=True, nonblocking=False)  # host buffers keep the polled path
    host.reduce_scatter(np.ones((host.size, 2)))
    assert "Ireduce_scatter_block" in host.mpi.called


@mpi
def test_mpi_reads_device_memory_only_after_every_stream_that_wrote_it(world, monkeypatch):
    comm = device_communicator(world, cuda_aware=True)
    side = guard.Stream(non_blocking=True)
    x = xp.asarray(rank_data(comm.rank))
    side.wait_event(guard.get_current_stream().record())
    with side:
        y = x * 3  # written on another stream than the current one, which is not ordered after it
    comm.allreduce(y, out=y)  # in place: nothing on the current stream reads y, MPI reads it directly
    side.synchronize()
    np.testing.assert_allclose(guard.asnumpy(y), sum(rank_data(k) * 3 for k in range(comm.size)), rtol=1e-14)
    # planted: synchronizing only the current stream (the old behaviour) lets MPI read z early
    monkeypatch.setattr(device_transport, "synchronize", lambda a=None: guard.get_current_stream().synchronize())
    with side:
        z = x * 4
    with pytest.raises((guard.StreamOrderError, TypeError)):  # mpi4py reports the refused interface as TypeError
        comm.allreduce(z, out=z)  # every rank raises before communicating


@mpi
def test_staging_copies_once_each_way_and_reuses_its_host_buffers(world):
    comm = device_communicator(world, cuda_aware=False)
    x = xp.asarray(rank_data(comm.rank, (comm.size, 5)))

    def step():  # three buckets in flight at once, as DDP's overlap does, then the other calls
        handles = [comm.iallreduce(x * (k + 1)) for k in range(3)]
        for handle in handles:
            handle.wait()
        comm.allreduce(x)
        comm.reduce_scatter(x)
        comm.allgather(x)

    guard.stats.reset()
    step()
    first = comm.staging.allocations
    assert first == 3  # three buffers in flight at once; the later calls take them back from the pool
    assert guard.stats.to_host == 6 and guard.stats.to_device == 6  # one copy each way per call
    reuses = comm.staging.reuses
    step()
    assert comm.staging.allocations == first  # nothing allocated in the second step
    assert comm.staging.reuses - reuses == 8  # every host buffer came from the pool
    assert guard.stats.implicit == 0


def test_the_device_nonblocking_table(monkeypatch):
    monkeypatch.delenv("HPCPAR_DEVICE_NONBLOCKING", raising=False)
    assert library_version("Open MPI v4.1.5, package: Open MPI, ident: 4.1.5") == ("Open MPI", (4, 1, 5))
    assert library_version("MPICH Version:      4.2.0\nMPICH Release date: ...") == ("MPICH", (4, 2, 0))
    assert library_version("MPI VERSION    : CRAY MPICH version 8.1.27") == ("CRAY MPICH", (8, 1, 27))
    assert not device_nonblocking_supported("Open MPI", (4, 1, 5))  # its FAQ: blocking collectives only
    assert not device_nonblocking_supported("Open MPI", (5, 0, 3))
    assert device_nonblocking_supported("MPICH", (4, 2, 0))
    assert not device_nonblocking_supported("MPICH", (3, 4, 3))
    assert not device_nonblocking_supported("CRAY MPICH", (8, 1, 27))  # not in the table: blocking
    assert not device_nonblocking_supported("Some MPI", (9,))
    monkeypatch.setenv("HPCPAR_DEVICE_NONBLOCKING", "1")
    assert device_nonblocking_supported("Open MPI", (4, 1, 5))
    monkeypatch.setenv("HPCPAR_DEVICE_NONBLOCKING", "yes")
    with pytest.raises(ValueError, match="must be 0 or 1"):
        device_nonblocking_supported()
    assert all(len(row) == 4 for row in DEVICE_NONBLOCKING)
