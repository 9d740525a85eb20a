"""The GPU test matrix of ``make gpu-check`` (hpcpar.bench.gpu_check): collectives, point-to-point
and training steps on device buffers through the communicator ``HPCPAR_GPU_BACKEND`` names
(``mpi``: CUDA-aware or staged as ``HPCPAR_CUDA_AWARE`` says; ``nccl``).

On a GPU: CuPy arrays and CuPy's NCCL. Without one, the same tests run on the transfer guard's
device with the NCCL double (tests/nccl_double.py), so every line here is exercised in CI.
"""
import os

import numpy as np
import pytest
from mpi4py import MPI

import nccl_double
from hpcpar import backend
from hpcpar.dist.context import init

pytestmark = pytest.mark.mpi(min_size=1)
ON_GPU = backend.gpu_count() > 0
DEVICE = "cuda" if ON_GPU else "guard"
BACKEND = os.environ.get("HPCPAR_GPU_BACKEND", "nccl")
TOLERANCE = {"rtol": 1e-5, "atol": 1e-6}  # float32 sums, in the library's order


@pytest.fixture(scope="module")
def ctx():
    size = MPI.COMM_WORLD.Get_size()
    if ON_GPU and BACKEND == "nccl" and backend.gpu_count() < size:
        pytest.skip("NCCL needs one GPU per rank")
    return init(dp=size, device=DEVICE, backend=BACKEND, runtime=None if ON_GPU else nccl_double.runtime(), shm=False)


def rank_data(rank, shape, dtype=np.float32):
    return np.random.default_rng(11 + rank).standard_normal(shape).astype(dtype)


def test_the_communicator_is_the_one_asked_for(ctx):
    assert ctx.backend == BACKEND and ctx.device == DEVICE


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_collectives_on_device_buffers(ctx, dtype):
    comm, xp, n, r = ctx.dp, ctx.xp, ctx.dp.size, ctx.dp.rank
    everyone = np.stack([rank_data(k, (2 * n, 3), dtype) for k in range(n)])
    x = xp.asarray(rank_data(r, (2 * n, 3), dtype))
    tolerance = TOLERANCE if dtype == np.float32 else {"rtol": 2e-3, "atol": 2e-3}
    wide = everyone.astype(np.float64)
    np.testing.assert_allclose(backend.to_host(comm.allreduce(x)), wide.sum(0), **tolerance)
    np.testing.assert_allclose(backend.to_host(comm.iallreduce(x, "mean").wait()), wide.mean(0), **tolerance)
    np.testing.assert_allclose(backend.to_host(comm.reduce_scatter(x)), wide.sum(0)[2 * r: 2 * r + 2], **tolerance)
    np.testing.assert_array_equal(backend.to_host(comm.allgather(x)), everyone)
    y = xp.asarray(rank_data(r, (5,), dtype))
    np.testing.assert_array_equal(backend.to_host(comm.broadcast(y, root=n - 1)), rank_data(n - 1, (5,), dtype))


def test_paired_sends_and_receives(ctx):
    comm, xp = ctx.dp, ctx.xp
    right, left = (comm.rank + 1) % comm.size, (comm.rank - 1) % comm.size
    big = (1 << 16,)
    from_left, from_right = xp.empty(big, dtype=xp.float32), xp.empty(big, dtype=xp.float32)
    handles = [comm.isend(xp.asarray(rank_data(comm.rank, big)), right, tag=1),
               comm.isend(xp.asarray(rank_data(comm.rank, big) * 2), left, tag=2),
               comm.irecv(from_left, left, tag=1), comm.irecv(from_right, right, tag=2)]
    for handle in handles:
        handle.wait()
    np.testing.assert_array_equal(backend.to_host(from_left), rank_data(left, big))
    np.testing.assert_array_equal(backend.to_host(from_right), rank_data(right, big) * 2)
