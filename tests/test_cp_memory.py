"""Activation memory on a context-parallel rank: the formulas of ``nn.activation_memory`` with ``cp``
equal the count of ``autograd.memory.kept_for_backward``, byte for byte (MPI: 2 and 4 ranks).

A cp rank holds T / cp positions of each sequence and its attention is ``ring_attention``, which
keeps its log-sum-exp and float32 (float64) output instead of the (T, T) probabilities. Checked
per block (the count with two blocks less the count with one) and for the whole graph (embedding
+ blocks + head), for each recomputation mode, float64, float32 and bfloat16, with and without
dropout, several heads and one head per tp rank, with and without tensor and sequence parallelism.
"""
import numpy as np
import pytest

import hpcpar
from hpcpar.autograd.memory import kept_for_backward
from hpcpar.nn.activation_memory import block_kept_bytes, embedding_kept_bytes, head_kept_bytes
from hpcpar.nn.dropout_keys import DropoutKey, dropout_key
from hpcpar.nn.gpt import GPT, RECOMPUTE, GPTConfig

CONFIGS = (GPTConfig(vocab_size=16, block_size=16, n_layer=1, n_head=4, n_embd=16, seed=5),
           GPTConfig(vocab_size=24, block_size=16, n_layer=1, n_head=2, n_embd=8, seed=5, tie_weights=False))
# (cp, tp, sequence parallelism): what 2 and 4 ranks allow
LAYOUTS = [(2, 1, False), (4, 1, False), (2, 2, False), (2, 2, True)]
ROWS = 2


def cp_context(world, cp, tp):
    """A context of cp x tp ranks made of the first world ranks (None on the others), or skip."""
    from mpi4py import MPI

    if world.Get_size() < cp * tp:
        pytest.skip(f"needs {cp * tp} ranks")
    group = world.Split(0 if world.Get_rank() < cp * tp else MPI.UNDEFINED, world.Get_rank())
    return None if group == MPI.COMM_NULL else hpcpar.init(dp=1, pp=1, tp=tp, cp=cp, comm=group, device="cpu")


def dtypes():
    ml_dtypes = pytest.importorskip("ml_dtypes")
    return (np.float64, np.float32, ml_dtypes.bfloat16)


def counted_bytes(ctx, config, dtype, mode, dropout, n_layer, sequence_parallel):
    """What one training forward of a GPT of ``n_layer`` blocks keeps on this rank (parameters excluded)."""
    cfg = GPTConfig(**{**config.to_dict(), "n_layer": n_layer, "dropout": dropout, "attn_dropout": None})
    model = GPT(cfg, dtype, tp=ctx.tp, cp=ctx.cp)
    model.sequence_parallel = sequence_parallel
    model.recompute = mode
    rng = np.random.default_rng(0)
    ids, targets = (np.ascontiguousarray(rng.integers(0, cfg.vocab_size, (ROWS, cfg.block_size))) for _ in "it")
    with dropout_key(DropoutKey(0)), kept_for_backward(model.parameters()) as kept:
        model.loss(ids, targets)
    return kept.bytes


def formula_bytes(config, dtype, mode, dropout, n_layer, tp, cp, sequence_parallel):
    """Embedding + n_layer blocks + head by the formulas, on one rank of the cp x tp group."""
    shape = dict(dtype=dtype, tp=tp, sequence_parallel=sequence_parallel, cp=cp)
    s, h = config.block_size, config.n_embd
    block = block_kept_bytes(ROWS, s, h, config.n_head, recompute=mode, dropout=dropout, **shape)
    return (embedding_kept_bytes(ROWS, s, h, **shape) + n_layer * block
            + head_kept_bytes(ROWS, s, h, config.vocab_size, **shape))


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("cp, tp, sequence_parallel", LAYOUTS, ids=[f"cp{c}-tp{t}{'-sp' if s else ''}" for c, t, s in LAYOUTS])
@pytest.mark.parametrize("mode", RECOMPUTE)
def test_bytes_kept_on_a_context_parallel_rank_equal_the_formulas(world, cp, tp, sequence_parallel, mode):
    ctx = cp_context(world, cp, tp)
    if ctx is not None:
        for config in CONFIGS:
            for dtype in dtypes():
                for dropout in (0.0, 0.1):
                    label = (config.n_head, np.dtype(dtype).name, dropout)
                    one, two = (counted_bytes(ctx, config, dtype, mode, dropout, n, sequence_parallel) for n in (1, 2))
                    want = block_kept_bytes(ROWS, config.block_size, config.n_embd, config.n_head, dtype=dtype, tp=tp,
                                            sequence_parallel=sequence_parallel, recompute=mode, dropout=dropout, cp=cp)
                    assert two - one == want, ("block",) + label
                    assert two == formula_bytes(config, dtype, mode, dropout, 2, tp, cp, sequence_parallel), \
                        ("whole",) + label
    world.Barrier()


def test_a_cp_rank_keeps_about_one_cp_th_and_none_of_the_t_by_t_arrays():
    """At a long context the (T, T) probabilities are most of a block's bytes; a cp rank keeps
    neither them nor a (T / C, T) share of them (without attention dropout), so it keeps less than 1/C."""
    args = (1, 4096, 256, 4)
    plain = block_kept_bytes(*args, dtype=np.float32)
    for cp in (2, 4, 8):
        ring = block_kept_bytes(*args, dtype=np.float32, cp=cp)
        assert ring < plain / cp
        assert ring == pytest.approx(block_kept_bytes(*args, dtype=np.float32, cp=cp, recompute="selective"), rel=0.2)
    with pytest.raises(ValueError, match="2 x cp = 8"):
        block_kept_bytes(1, 12, 256, 4, cp=4)
