"""Pipeline parallelism equals one process (float64), with bounded activations and a full trace."""
import json
import time
from collections import Counter

import numpy as np
import pytest

import hpcpar
from hpcpar.autograd import no_grad
from hpcpar.host import usable_cpus
from hpcpar.nn.gpt import GPT, GPTConfig
from hpcpar.parallel.pipeline import PartitionError, PipelineParallel, partition
from hpcpar.parallel.pipeline.partition import min_max_bounds
from hpcpar.parallel.pipeline.schedules import make_schedule, simulate

CONFIG = GPTConfig(vocab_size=16, block_size=8, n_layer=6, n_head=2, n_embd=8, seed=5)  # 8 layers
BATCH = 8


def batch(seed=0):
    ids = np.random.default_rng(seed).integers(0, CONFIG.vocab_size, (BATCH, CONFIG.block_size + 1))
    return ids[:, :-1], ids[:, 1:]


def reference_gradients():
    model = GPT(CONFIG, dtype=np.float64)
    ids, targets = batch()
    loss = model.loss(ids, targets)
    loss.backward()
    return loss.item(), {name: p.grad for name, p in model.named_parameters()}


def pipeline_step(ctx, schedule, m, part="uniform", chunks=1):
    pipe = PipelineParallel(GPT(CONFIG, dtype=np.float64), ctx, schedule=schedule, micro_batches=m, partition=part, chunks=chunks)
    ids, targets = batch()
    rows = slice(ctx.dp_rank * BATCH // ctx.dp_size, (ctx.dp_rank + 1) * BATCH // ctx.dp_size)
    loss = pipe.train_step(ids[rows], targets[rows])
    return pipe, ctx.dp.allreduce(np.array([loss]), "mean")[0]


def layouts(world):
    size = world.Get_size()
    return [dict(pp=size)] + ([dict(pp=2)] if size == 4 else [])  # pp=2 x dp=2 at 4 ranks


CASES = [("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("zb1", 1)]


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("schedule, chunks", CASES)
@pytest.mark.parametrize("micro", ["fewer", "equal", "more"])
@pytest.mark.parametrize("part", ["uniform", "uneven", "blocks"])
def test_loss_and_every_gradient_equal_one_process(world, schedule, chunks, micro, part):
    ref_loss, ref_grads = reference_gradients()
    for layout in layouts(world):
        ctx = hpcpar.init(device="cpu", **layout)
        p = ctx.pp_size
        per_replica = BATCH // ctx.dp_size
        m = {"fewer": max(1, p // 2), "equal": p, "more": per_replica}[micro]
        if schedule == "interleaved":
            m = {"fewer": p, "equal": p, "more": 2 * p}[micro]  # Megatron's schedule needs m % p == 0
        if per_replica % m or m < 1:
            continue
        stages = p * chunks
        if part == "blocks" and stages > 6:  # Megatron's cut: a block per stage at least (6 of the 8 layers)
            continue
        cut = part if part != "uneven" else [1] * (stages - 1) + [8 - (stages - 1)]  # the last stage gets the rest
        pipe, loss = pipeline_step(ctx, schedule, m, cut, chunks)
        assert abs(loss - ref_loss) <= 1e-12, (layout, loss, ref_loss)
        for name, param in pipe.named_parameters():
            assert np.max(np.abs(param.grad - ref_grads[name])) <= 1e-10, (layout, name)
        names = [n for n, _ in pipe.named_parameters()]
        everyone = set().union(*ctx.pp.allgather_object(set(names)))
        assert everyone == set(ref_grads), "every parameter lives on some stage"


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_peak_live_activations(world, schedule):
    ctx = hpcpar.init(pp=world.Get_size(), device="cpu")
    p, r, m = ctx.pp_size, ctx.pp_rank, BATCH
    pipe, _ = pipeline_step(ctx, schedule, m)
    expected = m if schedule == "gpipe" else min(m, p - r)
    assert pipe.stats["peak_activations"] == expected


@pytest.mark.mpi(min_size=2)
def test_sent_buffers_are_released_during_the_step(world):
    """A completed send is dropped after the action that follows it, not kept to the end of the
    step (a sent gradient has no other holder). A stage's first send has been consumed by its
    neighbour before the neighbour sends anything back, so it completes well before the last."""
    ctx = hpcpar.init(pp=world.Get_size(), device="cpu")
    m = BATCH
    pipe = PipelineParallel(GPT(CONFIG, dtype=np.float64), ctx, schedule="1f1b", micro_batches=m)
    posted, outstanding = [], []  # sends each call posted; sends held after it
    post = pipe._post_send

    def counting_post(*args, **kwargs):
        before = len(pipe._sends)
        post(*args, **kwargs)
        posted.append(len(pipe._sends) - before)
        outstanding.append(len(pipe._sends))
    pipe._post_send = counting_post
    pipe.train_step(*batch())
    assert sum(posted) >= m  # every rank sends activations forward or gradients back
    assert max(outstanding) < sum(posted), (outstanding, sum(posted))


@pytest.mark.mpi(min_size=2)
def test_compression_runs_in_the_pipelines_gradient_reduction(world):
    """A compressor reaches the pipeline's dp reduction: top-k's two all-gathers per bucket
    replace the all-reduce, and at dp = 1 it still changes the gradient, as the all-reduce
    strategy's does (it was once accepted and left unused with pp > 1)."""
    from hpcpar.parallel.compression import TopKCompression

    for layout in layouts(world):
        ctx = hpcpar.init(device="cpu", **layout)
        rows = slice(ctx.dp_rank * BATCH // ctx.dp_size, (ctx.dp_rank + 1) * BATCH // ctx.dp_size)
        grads = []
        for compression in (None, TopKCompression(ratio=0.1)):
            pipe = PipelineParallel(GPT(CONFIG, dtype=np.float64), ctx, micro_batches=2, compression=compression)
            ctx.reset_stats()
            pipe.train_step(*(part[rows] for part in batch()))
            grads.append({name: p.grad.copy() for name, p in pipe.named_parameters()})
        assert ctx.dp.stats.calls("allgather") == 2 * len(pipe.ddp.buckets)
        assert ctx.dp.stats.calls("iallreduce") == ctx.dp.stats.calls("allreduce") == 0
        assert any(not np.array_equal(grads[0][name], grads[1][name]) for name in grads[0])


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("name, options", [("topk", {"ratio": 0.1}), ("powersgd", {"rank": 2})])
def test_tied_weights_are_compressed_alike_on_both_holders(world, name, options):
    """The embedding tied between the first and last stage gets the same compressed gradient on
    both holders, so the copies stay equal: it has a bucket of its own (top-k ranks a bucket's
    entries together) and PowerSGD seeds its Q by shape (once by bucket and slot, which differ)."""
    from hpcpar.parallel.compression import make_compressor

    ctx = hpcpar.init(pp=world.Get_size(), device="cpu")
    pipe = PipelineParallel(GPT(CONFIG, dtype=np.float64), ctx, micro_batches=2, bucket_mb=25,
                            compression=make_compressor(name, **options))
    for seed in range(2):  # the second step uses the error feedback of the first
        pipe.train_step(*batch(seed))
        for comm, _, params in pipe._tied:
            for p in params:
                first, *others = comm.mpi.allgather(p.grad)
                assert all(np.array_equal(first, other) for other in others)
        pipe.zero_grad()
    assert ctx.pp_rank not in (0, ctx.pp_size - 1) or pipe._tied  # the ends hold the tied embedding


@pytest.mark.mpi(min_size=2)
def test_exact_point_to_point_traffic(world):
    ctx = hpcpar.init(pp=world.Get_size(), device="cpu")
    p, r, m = ctx.pp_size, ctx.pp_rank, 4
    ctx.reset_stats()
    pipeline_step(ctx, "1f1b", m)
    activation = (BATCH // m) * CONFIG.block_size * CONFIG.n_embd * 8
    sends = (r < p - 1) * (m + 1) + (r > 0) * m  # activations + one header forward, gradients back
    assert ctx.pp.stats.calls("isend") == sends
    assert ctx.pp.stats.bytes("isend") == (r < p - 1) * (m * activation + 64) + (r > 0) * m * activation
    assert ctx.pp.stats.calls("irecv") == (r > 0) * m + (r < p - 1) * m


@pytest.mark.mpi(min_size=2)
def test_trace_holds_every_action_of_every_rank(world, tmp_path_factory):
    ctx = hpcpar.init(pp=world.Get_size(), device="cpu")
    pipe, _ = pipeline_step(ctx, "1f1b", 4)
    path = str(tmp_path_factory.mktemp("trace") / "trace.json") if ctx.rank == 0 else None
    path = world.bcast(path)
    pipe.write_trace(path)
    names = world.allgather([str(a) for a in pipe.actions])
    if ctx.rank == 0:
        with open(path) as f:
            events = json.load(f)["traceEvents"]
        for rank, actions in enumerate(names):  # one process per rank; its actions in order, then SYNC
            recorded = [e["name"] for e in events if e.get("pid") == rank and e["ph"] == "X" and e["cat"] != "step"]
            assert recorded[:len(actions)] == actions and recorded[-1] == "SYNC"
    assert pipe.stats["compute_s"] > 0  # the bubble: test_measured_bubble_is_what_the_simulator_predicts


# ----- the bubble: measured against the simulator ------------------------------------------

# Actions of tens of ms, so that message latency (which the simulator leaves out) is small beside them.
BUBBLE_CONFIG = GPTConfig(vocab_size=64, block_size=64, n_layer=6, n_head=4, n_embd=256, seed=5)
BUBBLE_BATCH, BUBBLE_STEPS = 16, 5
# The measured bubble must be within this factor of the prediction, either way. Measured at 2 ranks
# on 2 cores (other jobs running): 1.1-1.5x the prediction for gpipe, 1f1b, interleaved and zb1.
BUBBLE_FACTOR = 2.0
# Another process taking a core for a moment stretches one measurement (seen once: zb1 at 2.3x
# under load 5); a regression stretches every one. The check passes on the first of these
# attempts that is within the factor.
BUBBLE_ATTEMPTS = 3


def one_core_per_stage(world) -> None:
    """The simulator gives every stage a processor; ranks that share cores run their actions in
    turns, which no schedule predicts."""
    if world.Get_size() > usable_cpus():
        pytest.skip(f"{world.Get_size()} pipeline ranks on {usable_cpus()} usable CPUs")


def step_bubble(pipe, ctx, ids, targets) -> tuple[float, float]:
    """(measured, predicted) bubble of one step. Measured as the simulator defines it, 1 - busy /
    (ranks x makespan): busy is each rank's compute (its F, B and W less any wait for their
    input), the makespan from the first rank's start to the last compute's end (one clock: all
    ranks are on this machine). Predicted: ``simulate`` of the schedule with the step's mean
    F, B and W times (collective over pp)."""
    ctx.pp.mpi.Barrier()  # the ranks start the step together, as the simulator's do
    pipe.train_step(ids, targets)
    last = max(end for action, (_, _, end) in zip(pipe.actions, pipe.trace) if action.is_compute)
    stats = pipe.stats
    everyone = ctx.pp.allgather_object((stats["step_start"], last, stats["compute_by_kind"]))
    makespan = max(e[1] for e in everyone) - min(e[0] for e in everyone)
    busy = {kind: sum(e[2][kind] for e in everyone) for kind in ("F", "B", "W")}
    measured = 1.0 - sum(busy.values()) / (pipe.p * makespan)
    schedule = make_schedule(pipe.schedule_name, pipe.p, pipe.m, pipe.v)
    count = Counter(action.kind for actions in schedule for action in actions)
    mean = {kind: busy[kind] / count[kind] if count[kind] else 0.0 for kind in busy}  # one action, one chunk
    forward, weight = pipe.v * mean["F"], pipe.v * mean["W"]  # a micro-batch through a rank's whole share
    predicted = simulate(schedule, forward, pipe.v * mean["B"] + weight, weight_time=weight).bubble
    return measured, predicted


def within_bubble_factor(measured: float, predicted: float) -> bool:
    return predicted / BUBBLE_FACTOR <= measured <= predicted * BUBBLE_FACTOR


def check_bubble(measured: float, predicted: float) -> None:
    """Within BUBBLE_FACTOR of the prediction, either way."""
    assert within_bubble_factor(measured, predicted), \
        f"measured bubble {measured:.3f}, the simulator predicts {predicted:.3f} for these action times"


class SlowWait:
    """A receive whose wait takes ``delay`` seconds longer than its message."""

    def __init__(self, handle, delay: float):
        self.handle, self.delay = handle, delay

    def wait(self):
        time.sleep(self.delay)
        return self.handle.wait()


def slow_down_receives(pipe, delay: float) -> None:
    post = pipe._post_recv

    def slow(*args):
        handle, dtype = post(*args)
        return SlowWait(handle, delay), dtype

    pipe._post_recv = slow


def measured_bubbles(world, schedule, chunks, plant=None) -> tuple[float, float]:
    """Medians over BUBBLE_STEPS steps of (measured, predicted); ``plant(pipe)`` plants a regression."""
    ctx = hpcpar.init(pp=world.Get_size(), device="cpu")
    pipe = PipelineParallel(GPT(BUBBLE_CONFIG, dtype=np.float32), ctx, schedule=schedule, chunks=chunks,
                            micro_batches=2 * ctx.pp_size)
    if plant is not None:
        plant(pipe)
    ids = np.random.default_rng(0).integers(0, BUBBLE_CONFIG.vocab_size, (BUBBLE_BATCH, BUBBLE_CONFIG.block_size + 1))
    pairs = [step_bubble(pipe, ctx, ids[:, :-1], ids[:, 1:]) for _ in range(BUBBLE_STEPS + 1)][1:]  # one warm-up
    return tuple(float(np.median(values)) for values in zip(*pairs))


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("schedule, chunks", CASES)
def test_measured_bubble_is_what_the_simulator_predicts(world, schedule, chunks):
    one_core_per_stage(world)
    for _ in range(BUBBLE_ATTEMPTS):  # rank 0's verdict for all, so every rank measures as often
        measured, predicted = measured_bubbles(world, schedule, chunks)
        if world.bcast(within_bubble_factor(measured, predicted), root=0):
            break
    if world.Get_rank() == 0:
        print(f"\n{schedule} p={world.Get_size()}: measured bubble {measured:.3f}, predicted {predicted:.3f}")
    check_bubble(measured, predicted)


@pytest.mark.mpi(min_size=2)
def test_the_bubble_check_fails_when_receives_wait_longer_than_the_schedule_explains(world):
    """A planted regression: every wait for a message takes 200 ms longer than the message (a wait
    policy that sleeps far too long, say; measured: bubble 0.68 against 0.20 predicted). The actions
    take as long as before, so the prediction stays and the measured bubble grows."""
    one_core_per_stage(world)
    measured, predicted = measured_bubbles(world, "1f1b", 1, lambda pipe: slow_down_receives(pipe, 0.2))
    with pytest.raises(AssertionError, match="measured bubble"):
        check_bubble(measured, predicted)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("schedule, chunks", [("1f1b", 1), ("interleaved", 2)])
def test_pipelined_inference_streams_batches(world, schedule, chunks):
    ctx = hpcpar.init(pp=world.Get_size(), device="cpu")
    pipe = PipelineParallel(GPT(CONFIG, dtype=np.float64), ctx, schedule=schedule, chunks=chunks,
                            micro_batches=ctx.pp_size)
    batches = [batch(seed)[0] for seed in range(4)]
    outputs = pipe.infer(batches)
    if ctx.is_last_stage:  # with chunks the last virtual stage is on the last rank too
        reference = GPT(CONFIG, dtype=np.float64)
        with no_grad():
            for ids, out in zip(batches, outputs):
                np.testing.assert_allclose(out, reference(ids).data, rtol=0, atol=1e-12)
    else:
        assert outputs is None


@pytest.mark.mpi(min_size=2)
def test_fp16_on_the_wire_stays_close(world):
    ctx = hpcpar.init(pp=world.Get_size(), device="cpu")
    ref_loss, _ = reference_gradients()
    pipe = PipelineParallel(GPT(CONFIG, dtype=np.float64), ctx, micro_batches=4,
                            wire_dtype="float16")
    ids, targets = batch()
    assert abs(pipe.train_step(ids, targets) - ref_loss) < 1e-2


# ----- partitioning (serial) -----------------------------------------------------------
def test_partition_methods():
    model = GPT(CONFIG, dtype=np.float64)
    layers = model.layers()
    assert partition(layers, 3, "uniform") == [0, 3, 6, 8]
    assert partition(layers, 3, "blocks") == [0, 3, 5, 8]  # 2 blocks each, the embedding and the head at the ends
    assert partition(layers, 2, [3, 5]) == [0, 3, 8]
    bounds = partition(layers, 2, "parameters")
    assert bounds[0] == 0 and bounds[-1] == 8 and len(bounds) == 3
    assert min_max_bounds([1, 1, 1, 10], 2) == [0, 3, 4]
    costs = [5, 1, 1, 1, 1, 1]
    bounds = min_max_bounds(costs, 3)
    assert bounds[0] == 0 and bounds[1] == 1 and max(sum(costs[a:b]) for a, b in zip(bounds, bounds[1:])) == 5
    ids, _ = batch()
    assert partition(layers, 4, "balanced", sample_input=ids)[-1] == 8


@pytest.mark.mpi(min_size=2)
def test_balanced_partition_is_the_same_on_every_rank(world, monkeypatch):
    """Each rank measured its own layer times and cut by them: ranks that measured differently held
    different layers (some trained by none, missing from the checkpoint: a resume failed with 'the
    checkpoint has no tensor model/blocks.2...'). Every rank now cuts by world rank 0's costs."""
    import importlib

    partition_module = importlib.import_module("hpcpar.parallel.pipeline.partition")  # the module, not the function
    rank = world.Get_rank()
    costs = [1.0] * 8
    costs[rank % 8] = 50.0  # each rank finds another layer slow
    monkeypatch.setattr(partition_module, "measure_layer_costs", lambda layers, sample_input: list(costs))
    ctx = hpcpar.init(device="cpu", pp=world.Get_size())
    ids, _ = batch()
    pipe = PipelineParallel(GPT(CONFIG, dtype=np.float64), ctx, schedule="1f1b", micro_batches=2, partition="balanced",
                            sample_input=ids[:4])
    everyone = world.allgather(list(pipe.bounds))
    assert all(bounds == everyone[0] for bounds in everyone), everyone
    assert everyone[0] == min_max_bounds([50.0] + [1.0] * 7, world.Get_size())  # rank 0's measurement


@pytest.mark.parametrize("args, message", [
    ((9, "uniform"), "cannot cut 8 layers into 9 stages"),
    ((2, [3, 4]), r"add up to 7, but there are 8 layers"),
    ((2, [8, 0]), "every stage needs at least one layer"),
    ((3, [4, 4]), "2 per-stage layer counts given for 3 stages"),
    ((2, "random"), "partition method must be one of"),
    ((2, "balanced"), "pass sample_input"),
])
def test_impossible_partitions_are_clear_errors(args, message):
    with pytest.raises(PartitionError, match=message):
        partition(GPT(CONFIG, dtype=np.float64).layers(), *args)

