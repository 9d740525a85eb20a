"""Data parallelism equals one process with the global batch, in float64, with exact traffic."""
import math
import os

import numpy as np
import pytest

import hpcpar
from dp_reference import GLOBAL_BATCH, global_batch, make_model, make_optimizer, max_difference, train_single_process
from hpcpar.autograd import Parameter
from hpcpar.nn.module import Module
from hpcpar.optim import AdamW
from hpcpar.parallel import DistributedDataParallel
from hpcpar.parallel.zero import ZeroRedundancyOptimizer

pytestmark = pytest.mark.mpi(min_size=1)
STEPS = 3


@pytest.fixture(scope="module")
def reference():
    return train_single_process(STEPS)


def local_rows(ctx, accumulate=1):
    """This dp rank's slice of the global batch, cut into ``accumulate`` micro-batches."""
    per_rank = GLOBAL_BATCH // ctx.dp_size
    start = ctx.dp_rank * per_rank
    micro = per_rank // accumulate
    return [slice(start + i * micro, start + (i + 1) * micro) for i in range(accumulate)]


def train_data_parallel(ctx, bucket_mb=25, overlap=True, accumulate=1, zero=False):
    model = make_model()
    if zero:
        ddp, optimizer = None, ZeroRedundancyOptimizer(model.named_parameters(), ctx.dp, AdamW, lr=1e-2,
                                                       weight_decay=0.1)
    else:
        ddp = DistributedDataParallel(model, ctx, bucket_mb=bucket_mb, overlap=overlap)
        optimizer = make_optimizer(model.named_parameters())
    losses = []
    for step in range(STEPS):
        ids, targets = global_batch(step)
        local_loss = 0.0
        for i, rows in enumerate(local_rows(ctx, accumulate)):
            last = i == accumulate - 1
            loss = model.loss(ids[rows], targets[rows]) * (1.0 / accumulate)
            if ddp is not None and not last:
                with ddp.no_sync():
                    loss.backward()
            else:
                loss.backward()
            local_loss += loss.item()
        if ddp is not None:
            ddp.finish_grad_sync()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(ctx.dp.allreduce(np.array([local_loss]), "mean")[0])
    return {name: p.data.copy() for name, p in model.named_parameters()}, losses, ddp


@pytest.mark.parametrize("bucket_mb, overlap", [(25, True), (25, False), (0, True), (math.inf, True), (0.001, False)])
def test_equals_single_process(reference, bucket_mb, overlap):
    ctx = hpcpar.init(device="cpu")
    params, losses, ddp = train_data_parallel(ctx, bucket_mb, overlap)
    assert max_difference(params, reference[0]) <= 1e-10
    np.testing.assert_allclose(losses, reference[1], rtol=0, atol=1e-12)
    if bucket_mb == 0:
        assert len(ddp.buckets) == len(ddp.params)
    if bucket_mb == math.inf:
        assert len(ddp.buckets) == 1


def test_gradient_accumulation_with_no_sync(reference):
    ctx = hpcpar.init(device="cpu")
    params, losses, _ = train_data_parallel(ctx, accumulate=2)
    assert max_difference(params, reference[0]) <= 1e-10
    np.testing.assert_allclose(losses, reference[1], atol=1e-12)


def test_zero_stage_1(reference):
    ctx = hpcpar.init(device="cpu")
    params, losses, _ = train_data_parallel(ctx, zero=True)
    assert max_difference(params, reference[0]) <= 1e-10
    np.testing.assert_allclose(losses, reference[1], atol=1e-12)


def test_zero_shards_optimizer_state_and_traffic():
    ctx = hpcpar.init(device="cpu")
    model = make_model()
    optimizer = ZeroRedundancyOptimizer(model.named_parameters(), ctx.dp, AdamW, lr=1e-2)
    ids, targets = global_batch(0)
    model.loss(ids, targets).backward()
    ctx.reset_stats()
    optimizer.step()
    numel = sum(p.size for p in model.parameters())
    shard = math.ceil(numel / ctx.dp_size)
    assert optimizer.state_bytes() == 2 * shard * 8  # Adam's two moments, float64, this shard only
    assert optimizer.unsharded_state_bytes() == 2 * numel * 8
    assert ctx.dp.stats.calls("reduce_scatter") == 1 and ctx.dp.stats.bytes("reduce_scatter") == shard * ctx.dp_size * 8
    assert ctx.dp.stats.calls("allgather") == 1 and ctx.dp.stats.bytes("allgather") == shard * 8


@pytest.mark.parametrize("bucket_mb", [0, 0.001, 25])
def test_traffic_per_step_equals_the_bucket_plan(bucket_mb):
    ctx = hpcpar.init(device="cpu")
    model = make_model()
    ddp = DistributedDataParallel(model, ctx, bucket_mb=bucket_mb)
    ids, targets = global_batch(0)
    rows = local_rows(ctx)[0]
    for _ in range(2):
        ctx.reset_stats()
        model.loss(ids[rows], targets[rows]).backward()
        ddp.finish_grad_sync()
        model.zero_grad()
        assert ctx.dp.stats.calls("iallreduce") == len(ddp.buckets)
        assert ctx.dp.stats.bytes("iallreduce") == sum(b["bytes"] for b in ddp.bucket_plan())
        assert ctx.dp.stats.bytes("iallreduce") == sum(p.data.nbytes for p in model.parameters())
        assert set(ctx.dp.stats.ops) == {"iallreduce"}


def test_parameters_are_broadcast_from_dp_rank_0():
    ctx = hpcpar.init(device="cpu")
    model = make_model()
    for p in model.parameters():
        p.data += ctx.dp_rank  # make replicas differ
    DistributedDataParallel(model, ctx)
    reference = make_model()
    assert max_difference({n: p.data for n, p in model.named_parameters()},
                          {n: p.data for n, p in reference.named_parameters()}) == 0


class TwoBranches(Module):
    """Rank-dependent control flow: odd ranks never touch ``b``."""

    def __init__(self):
        super().__init__()
        rng = np.random.default_rng(0)
        self.a = Parameter(rng.standard_normal(3))
        self.b = Parameter(rng.standard_normal(3))

    def loss(self, use_b):
        out = (self.a * self.a).sum()
        return out + (self.b * 3.0).sum() if use_b else out


def test_unused_parameters_contribute_zeros_instead_of_hanging():
    ctx = hpcpar.init(device="cpu")
    model = TwoBranches()
    ddp = DistributedDataParallel(model, ctx, bucket_mb=0)
    model.loss(use_b=ctx.dp_rank % 2 == 0).backward()
    ddp.finish_grad_sync()
    users = len(range(0, ctx.dp_size, 2))
    np.testing.assert_allclose(model.b.grad, np.full(3, 3.0 * users / ctx.dp_size), rtol=1e-14)
    np.testing.assert_allclose(model.a.grad, 2 * model.a.data, rtol=1e-14)


def test_evaluation_counts_every_sample_once_and_equals_one_process():
    """Uneven shards, no padded duplicates: the reduced metric is the single-process mean."""
    from hpcpar.autograd import no_grad
    from hpcpar.data.sampler import DistributedSampler, reduce_metric

    ctx = hpcpar.init(device="cpu")
    model = make_model()
    n = 13  # not a multiple of 2 or 4: the shards differ by one
    ids = np.random.default_rng(5).integers(0, 16, (n, 9))
    with no_grad():
        per_sample = [model.loss(ids[i:i + 1, :-1], ids[i:i + 1, 1:]).item() for i in range(n)]
        mine = DistributedSampler(n, ctx.dp_size, ctx.dp_rank).eval_indices()
        total = sum(per_sample[i] for i in mine)
    assert reduce_metric(ctx.dp, total, len(mine)) == pytest.approx(np.mean(per_sample), abs=1e-12)


def test_one_replica_has_no_gradient_all_reduce_and_unused_parameters_still_get_zeros():
    """At dp = 1 the gradients stay where backward left them (no bucket copies, no staging), and
    a parameter backward did not reach gets zeros, as the all-reduce gives it at dp > 1."""
    from mpi4py import MPI

    from conftest import REPO
    from hpcpar.train.build import build
    from hpcpar.train.config_load import load_job
    from hpcpar.train.loop import start_context, train_one_step
    from hpcpar.parallel.grad_sync import zero_unused_grads
    from hpcpar.train.validate import validate
    if MPI.COMM_WORLD.Get_size() != 1:
        pytest.skip("one replica: the job's grid is the whole world")
    job = validate(load_job(os.path.join(REPO, "jobs", "cnn-digits-dp.toml"), ["train.steps=1", "parallel.zero=0"]), 1)
    run = build(job, start_context(job))
    assert run.strategy.ddp is None and "no gradient all-reduce" in run.strategy.describe()
    run.ctx.dp.stats.reset()
    train_one_step(run, 0)
    assert run.ctx.dp.stats.calls("allreduce") == run.ctx.dp.stats.calls("iallreduce") == 0
    model = TwoBranches()
    model.loss(use_b=False).backward()
    zero_unused_grads(model.named_parameters())
    np.testing.assert_array_equal(model.b.grad, np.zeros(3))
    np.testing.assert_allclose(model.a.grad, 2 * model.a.data, rtol=1e-14)
