"""ZeRO-3's parameter store (``parallel.zero_params``) at any dp: equal to one process in float64
with and without resharding after forward, the traffic of its units exactly (1.5x DDP's bytes
less the unit kept gathered), no whole parameter kept between steps, and a rank-dependent
forward path named under HPCPAR_DEBUG=1 instead of hanging."""
import pytest

import hpcpar
from dp_reference import accumulate_share, global_batch, make_model, max_difference, train_single_process
from hpcpar.optim import AdamW
from hpcpar.parallel.hybrid import shard_groups
from hpcpar.parallel.zero import ZeroRedundancyOptimizer
from hpcpar.parallel.zero_params import ShardedParameters, ShardedParameterSync
from hpcpar.runtime import debug

pytestmark = pytest.mark.mpi(min_size=1)
STEPS = 3


def zero_3(ctx, model, reshard=True, bucket_mb=25, free_pages=None, shard_size=None):
    """The store, its sync and the optimizer over dp, or with ``shard_size`` hybrid sharding's groups."""
    shards, replicas = shard_groups(ctx, shard_size or ctx.dp_size)
    names = {id(p): name for name, p in model.named_parameters()}
    params = ShardedParameters(model.layers(), names, shards, reshard_after_forward=reshard, free_pages=free_pages)
    sync = ShardedParameterSync(params, ctx, bucket_mb=bucket_mb, overlap=True, replicas=replicas)
    optimizer = ZeroRedundancyOptimizer(params.named_parameters(), shards, AdamW, lr=1e-2, weight_decay=0.1,
                                        parameters=params, replicas=replicas)
    sync.check_layout(optimizer)
    return params, sync, optimizer


def step(sync, optimizer):
    sync.finish()
    optimizer.shard.grad = sync.take_shard_gradient()
    optimizer.step(reduce=False)


def whole_parameters(params) -> dict:
    """{name: the whole tensor}, gathered from every rank's shard."""
    flat = params.comm.allgather(params.shard.data).reshape(-1)
    return {name: flat[o: o + p.size].reshape(p.shape) for name, p, o in zip(params.names, params.params, params.offsets)}


@pytest.mark.parametrize("reshard, accumulate, bucket_mb, free_pages", [
    (True, 1, 25, True), (True, 1, 25, False), (False, 1, 0.001, True), (True, 2, 0.001, True), (True, 2, 0.001, False)])
def test_zero_3_equals_one_process(reshard, accumulate, bucket_mb, free_pages):
    """Resharded units freed by dropping their pages (NumPy's default) or by recomputation (a
    device's), kept, accumulated over micro-batches."""
    ctx = hpcpar.init(device="cpu")
    model = make_model()
    params, sync, optimizer = zero_3(ctx, model, reshard, bucket_mb, free_pages)
    for s in range(STEPS):
        accumulate_share(model, sync, ctx, s, accumulate)
        step(sync, optimizer)
    reference, _ = train_single_process(STEPS)
    assert max_difference(whole_parameters(params), reference) <= 1e-12


def train_hybrid(ctx, shard_size):
    """STEPS of ZeRO-3 with hybrid sharding; the largest difference from one process."""
    model = make_model()
    params, sync, optimizer = zero_3(ctx, model, shard_size=shard_size)
    for s in range(STEPS):
        accumulate_share(model, sync, ctx, s, 1)
        step(sync, optimizer)
    reference, _ = train_single_process(STEPS)
    return max_difference(whole_parameters(params), reference)


def test_hybrid_sharding_equals_one_process():
    """Shards over groups of half the ranks (of one rank at 2), their gradients averaged across."""
    ctx = hpcpar.init(device="cpu")
    assert train_hybrid(ctx, max(1, ctx.dp_size // 2)) <= 1e-12


@pytest.mark.parametrize("reshard, accumulate, free_pages", [(True, 1, True), (True, 2, True), (True, 2, False),
                                                              (False, 2, True)])
def test_traffic_is_one_and_a_half_all_reduces_less_the_kept_unit(reshard, accumulate, free_pages):
    """Per step: each bucket reduce-scattered once; each unit gathered once in forward and, when it
    is resharded, once more in backward. The tied embedding and head are one unit kept gathered,
    so the wire bytes are 1.5x DDP's all-reduce less one gather of that unit (exactly, up to each
    call's rounding down to whole bytes); without resharding, DDP's bytes. Accumulating
    micro-batches, a resharded unit is gathered twice per micro-batch, a kept one once a step."""
    ctx = hpcpar.init(device="cpu")
    model = make_model()
    params, sync, optimizer = zero_3(ctx, model, reshard, free_pages=free_pages)
    n, numel = ctx.dp_size, sum(p.size for p in params.params)
    kept = [u for u in params.units if u.shared or not reshard]
    assert [u.name for u in params.units if u.shared] == ["embed+head.ln_f"]
    times = {id(u): 1 if u in kept else 2 * accumulate for u in params.units}  # gathers per step
    for s in range(2):
        ctx.reset_stats()
        accumulate_share(model, sync, ctx, s, accumulate)
        step(sync, optimizer)
        stats = ctx.dp.stats
        assert set(stats.ops) == {"ireduce_scatter", "iallgather"}
        assert stats.calls("ireduce_scatter") == len(sync.buckets) and stats.calls("iallgather") == sum(times.values())
        assert stats.bytes("ireduce_scatter") == numel * 8
        assert stats.bytes("iallgather") == sum((u.end - u.begin) * 8 * times[id(u)] for u in params.units)
        wire = lambda nbytes: (n - 1) * nbytes // n  # noqa: E731  (ring_wire_bytes of either call)
        expected = (sum(wire((b.end - b.begin) * 8) for b in sync.buckets)
                    + sum(wire((u.end - u.begin) * 8) * times[id(u)] for u in params.units))
        assert stats.total_wire_bytes == expected
        if accumulate == 1:
            ddp = 2 * (n - 1) * numel * 8 / n
            less = sum((n - 1) * (u.end - u.begin) * 8 / n for u in kept)
            assert abs(stats.total_wire_bytes - (1.5 * ddp - less)) <= len(sync.buckets) + sum(times.values())


@pytest.mark.parametrize("free_pages", [True, False])
def test_no_whole_parameter_is_kept_between_steps(free_pages):
    """After a step every parameter is a placeholder holding no memory; at most the kept unit and
    two others (the one running, the one prefetched) were gathered at once."""
    ctx = hpcpar.init(device="cpu")
    model = make_model()
    params, sync, optimizer = zero_3(ctx, model, free_pages=free_pages)
    ids, targets = global_batch(0)
    loss = model.loss(ids, targets)
    resharded = [u for u in params.units if not u.shared]
    assert resharded and not any(u.gathered for u in resharded)
    if free_pages:  # the graph's views of a dropped page read zeros until backward gathers the unit again
        assert all(not u.buffer.any() for u in resharded)
    loss.backward()
    step(sync, optimizer)
    assert all(p.data.strides == (0,) * p.ndim and p.grad is None for p in params.params)
    sizes = sorted(((u.end - u.begin) * 8 for u in params.units if not u.shared), reverse=True)
    kept = sum((u.end - u.begin) * 8 for u in params.units if u.shared)
    assert 0 < params.peak_gathered_bytes <= kept + sum(sizes[:2])
    assert not any(u.gathered or u.pending for u in params.units)


@pytest.mark.mpi(min_size=2)
def test_a_rank_dependent_forward_path_is_named_under_debug():
    """Rank 1 runs block 0 twice: its fourth gather (block 0 again) meets rank 0's (block 1, rerun
    in backward). With HPCPAR_DEBUG's check every rank raises, naming the ranks and the units
    they were gathering, before the gathers mix the two."""
    ctx = hpcpar.init(device="cpu")
    model = make_model()
    params, sync, optimizer = zero_3(ctx, model)
    ids, targets = global_batch(0)
    debug.set_enabled(True)
    try:
        with pytest.raises(debug.CollectiveMismatchError) as raised:
            x = model.embed(ids[:2])
            for block in [model.blocks[0]] * (2 if ctx.dp_rank == 1 else 1) + list(model.blocks[1:]):
                x = block(x)
            model.loss_from_logits(model.head(x), targets[:2]).backward()  # rank 0 regathers blocks.1
    finally:
        debug.set_enabled(False)
        params.release_all()
    message = str(raised.value)
    assert "iallgather blocks.1" in message and "iallgather blocks.0" in message and "ranks [1]" in message, message
