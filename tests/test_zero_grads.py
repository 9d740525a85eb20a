"""ZeRO-2's gradient sync (``parallel.zero_grads``) at any dp: equal to one process in float64,
the traffic of its bucket plan exactly, no whole gradient kept, and rank-dependent paths
contribute zeros instead of hanging."""
import math

import numpy as np
import pytest

import hpcpar
from dp_reference import accumulate_share, global_batch, make_model, max_difference, train_single_process
from hpcpar.optim import AdamW
from hpcpar.parallel.zero import ZeroRedundancyOptimizer
from hpcpar.parallel.zero_grads import IN_FLIGHT, BucketedReduceScatter
from test_data_parallel import TwoBranches

pytestmark = pytest.mark.mpi(min_size=1)
STEPS = 3


def zero_2(ctx, model, bucket_mb=25, overlap=True):
    sync = BucketedReduceScatter(model, ctx, bucket_mb=bucket_mb, overlap=overlap, dtype=np.float64)
    optimizer = ZeroRedundancyOptimizer(model.named_parameters(), ctx.dp, AdamW, lr=1e-2, weight_decay=0.1)
    sync.check_layout(optimizer)
    return sync, optimizer


def step(sync, optimizer):
    sync.finish()
    optimizer.shard.grad = sync.take_shard_gradient()
    optimizer.step(reduce=False)


@pytest.mark.parametrize("bucket_mb, overlap, accumulate", [(25, True, 1), (0, True, 1), (0.001, False, 2),
                                                            (math.inf, True, 2)])
def test_zero_2_equals_one_process(bucket_mb, overlap, accumulate):
    ctx = hpcpar.init(device="cpu")
    model = make_model()
    sync, optimizer = zero_2(ctx, model, bucket_mb, overlap)
    for s in range(STEPS):
        accumulate_share(model, sync, ctx, s, accumulate)
        step(sync, optimizer)
    reference, _ = train_single_process(STEPS)
    assert max_difference({n: p.data for n, p in model.named_parameters()}, reference) <= 1e-12


@pytest.mark.parametrize("bucket_mb", [0, 0.001, 25])
def test_traffic_is_the_bucket_plan_and_an_all_reduces_bytes(bucket_mb):
    """One reduce-scatter per bucket of the bucket's bytes and one all-gather of the shard: the
    wire bytes of DDP's all-reduce of the same parameters, apart from the shard's padding and each
    call's rounding down to whole bytes."""
    ctx = hpcpar.init(device="cpu")
    model = make_model()
    sync, optimizer = zero_2(ctx, model, bucket_mb)
    ids, targets = global_batch(0)
    n, numel = ctx.dp_size, sum(p.size for p in model.parameters())
    for _ in range(2):
        ctx.reset_stats()
        model.loss(ids, targets).backward()
        step(sync, optimizer)
        stats = ctx.dp.stats
        assert stats.calls("ireduce_scatter") == len(sync.buckets) and stats.calls("allgather") == 1
        assert stats.bytes("ireduce_scatter") == numel * 8 and stats.bytes("allgather") == sync.shard_size * 8
        assert set(stats.ops) == {"ireduce_scatter", "allgather"}
        bucket_wire = sum((n - 1) * (b.end - b.begin) * 8 // n for b in sync.buckets)
        assert stats.total_wire_bytes == bucket_wire + (n - 1) * sync.shard_size * 8 * (n > 1)
        ddp_wire = 2 * (n - 1) * numel * 8 // n
        assert abs(stats.total_wire_bytes - ddp_wire) <= 8 * (n - 1) * (sync.shard_size * n - numel + 1) + len(sync.buckets)


def test_no_whole_gradient_is_kept():
    """After backward every parameter's gradient is freed; what stays is the shard, and at most
    IN_FLIGHT buckets (and the one filling) were alive at once."""
    ctx = hpcpar.init(device="cpu")
    model = make_model()
    sync, optimizer = zero_2(ctx, model, bucket_mb=0.001)
    ids, targets = global_batch(0)
    model.loss(ids, targets).backward()
    assert all(p.grad is None for p in model.parameters())
    sync.finish()
    largest = max(b.end - b.begin for b in sync.buckets) * 8
    assert len(sync.buckets) > IN_FLIGHT + 1 and sync.peak_bucket_bytes <= (IN_FLIGHT + 1) * largest
    assert all(b.flat is None for b in sync.buckets)
    grad = sync.take_shard_gradient()
    assert grad.size == sync.shard_size == math.ceil(sum(p.size for p in model.parameters()) / ctx.dp_size)


def test_an_unused_parameter_on_some_ranks_contributes_zeros_instead_of_hanging():
    ctx = hpcpar.init(device="cpu")
    model = TwoBranches()
    sync, optimizer = zero_2(ctx, model, bucket_mb=0)
    model.loss(use_b=ctx.dp_rank % 2 == 0).backward()
    sync.finish()
    whole = ctx.dp.allgather(sync.take_shard_gradient()).reshape(-1)[:6]  # a's 3, then b's 3
    users = len(range(0, ctx.dp_size, 2))
    np.testing.assert_allclose(whole[3:], np.full(3, 3.0 * users / ctx.dp_size), rtol=1e-14)
    np.testing.assert_allclose(whole[:3], 2 * model.a.data, rtol=1e-14)
