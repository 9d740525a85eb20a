"""Expert parallelism's dispatch and combine (hpcpar.nn.moe over an ep group of every rank) against
one process routing the whole batch: outputs and input gradients to 1e-14, expert gradients (times
ep, the factor their average over edp takes back) and the summed router gradients too, dropless
and with capacity; and the bytes on the ep communicator exactly: the counts once, the rows twice
each way (run at 1, 2 and 4 ranks)."""
import numpy as np
import pytest
from mpi4py import MPI

from hpcpar.autograd import Tensor
from hpcpar.nn import init
from hpcpar.nn.gpt import GPTConfig
from hpcpar.nn.moe import MoE, MoEConfig
from hpcpar.runtime.comm import Communicator

pytestmark = pytest.mark.mpi(min_size=1)
B, T, C, E = 2, 8, 4, 4


@pytest.fixture(scope="module")
def ep():
    group = Communicator(MPI.COMM_WORLD.Dup(), "ep")
    yield group
    group.close()


def moe_layer(capacity, group):
    config = GPTConfig(vocab_size=8, block_size=T, n_layer=1, n_head=1, n_embd=C)
    # no auxiliary losses: each rank's are means over its own sequences (the job tests check them)
    moe = MoEConfig(experts=E, top_k=2, capacity_factor=capacity, aux_loss_coef=0.0, z_loss_coef=0.0)
    layer = MoE(config, moe, np.float64, np, ep=group)
    init.initialize(layer, seed=3)  # the global expert tensors: every rank keeps its experts' slab
    return layer


def forward_backward(layer, x, seed):
    x = Tensor(x, requires_grad=True)
    out = layer(x)
    out.backward(seed)
    return out.data, x.grad, {name: p.grad for name, p in layer.named_parameters()}


@pytest.mark.parametrize("capacity", [None, 1.25], ids=["dropless", "capacity-1.25"])
def test_expert_parallel_moe_equals_one_process_and_moves_exact_bytes(ep, capacity):
    if E % ep.size:
        pytest.skip(f"{E} experts over {ep.size} ranks")
    rng = np.random.default_rng(0)
    x, seed = rng.normal(size=(ep.size * B, T, C)), rng.normal(size=(ep.size * B, T, C))
    mine = slice(ep.rank * B, (ep.rank + 1) * B)
    reference = forward_backward(moe_layer(capacity, None), x, seed)
    layer = moe_layer(capacity, ep)
    ep.stats.reset()
    out, grad_x, grads = forward_backward(layer, x[mine], seed[mine])
    np.testing.assert_allclose(out, reference[0][mine], rtol=0, atol=1e-14)
    np.testing.assert_allclose(grad_x, reference[1][mine], rtol=0, atol=1e-14)
    local = slice(ep.rank * layer.local, (ep.rank + 1) * layer.local)
    for name in ("fc.weight", "fc.bias", "proj.weight", "proj.bias"):
        np.testing.assert_allclose(grads[name] * ep.size, reference[2][name][local], rtol=0, atol=1e-13)
    router = ep.allreduce(np.ascontiguousarray(grads["router.weight"]))  # each rank's tokens' share
    np.testing.assert_allclose(router, reference[2]["router.weight"], rtol=0, atol=1e-13)
    if ep.size == 1:
        assert ep.stats.calls("alltoall") == ep.stats.calls("alltoallv") == 0  # all experts here: no all-to-all
        return
    counts = np.array(ep.allgather_object(layer.routing.counts.tolist()))  # (ranks, experts) kept rows
    owner = np.arange(E) // layer.local
    sent, received = counts[ep.rank].sum(), counts[:, owner == ep.rank].sum()
    to_self = counts[ep.rank, owner == ep.rank].sum()
    row = C * 8  # float64 rows
    assert (ep.stats.calls("alltoall"), ep.stats.bytes("alltoall")) == (1, 8 * E)  # the counts, once
    assert ep.stats.calls("alltoallv") == 4  # dispatch and combine, forward and backward
    assert ep.stats.bytes("alltoallv") == 2 * (sent + received) * row
    assert ep.stats.wire_bytes("alltoallv") == 2 * (sent - to_self + received - to_self) * row
