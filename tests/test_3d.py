"""3D parallelism: K training steps under every dp x pp x tp layout equal one process (float64).

The model is ``PipelineParallel(GPT(config, tp=ctx.tp), ctx)``: tensor parallelism inside the
layers, pipeline stages across pp, gradient averaging across dp; gradients are clipped by the
global norm (each element counted once across tp and pp) before AdamW, or ZeRO-1's sharded AdamW.
With dropout, every layout and schedule draws the masks one process draws (keyed by step and
sample: ``hpcpar.nn.dropout_keys``).
"""
import functools

import numpy as np
import pytest
from mpi4py import MPI

import hpcpar
from hpcpar import checkpoint
from hpcpar.state import global_slab, slab_slices
from hpcpar.nn import DropoutKey, dropout_key
from hpcpar.nn.gpt import GPT, GPTConfig
from hpcpar.optim import AdamW, clip_grad_norm
from hpcpar.parallel.pipeline import PipelineParallel
from hpcpar.parallel.grad_norm import clip_grad_norm_parallel, counts_toward_norm, sum_over_model_parallel
from hpcpar.parallel.zero import ZeroRedundancyOptimizer

CONFIG = GPTConfig(vocab_size=16, block_size=8, n_layer=2, n_head=4, n_embd=16, seed=21)
STEPS, BATCH, MICRO, CLIP = 3, 8, 2, 0.5
NO_DECAY = ("*.bias", "*ln_*", "embed.*")  # the job default: no decay of biases, norms, embeddings


def data(step):
    ids = np.random.default_rng(500 + step).integers(0, CONFIG.vocab_size, (BATCH, CONFIG.block_size + 1))
    return ids[:, :-1], ids[:, 1:]


def reference(no_decay=(), config=CONFIG, steps=STEPS):
    model = GPT(config, np.float64)
    optimizer = AdamW(model.named_parameters(), lr=1e-2, weight_decay=0.1, no_decay=no_decay)
    losses = []
    for step in range(steps):
        with dropout_key(DropoutKey(step)):  # the whole batch: samples 0 .. BATCH - 1 of the step
            loss = model.loss(*data(step))
        loss.backward()
        clip_grad_norm(model.parameters(), CLIP)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return dict(model.named_parameters()), losses


def build(ctx, zero=False, sequence_parallel=False, no_decay=(), config=CONFIG, schedule="1f1b"):
    """The 3D model and AdamW; with ``zero`` the optimizer state is sharded over dp (ZeRO-1),
    which then does the dp reduction of gradients instead of the pipeline."""
    model = GPT(config, np.float64, tp=ctx.tp)
    model.sequence_parallel = sequence_parallel
    pipe = PipelineParallel(model, ctx, schedule=schedule, micro_batches=MICRO, dp_average=not zero,
                            chunks=2 if schedule == "interleaved" else 1)
    if zero:
        return pipe, ZeroRedundancyOptimizer(pipe.named_parameters(), ctx.dp, AdamW, lr=1e-2, weight_decay=0.1,
                                             no_decay=no_decay)
    return pipe, AdamW(pipe.named_parameters(), lr=1e-2, weight_decay=0.1, no_decay=no_decay)


def clip_and_step(pipe, optimizer, ctx):
    if isinstance(optimizer, ZeroRedundancyOptimizer):  # each rank clips its shard by the global norm
        optimizer.reduce_gradients()
        optimizer.clip_grad_norm(CLIP, counts=lambda p: counts_toward_norm(p, ctx, pipe.owns_for_norm),
                                 model_parallel_sum=sum_over_model_parallel(ctx))
        optimizer.step(reduce=False)
    else:
        clip_grad_norm_parallel(pipe.named_parameters(), CLIP, ctx, owns=pipe.owns_for_norm)
        optimizer.step()
    optimizer.zero_grad()


def train(ctx, steps=range(STEPS), built=None):
    pipe, optimizer = built or build(ctx)
    rows = slice(ctx.dp_rank * BATCH // ctx.dp_size, (ctx.dp_rank + 1) * BATCH // ctx.dp_size)
    losses = []
    for step in steps:
        ids, targets = data(step)
        with dropout_key(DropoutKey(step, rows.start)):  # this replica's rows of the step's global batch
            loss = pipe.train_step(ids[rows], targets[rows])
        clip_and_step(pipe, optimizer, ctx)
        losses.append(ctx.dp.allreduce(np.array([loss]), "mean")[0])
    return pipe, losses


def assert_resume_is_bitwise(ctx, root, save_at, steps, make):
    """Trained straight for ``steps`` and saved at ``save_at``, resumed into a fresh ``make()``: bit for bit the same."""
    straight, _ = train(ctx, range(steps), make())
    pipe, optimizer = make()
    train(ctx, range(save_at), (pipe, optimizer))
    checkpoint.save(root, save_at, pipe, optimizer, ctx)
    pipe, optimizer = make()
    checkpoint.load(root, pipe, optimizer, ctx)
    resumed, _ = train(ctx, range(save_at, steps), (pipe, optimizer))
    for (name, a), (_, b) in zip(straight.named_parameters(), resumed.named_parameters()):
        np.testing.assert_array_equal(a.data, b.data, err_msg=name)


def layout_context(world, dp, pp, tp):
    """A context over the first dp*pp*tp ranks of the world (None on the others)."""
    group = world.Split(0 if world.Get_rank() < dp * pp * tp else MPI.UNDEFINED, world.Get_rank())
    return None if group == MPI.COMM_NULL else hpcpar.init(dp=dp, pp=pp, tp=tp, comm=group, device="cpu")


def assert_matches(pipe, losses, expected_params, expected_losses, label, tol=1e-10):
    np.testing.assert_allclose(losses, expected_losses, rtol=0, atol=1e-12, err_msg=label)
    for name, p in pipe.named_parameters():
        _, slab = global_slab(p)
        diff = np.max(np.abs(p.data - expected_params[name].data[slab_slices(slab)]))
        assert diff <= tol, (label, name, diff)


def max_difference(pipe, losses, expected_params, expected_losses) -> float:
    """The largest |difference| of this rank's parameters and of the losses from one process's."""
    diffs = [np.max(np.abs(np.subtract(losses, expected_losses)))]
    for name, p in pipe.named_parameters():
        _, slab = global_slab(p)
        diffs.append(np.max(np.abs(p.data - expected_params[name].data[slab_slices(slab)])))
    return float(max(diffs))


def check_layout(world, dp, pp, tp, zero=False, sequence_parallel=False, no_decay=()):
    ctx = layout_context(world, dp, pp, tp)
    if ctx is not None:
        params, ref_losses = reference(no_decay)
        pipe, losses = train(ctx, built=build(ctx, zero, sequence_parallel, no_decay))
        label = f"{dp}x{pp}x{tp}{' zero' if zero else ''}{' sequence-parallel' if sequence_parallel else ''}"
        assert_matches(pipe, losses, params, ref_losses, label)
    world.Barrier()


@pytest.mark.mpi(min_size=4)
@pytest.mark.parametrize("layout", [(1, 1, 1), (2, 1, 1), (1, 2, 1), (1, 1, 2), (2, 2, 1), (2, 1, 2), (1, 2, 2),
                                    (4, 1, 1), (1, 4, 1), (1, 1, 4)])
def test_layouts_on_four_ranks_equal_one_process(world, layout):
    check_layout(world, *layout)


@pytest.mark.mpi(min_size=4)
@pytest.mark.parametrize("layout", [(2, 2, 1), (2, 1, 2), (4, 1, 1)])
def test_zero_1_with_clipping_on_four_ranks_equals_one_process(world, layout):
    """ZeRO-1's clip counts tp-replicated and tied weights once and completes the norm over tp and pp."""
    check_layout(world, *layout, zero=True)


@pytest.mark.mpi(min_size=4)
@pytest.mark.parametrize("layout", [(1, 2, 2), (2, 1, 2), (1, 1, 4)])
def test_sequence_parallel_on_four_ranks_equals_one_process(world, layout):
    check_layout(world, *layout, sequence_parallel=True)


@pytest.mark.mpi(min_size=8)
@pytest.mark.parametrize("zero, sequence_parallel", [(False, False), (True, False), (False, True)])
def test_2x2x2_equals_one_process(world, zero, sequence_parallel):
    check_layout(world, 2, 2, 2, zero, sequence_parallel)


# ----- dropout: the same masks in every layout and schedule -------------------------------------

DROPOUT_CONFIG = GPTConfig(**{**CONFIG.to_dict(), "dropout": 0.1})
DROPOUT_STEPS = 5
ALL_LAYOUTS = [(1, 1, 1), (2, 1, 1), (1, 2, 1), (1, 1, 2), (2, 2, 1), (2, 1, 2), (1, 2, 2), (2, 2, 2)]
# the eight layouts packed onto 8 ranks in four rounds, the layouts of a round side by side
ROUNDS = [[(2, 2, 2)], [(2, 2, 1), (2, 1, 2)], [(1, 2, 2), (2, 1, 1), (1, 2, 1)], [(1, 1, 2), (1, 1, 1)]]


@functools.cache
def dropout_reference():
    return reference(config=DROPOUT_CONFIG, steps=DROPOUT_STEPS)


def side_by_side(world, layouts, job) -> dict:
    """``job(ctx)`` of each layout on its own ranks (packed from rank 0), at once; {layout: the
    largest of its ranks' results} on every rank."""
    starts = np.cumsum([0] + [dp * pp * tp for dp, pp, tp in layouts])
    assert starts[-1] <= world.Get_size()
    rank = world.Get_rank()
    mine = next((k for k in range(len(layouts)) if starts[k] <= rank < starts[k + 1]), None)
    group = world.Split(MPI.UNDEFINED if mine is None else mine, rank)
    result = None
    if mine is not None:
        result = job(hpcpar.init(dp=layouts[mine][0], pp=layouts[mine][1], tp=layouts[mine][2], comm=group,
                                 device="cpu"))
    results = world.allgather((mine, result))
    return {layout: max(r for k, r in results if k == index) for index, layout in enumerate(layouts)}


def dropout_difference(ctx, schedule, zero=False, sequence_parallel=False) -> float:
    params, ref_losses = dropout_reference()
    pipe, losses = train(ctx, range(DROPOUT_STEPS), build(ctx, zero, sequence_parallel, config=DROPOUT_CONFIG,
                                                         schedule=schedule))
    return max_difference(pipe, losses, params, ref_losses)


@pytest.mark.mpi(min_size=8)
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "interleaved", "zb1"])
def test_dropout_is_the_same_in_all_eight_layouts(world, schedule):
    """Dropout 0.1, 5 steps: each of the 8 layouts (dp, pp, tp in {1, 2}) under ``schedule`` equals
    one process to 1e-10 (parameters and losses)."""
    differences = {}
    for layouts in ROUNDS:
        differences.update(side_by_side(world, layouts, lambda ctx: dropout_difference(ctx, schedule)))
    assert sorted(differences) == sorted(ALL_LAYOUTS)
    if world.Get_rank() == 0:  # the table of the closing note (pytest -s shows it)
        print("".join(f"\n{schedule:12s} {dp}x{pp}x{tp}  max |difference| {d:.1e}" for (dp, pp, tp), d in
                      sorted(differences.items())))
    assert max(differences.values()) <= 1e-10, differences


@pytest.mark.mpi(min_size=8)
def test_dropout_with_sequence_parallelism_and_zero_is_the_same_in_every_layout(world):
    """The tp layouts with sequence parallelism (each rank draws its positions of the sequence)
    and ZeRO-1, interleaved: equal to one process with dropout."""
    rounds = [[(2, 2, 2)], [(2, 1, 2), (1, 2, 2)]]
    for layouts in rounds:
        for zero, sequence_parallel in ((False, True), (True, True)):
            differences = side_by_side(world, layouts, lambda ctx: dropout_difference(
                ctx, "interleaved", zero=zero, sequence_parallel=sequence_parallel))
            assert max(differences.values()) <= 1e-10, (zero, sequence_parallel, differences)


@pytest.mark.mpi(min_size=4)
def test_dropout_resumes_bitwise_and_in_another_layout(world, tmp_path_factory):
    """Dropout 0.1, saved after step 2 on 2x1x2: resumed there, bit for bit the uninterrupted run;
    resumed on 1x2x2 (zb1), equal to one process. No random state is saved: the masks come from
    the step and the rows."""
    root = world.bcast(str(tmp_path_factory.mktemp("ckpt-dropout")) if world.Get_rank() == 0 else None)
    params, ref_losses = dropout_reference()
    ctx = layout_context(world, 2, 1, 2)
    if ctx is not None:
        assert_resume_is_bitwise(ctx, root, 2, DROPOUT_STEPS, lambda: build(ctx, config=DROPOUT_CONFIG))
    world.Barrier()
    ctx = layout_context(world, 1, 2, 2)
    if ctx is not None:
        pipe, optimizer = build(ctx, config=DROPOUT_CONFIG, schedule="zb1")
        checkpoint.load(root, pipe, optimizer, ctx)
        _, losses = train(ctx, range(2, DROPOUT_STEPS), (pipe, optimizer))
        assert_matches(pipe, losses, params, ref_losses[2:], "2x1x2 -> 1x2x2 with dropout")
    world.Barrier()


@pytest.mark.mpi(min_size=4)
@pytest.mark.parametrize("saved, loaded", [((1, 2, 2), (2, 1, 1)), ((2, 1, 2), (1, 2, 2)), ((1, 1, 1), (1, 4, 1)),
                                           ((4, 1, 1), (1, 1, 4))])
def test_checkpoint_moves_between_3d_layouts(world, tmp_path_factory, saved, loaded):
    """Save after one step in one layout, load into another, finish: equals one process (1e-12)."""
    root = world.bcast(str(tmp_path_factory.mktemp("ckpt3d")) if world.Get_rank() == 0 else None)
    params, ref_losses = reference()
    ctx = layout_context(world, *saved)
    if ctx is not None:
        pipe, optimizer = build(ctx)
        train(ctx, range(1), (pipe, optimizer))
        checkpoint.save(root, 1, pipe, optimizer, ctx)
    world.Barrier()
    ctx = layout_context(world, *loaded)
    if ctx is not None:
        pipe, optimizer = build(ctx)
        assert checkpoint.load(root, pipe, optimizer, ctx)["layout"]["tp"] == saved[2]
        _, losses = train(ctx, range(1, STEPS), (pipe, optimizer))
        assert_matches(pipe, losses, params, ref_losses[1:], f"{saved} -> {loaded}", tol=1e-12)
    world.Barrier()


@pytest.mark.mpi(min_size=4)
@pytest.mark.parametrize("layout, zero", [((2, 1, 2), True), ((2, 2, 1), True), ((1, 2, 2), False), ((4, 1, 1), True)])
def test_weight_decay_groups_in_3d_equal_one_process(world, layout, zero):
    """Groups by name: ZeRO-1's runs along its shard, tp shards and pp stages decay as one process does."""
    check_layout(world, *layout, zero=zero, no_decay=NO_DECAY)


@pytest.mark.mpi(min_size=4)
def test_checkpoint_keeps_weight_decay_groups_in_any_layout(world, tmp_path_factory):
    """Saved by ZeRO-1 on 2x1x2: resumed there bitwise, and in 1x2x2 by an optimizer built without the
    groups (they come from the checkpoint), equal to one process with the groups."""
    root = world.bcast(str(tmp_path_factory.mktemp("ckpt-groups")) if world.Get_rank() == 0 else None)
    params, ref_losses = reference(NO_DECAY)
    ctx = layout_context(world, 2, 1, 2)
    if ctx is not None:
        assert_resume_is_bitwise(ctx, root, 1, STEPS, lambda: build(ctx, zero=True, no_decay=NO_DECAY))
    world.Barrier()
    ctx = layout_context(world, 1, 2, 2)
    if ctx is not None:
        pipe, optimizer = build(ctx)  # every parameter decays ... until the checkpoint's groups are loaded
        checkpoint.load(root, pipe, optimizer, ctx)
        assert all(optimizer.named_weight_decays()[name] == (0.0 if name.endswith(".bias") or ".ln_" in name
                                                              or name.startswith("embed.") else 0.1)
                   for name, _ in pipe.named_parameters())
        _, losses = train(ctx, range(1, STEPS), (pipe, optimizer))
        assert_matches(pipe, losses, params, ref_losses[1:], "2x1x2 zero -> 1x2x2", tol=1e-12)
    world.Barrier()


def build_bf16(ctx):
    """2x2x2 in bfloat16: sequence parallelism, float32 masters in ZeRO-1's flat buffer, groups."""
    import ml_dtypes

    from hpcpar.optim import MixedPrecision

    model = GPT(CONFIG, ml_dtypes.bfloat16, tp=ctx.tp)
    model.sequence_parallel = True
    pipe = PipelineParallel(model, ctx, schedule="1f1b", micro_batches=MICRO, dp_average=False)
    amp = MixedPrecision(pipe.named_parameters(), scaler=None)
    pipe.backward_loss = amp.backward
    zero = ZeroRedundancyOptimizer(amp.named_master_parameters(), ctx.dp, AdamW, lr=1e-2, weight_decay=0.1,
                                   no_decay=NO_DECAY)
    amp.copy_to_model()
    return pipe, amp, zero


def train_bf16(ctx, built, steps):
    """What the training loop does under mixed precision with ZeRO-1: unscale, reduce-scatter, clip the
    shard by the global norm (each master counted where its model parameter is), skip or step."""
    pipe, amp, zero = built
    rows = slice(ctx.dp_rank * BATCH // ctx.dp_size, (ctx.dp_rank + 1) * BATCH // ctx.dp_size)
    model_param = {id(master): param for (_, master), param in zip(amp.master, amp.model_params)}
    counts = lambda master: counts_toward_norm(master, ctx, lambda m: pipe.owns_for_norm(model_param[id(m)]))  # noqa: E731
    losses = []
    for step in steps:
        ids, targets = data(step)
        loss = pipe.train_step(ids[rows], targets[rows])
        amp.unscale_grads()
        zero.reduce_gradients()
        zero.clip_grad_norm(CLIP, counts=counts, model_parallel_sum=sum_over_model_parallel(ctx))
        assert amp.step(zero, loss=loss, reduce=False,
                        allreduce_max=lambda v: float(ctx.world.allreduce(np.array([v]), "max")[0])).taken
        losses.append(ctx.dp.allreduce(np.array([loss]), "mean")[0])
    return losses


@pytest.mark.mpi(min_size=8)
def test_2x2x2_bf16_with_zero_and_sequence_parallelism_trains_and_resumes_bitwise(world, tmp_path_factory):
    """Losses within 2% of one float64 process; stopped after step 1 and resumed from its checkpoint,
    the float32 masters end bit for bit where the uninterrupted run's do."""
    pytest.importorskip("ml_dtypes")
    root = world.bcast(str(tmp_path_factory.mktemp("ckpt-bf16")) if world.Get_rank() == 0 else None)
    _, ref_losses = reference(NO_DECAY)
    ctx = layout_context(world, 2, 2, 2)
    if ctx is not None:
        straight = build_bf16(ctx)
        losses = train_bf16(ctx, straight, range(STEPS))
        np.testing.assert_allclose(losses, ref_losses, rtol=2e-2)
        assert all(p.dtype.name == "bfloat16" for _, p in straight[0].named_parameters())
        first = build_bf16(ctx)
        train_bf16(ctx, first, range(1))
        checkpoint.save(root, 1, first[1].named_master_parameters(), first[2], ctx)
        resumed = build_bf16(ctx)
        checkpoint.load(root, resumed[1].named_master_parameters(), resumed[2], ctx)
        resumed[1].copy_to_model()
        assert train_bf16(ctx, resumed, range(1, STEPS)) == losses[1:]
        for (name, a), (_, b) in zip(straight[1].named_master_parameters(), resumed[1].named_master_parameters()):
            np.testing.assert_array_equal(a.data, b.data, err_msg=name)
    world.Barrier()


def build_recomputing(ctx, mode):
    """ZeRO-1, sequence parallelism and the zero-bubble schedule, with activation recomputation."""
    model = GPT(CONFIG, np.float64, tp=ctx.tp)
    model.sequence_parallel = True
    model.recompute = mode
    pipe = PipelineParallel(model, ctx, schedule="zb1", micro_batches=MICRO, dp_average=False)
    return pipe, ZeroRedundancyOptimizer(pipe.named_parameters(), ctx.dp, AdamW, lr=1e-2, weight_decay=0.1)


@pytest.mark.mpi(min_size=8)
@pytest.mark.parametrize("mode", ["selective", "full"])
def test_2x2x2_with_recomputation_equals_one_process(world, mode):
    ctx = layout_context(world, 2, 2, 2)
    if ctx is not None:
        params, ref_losses = reference()
        pipe, losses = train(ctx, built=build_recomputing(ctx, mode))
        assert_matches(pipe, losses, params, ref_losses, f"2x2x2 zb1 zero sequence-parallel recompute={mode}")
    world.Barrier()
