"""Tensor parallelism: every sharded layer and the whole GPT equal the unsharded model (float64)."""
import numpy as np
import pytest

import hpcpar
from hpcpar.autograd import Tensor
from hpcpar.state import global_slab, slab_slices
from hpcpar.nn import init
from hpcpar.nn.gpt import GPT, MLP, CausalSelfAttention, GPTConfig
from hpcpar.autograd.ops.mappings import scatter_to_tp
from hpcpar.nn.tensor_parallel import (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding,
                                       vocab_parallel_cross_entropy)
from hpcpar.parallel.sequence import sync_sequence_parallel_grads

pytestmark = pytest.mark.mpi(min_size=2)
CONFIG = GPTConfig(vocab_size=16, block_size=8, n_layer=2, n_head=4, n_embd=16, seed=11)
TOL = 1e-10


@pytest.fixture
def tp(world):
    return hpcpar.init(tp=world.Get_size(), device="cpu").tp


def build(make, comm, seed=3):
    module = make(comm)
    init.initialize(module, seed)
    return module


def rng_input(shape, seed=0):
    return np.random.default_rng(seed).standard_normal(shape)


def assert_shard_grads(sharded, full):
    """Each rank's parameter gradient is exactly its slice of the unsharded gradient."""
    for (name, p), (_, q) in zip(sharded.named_parameters(), full.named_parameters()):
        _, slab = global_slab(p)
        assert np.max(np.abs(p.grad - q.grad[slab_slices(slab)])) <= TOL, name


def run_both(make, comm, forward, x_shape):
    sharded, full = build(make, comm), build(make, None)
    outs = []
    for module in (sharded, full):
        x = Tensor(rng_input(x_shape), requires_grad=True)
        out = forward(module, x)
        (out * Tensor(rng_input(out.shape, 1))).sum().backward()
        outs.append((out.data, x.grad))
    return sharded, full, outs


@pytest.mark.parametrize("gather", [True, False])
def test_column_parallel_linear(tp, gather):
    make = lambda c: ColumnParallelLinear(6, 8, c, gather_output=gather, dtype=np.float64)  # noqa: E731
    sharded, full, [(y, gx), (y_ref, gx_ref)] = run_both(make, tp, lambda m, x: m(x), (3, 5, 6))
    if not gather:
        width = 8 // tp.size
        y_ref = y_ref[..., tp.rank * width:(tp.rank + 1) * width]
        # Only this rank's output columns carry a gradient here: compare through the sharded model.
    np.testing.assert_allclose(y, y_ref, rtol=0, atol=TOL)
    if gather:
        np.testing.assert_allclose(gx, gx_ref, rtol=0, atol=TOL)
        assert_shard_grads(sharded, full)


@pytest.mark.parametrize("parallel_input", [True, False])
def test_row_parallel_linear(tp, parallel_input):
    make = lambda c: RowParallelLinear(8, 6, c, input_is_parallel=parallel_input, dtype=np.float64)  # noqa: E731

    def forward(module, x):
        return module(scatter_to_tp(x, module.comm) if parallel_input else x)

    sharded, full, [(y, gx), (y_ref, gx_ref)] = run_both(make, tp, forward, (3, 5, 8))
    np.testing.assert_allclose(y, y_ref, rtol=0, atol=TOL)
    np.testing.assert_allclose(gx, gx_ref, rtol=0, atol=TOL)
    assert_shard_grads(sharded, full)


def test_vocab_parallel_embedding(tp):
    ids = np.random.default_rng(2).integers(0, 16, (4, 5))
    outs = []
    modules = [build(lambda c: VocabParallelEmbedding(16, 6, c, dtype=np.float64), c) for c in (tp, None)]
    for module in modules:
        out = module(ids)
        (out * Tensor(rng_input(out.shape, 1))).sum().backward()
        outs.append(out.data)
    np.testing.assert_allclose(outs[0], outs[1], rtol=0, atol=TOL)
    assert_shard_grads(*modules)


def test_vocab_parallel_cross_entropy_with_ignore_index(tp):
    logits = rng_input((12, 16))
    targets = np.random.default_rng(3).integers(0, 16, 12)
    targets[[2, 7]] = -100
    width = 16 // tp.size
    shard = Tensor(logits[:, tp.rank * width:(tp.rank + 1) * width].copy(), requires_grad=True)
    full = Tensor(logits.copy(), requires_grad=True)
    loss = vocab_parallel_cross_entropy(shard, targets, tp)
    ref = vocab_parallel_cross_entropy(full, targets, None)
    loss.backward()
    ref.backward()
    assert abs(loss.item() - ref.item()) <= TOL
    np.testing.assert_allclose(shard.grad, full.grad[:, tp.rank * width:(tp.rank + 1) * width], atol=TOL)


@pytest.mark.parametrize("block", [CausalSelfAttention, MLP])
def test_parallel_attention_and_mlp(tp, block):
    make = lambda c: block(CONFIG, np.float64, np, c)  # noqa: E731
    sharded, full, [(y, gx), (y_ref, gx_ref)] = run_both(make, tp, lambda m, x: m(x), (2, 8, 16))
    np.testing.assert_allclose(y, y_ref, rtol=0, atol=TOL)
    np.testing.assert_allclose(gx, gx_ref, rtol=0, atol=TOL)
    assert_shard_grads(sharded, full)


def gpt_batch(seed=0):
    ids = np.random.default_rng(seed).integers(0, CONFIG.vocab_size, (4, CONFIG.block_size + 1))
    return ids[:, :-1], ids[:, 1:]


def sharded_and_full_gpt(tp, tied, sequence_parallel=False):
    """A tp-sharded and an unsharded GPT (dropout 0.1), after one forward and backward of the
    same batch: (sharded, full, their two losses)."""
    config = GPTConfig(**{**CONFIG.to_dict(), "tie_weights": tied, "dropout": 0.1})
    sharded, full = GPT(config, np.float64, tp=tp), GPT(config, np.float64)
    sharded.sequence_parallel = sequence_parallel
    ids, targets = gpt_batch()
    losses = []
    for model in (sharded, full):
        loss = model.loss(ids, targets)
        loss.backward()
        losses.append(loss.item())
    return sharded, full, losses


@pytest.mark.parametrize("tied", [True, False])
def test_whole_gpt_equals_unsharded(tp, tied):
    sharded, full, losses = sharded_and_full_gpt(tp, tied)
    # dropout masks agree: keyed by sample and position in replicated regions, by head for attention
    assert abs(losses[0] - losses[1]) <= TOL
    assert_shard_grads(sharded, full)
    for (name, p), (_, q) in zip(sharded.named_parameters(), full.named_parameters()):
        _, slab = global_slab(p)
        assert np.array_equal(p.data, q.data[slab_slices(slab)]), name  # same model in every layout


def test_exact_all_reduce_counts_and_bytes(tp):
    model = GPT(CONFIG, np.float64, tp=tp)
    ids, targets = gpt_batch()
    B, T, C, L = 4, CONFIG.block_size, CONFIG.n_embd, CONFIG.n_layer
    activation = B * T * C * 8
    tp.stats.reset()
    loss = model.loss(ids, targets)
    # forward: 2 per block (attention and MLP row-parallel outputs) + the embedding + the loss's two
    assert tp.stats.calls("allreduce") == 2 * L + 1 + 2
    assert tp.stats.bytes("allreduce") == (2 * L + 1) * activation + B * T * 8 + 2 * B * T * 8
    tp.stats.reset()
    loss.backward()
    # backward: 2 per block (copy_to_tp before qkv and fc) + the head's copy_to_tp
    assert tp.stats.calls("allreduce") == 2 * L + 1
    assert tp.stats.bytes("allreduce") == (2 * L + 1) * activation
    assert set(tp.stats.ops) == {"allreduce"}


def test_generate_gathers_the_vocabulary(tp):
    ids, _ = gpt_batch()
    out = GPT(CONFIG, np.float64, tp=tp).generate(ids[:1, :4], 5, rng=np.random.default_rng(0))
    ref = GPT(CONFIG, np.float64).generate(ids[:1, :4], 5, rng=np.random.default_rng(0))
    np.testing.assert_array_equal(out, ref)


def test_divisibility_errors_are_clear(tp):
    with pytest.raises(ValueError, match=rf"n_head \(3\) is not divisible by the tensor-parallel size {tp.size}"):
        GPT(GPTConfig(vocab_size=16, block_size=8, n_layer=1, n_head=3, n_embd=12), np.float64, tp=tp)
    with pytest.raises(ValueError, match=r"vocabulary size \(pad it to a multiple of tp\) \(17\) is not divisible"):
        GPT(GPTConfig(vocab_size=17, block_size=8, n_layer=1, n_head=4, n_embd=16), np.float64, tp=tp)


# ----- sequence parallelism --------------------------------------------------------------

@pytest.mark.parametrize("tied", [True, False])
def test_sequence_parallel_gpt_equals_unsharded(tp, tied):
    """Norms, dropout and residuals on slices of the sequence: the same loss and gradients,
    dropout masks included (each rank draws those of its positions of the whole sequence)."""
    sharded, full, losses = sharded_and_full_gpt(tp, tied, sequence_parallel=True)
    assert sharded.sequence_parallel == (tp.size > 1)  # with one tp rank there is nothing to split
    sync_sequence_parallel_grads(sharded.named_parameters(), tp)
    assert abs(losses[0] - losses[1]) <= TOL
    assert_shard_grads(sharded, full)


def test_sequence_parallel_communication_counts(tp):
    """Per block, each all-reduce becomes a reduce-scatter and an all-gather of the same bytes."""
    model = GPT(CONFIG, np.float64, tp=tp)
    model.sequence_parallel = True
    ids, targets = gpt_batch()
    B, T, C, L = 4, CONFIG.block_size, CONFIG.n_embd, CONFIG.n_layer
    activation = B * T * C * 8
    tp.stats.reset()
    loss = model.loss(ids, targets)
    # forward: a reduce-scatter leaving each row-parallel layer and the embedding; an all-gather
    # entering each column-parallel one (qkv, fc) and the head; the loss's two all-reduces
    assert (tp.stats.calls("reduce_scatter"), tp.stats.calls("allgather")) == (2 * L + 1, 2 * L + 1)
    assert tp.stats.bytes("reduce_scatter") == (2 * L + 1) * activation
    assert tp.stats.bytes("allgather") == (2 * L + 1) * activation // tp.size  # each rank sends its slice
    assert tp.stats.calls("allreduce") == 2
    tp.stats.reset()
    loss.backward()
    assert (tp.stats.calls("reduce_scatter"), tp.stats.calls("allgather")) == (2 * L + 1, 2 * L + 1)
    assert "allreduce" not in tp.stats.ops
    sync_sequence_parallel_grads(model.named_parameters(), tp)
    assert tp.stats.calls("allreduce") == 1  # the norms', biases' and position embedding's gradients, in one


def test_sequence_parallel_needs_a_sequence_that_divides(tp):
    model = GPT(CONFIG, np.float64, tp=tp)
    model.sequence_parallel = True
    ids, targets = gpt_batch()
    if tp.size > 1:
        with pytest.raises(ValueError, match="does not divide"):
            model.loss(ids[:, :tp.size + 1], targets[:, :tp.size + 1])
    # generation runs on whole sequences of any length, and leaves the setting as it was
    out = model.generate(ids[:1, :3], 2, rng=np.random.default_rng(0))
    assert out.shape == (1, 5) and model.sequence_parallel == (tp.size > 1)
