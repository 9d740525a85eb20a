"""Ring attention (hpcpar.autograd.ops.ring_attention) against plain causal attention on the whole
sequence: the output and the gradients of q, k, v of each rank's chunks, float64, with and without
attention dropout, zigzag and contiguous layouts, to 1e-14; bfloat16 keeps its statistics in
float32 (close to the float32 answer); and the bytes on the cp communicator are exactly C - 1 K/V
blocks forward and C - 1 blocks plus C dK/dV accumulators backward (run at 1, 2 and 4 ranks)."""
import numpy as np
import pytest
from mpi4py import MPI

from hpcpar.autograd import Tensor
from hpcpar.autograd.ops.nn_functional import attention
from hpcpar.autograd.ops.ring_attention import ring_attention
from hpcpar.autograd.ops.sequence_chunks import ChunkLayout
from hpcpar.runtime.comm import Communicator

pytestmark = pytest.mark.mpi(min_size=1)
B, H, HS = 2, 3, 4


def inputs(T, dtype=np.float64):
    rng = np.random.default_rng(T)
    q, k, v, grad = (rng.standard_normal((B, H, T, HS)).astype(dtype) for _ in range(4))
    keep = ((rng.random((B, H, T, T)) > 0.25) / 0.75).astype(np.float64 if dtype == np.float64 else np.float32)
    return q, k, v, grad, keep


def mine(layout, x):
    """This rank's chunks of x (..., T, ...) along the sequence axis 2."""
    return np.ascontiguousarray(layout.take(x.swapaxes(1, 2)).swapaxes(1, 2))


def run_ring(comm, layout, q, k, v, grad, keep):
    tensors = [Tensor(mine(layout, x), requires_grad=True) for x in (q, k, v)]
    local_keep = None if keep is None else mine(layout, keep)
    out = ring_attention(*tensors, comm, layout, keep=local_keep)
    (out * Tensor(mine(layout, grad).astype(out.dtype))).sum().backward()
    return out, tensors


@pytest.fixture(scope="module")
def comm():
    cp = Communicator(MPI.COMM_WORLD.Dup(), "cp")
    yield cp
    cp.close()


@pytest.mark.parametrize("zigzag", [True, False], ids=["zigzag", "contiguous"])
@pytest.mark.parametrize("dropout", [False, True], ids=["no-dropout", "dropout"])
def test_ring_attention_equals_attention_on_the_whole_sequence(comm, zigzag, dropout):
    q, k, v, grad, keep = inputs(8 * comm.size)
    keep = keep if dropout else None
    whole = [Tensor(x, requires_grad=True) for x in (q, k, v)]
    reference = attention(*whole, causal=True, keep=keep)
    (reference * Tensor(grad)).sum().backward()
    layout = ChunkLayout(comm.rank, comm.size, zigzag=zigzag)
    out, local = run_ring(comm, layout, q, k, v, grad, keep)
    np.testing.assert_allclose(out.data, mine(layout, reference.data), rtol=0, atol=1e-14)
    for ours, theirs in zip(local, whole):
        np.testing.assert_allclose(ours.grad, mine(layout, theirs.grad), rtol=0, atol=1e-14)


def test_bfloat16_keeps_float32_statistics_and_stays_close_to_float32(comm):
    ml_dtypes = pytest.importorskip("ml_dtypes")
    q, k, v, grad, _ = inputs(8 * comm.size)
    layout = ChunkLayout(comm.rank, comm.size)
    exact, exact_inputs = run_ring(comm, layout, q.astype(np.float32), k.astype(np.float32), v.astype(np.float32),
                                   grad, None)
    low = [x.astype(ml_dtypes.bfloat16) for x in (q, k, v)]
    out, local = run_ring(comm, layout, *low, grad, None)
    assert out.dtype == ml_dtypes.bfloat16 and local[0].grad.dtype == ml_dtypes.bfloat16
    np.testing.assert_allclose(out.data.astype(np.float32), exact.data, atol=0.05)
    for ours, theirs in zip(local, exact_inputs):
        np.testing.assert_allclose(ours.grad.astype(np.float32), theirs.grad, atol=0.1)


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_the_ring_moves_exactly_its_blocks_and_accumulators(comm, dtype):
    C, T = comm.size, 8 * comm.size
    q, k, v, grad, _ = inputs(T, dtype)
    layout = ChunkLayout(comm.rank, C)
    comm.stats.reset()
    out, _ = run_ring(comm, layout, q, k, v, grad, None)
    block = 2 * B * H * (T // C) * HS * np.dtype(dtype).itemsize  # k and v of this rank's chunks
    assert comm.stats.calls("isend") == comm.stats.calls("irecv") == 2 * (C - 1) + C
    assert comm.stats.bytes("isend") == comm.stats.bytes("irecv") == (2 * (C - 1) + C) * block
