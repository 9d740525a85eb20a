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
from hpcpar.runtime.context import init

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


def test_dropout_masks_are_drawn_on_the_device_alike_in_every_split(ctx):
    """Philox4x32-10 on the device's own arrays gives Random123's answer, and this rank's share
    of a batch's keyed masks (as a dp replica draws it) is that share of the whole batch's."""
    from hpcpar.nn.dropout_keys import keyed_uniform
    from hpcpar.nn.philox import philox4x32

    xp, n, r = ctx.xp, ctx.dp.size, ctx.dp.rank
    counter = tuple(xp.full(2, c, dtype=xp.uint64) for c in (0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344))
    words = philox4x32(counter, (0xA4093822, 0x299F31D0))
    assert [backend.to_host(w).tolist() for w in words] == [[e, e] for e in (0xD16CFE09, 0x94FDCCEB, 0x5001E420,
                                                                            0x24126EA1)]
    for dtype in (np.float32, np.float64):
        whole = backend.to_host(keyed_uniform((5, 1, 0), (7, 3), range(0, 2 * n), None, dtype, xp))
        mine = keyed_uniform((5, 1, 0), (7, 3), range(2 * r, 2 * r + 2), None, dtype, xp)
        assert backend.is_gpu_array(mine)  # drawn on the device (the guard's, without a GPU)
        np.testing.assert_array_equal(backend.to_host(mine), whole[2 * r: 2 * r + 2])


def test_ring_attention_on_device_buffers_equals_attention_on_the_whole_sequence(ctx):
    """Context parallelism's ring over this communicator (``ctx.dp`` stands in for cp): K/V blocks and
    dK/dV accumulators travel as device buffers; the output and gradients of this rank's zigzag
    chunks are those of plain attention on the whole sequence, computed on the device too."""
    from hpcpar.autograd import Tensor
    from hpcpar.autograd.ops.nn_functional import attention
    from hpcpar.autograd.ops.ring_attention import ring_attention
    from hpcpar.autograd.ops.sequence_chunks import ChunkLayout

    xp, n = ctx.xp, ctx.dp.size
    q, k, v, grad = (rank_data(7 + i, (2, 2, 8 * n, 4)) for i in range(4))  # the same on every rank
    layout = ChunkLayout.of(ctx.dp)
    mine = lambda x: xp.ascontiguousarray(layout.take(xp.asarray(x).swapaxes(1, 2)).swapaxes(1, 2))  # noqa: E731
    whole = [Tensor(xp.asarray(x), requires_grad=True) for x in (q, k, v)]
    expected = attention(*whole, causal=True)
    (expected * Tensor(xp.asarray(grad))).sum().backward()
    local = [Tensor(mine(x), requires_grad=True) for x in (q, k, v)]
    out = ring_attention(*local, ctx.dp, layout)
    (out * Tensor(mine(grad))).sum().backward()
    np.testing.assert_allclose(backend.to_host(out.data), backend.to_host(mine(expected.data)), **TOLERANCE)
    for ours, theirs in zip(local, whole):
        np.testing.assert_allclose(backend.to_host(ours.grad), backend.to_host(mine(theirs.grad)), **TOLERANCE)
