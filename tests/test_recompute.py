"""Activation recomputation: the same numbers as without it, in every layout, and the memory it saves.

Every comparison runs the same layout twice, with and without recomputation, in float64 with dropout
0.1 (so the rerun must draw the masks of the first run), and asks for the loss and every gradient
to agree to 1e-12 (they agree bit for bit: the same ops on the same values). The memory is the
count of ``autograd.memory.kept_for_backward``, checked byte for byte against the formula of
``nn.activation_memory`` that the planner uses.
"""
import numpy as np
import pytest

import hpcpar
from hpcpar.autograd import Parameter, Tensor, ops
from hpcpar.autograd.deferred import deferred_weight_grads
from hpcpar.autograd.memory import kept_for_backward
from hpcpar.autograd.recompute import recompute
from hpcpar.nn.activation_memory import block_kept_bytes, embedding_kept_bytes, head_kept_bytes
from hpcpar.nn.dropout_keys import DropoutKey, dropout_key
from hpcpar.nn.gpt import GPT, RECOMPUTE, GPTConfig

CONFIG = GPTConfig(vocab_size=16, block_size=8, n_layer=2, n_head=4, n_embd=16, dropout=0.1, seed=5)
MODES = ("selective", "full")
TOL = 1e-12


def batch(step, rows=8, config=CONFIG):
    ids = np.random.default_rng(900 + step).integers(0, config.vocab_size, (rows, config.block_size + 1))
    return ids[:, :-1], ids[:, 1:]


def gradients(named) -> dict:
    return {name: p.grad.copy() for name, p in named}


def assert_same(got: dict, want: dict, label):
    assert got.keys() == want.keys()
    for name in want:
        diff = np.max(np.abs(got[name] - want[name]))
        assert diff <= TOL, (label, name, diff)


# ----- the autograd function ---------------------------------------------------------------------
def small_region(w, rng):
    """Linear, GELU, dropout (from ``rng``) and a second product: a region with parameters and randomness."""
    def region(x):
        return ops.matmul(ops.dropout(ops.gelu(ops.linear(x, w)), 0.3, rng), w.T)
    return region


def run_small(recomputed: bool, x_requires_grad=True):
    rng = np.random.default_rng(3)
    w = Parameter(np.random.default_rng(1).normal(size=(5, 5)))
    x = Tensor(np.random.default_rng(2).normal(size=(4, 5)), requires_grad=x_requires_grad)
    region = small_region(w, rng)
    y = recompute(region, x, params=[w], random=[rng]) if recomputed else region(x)
    (y * y).sum().backward()
    return y.data, w.grad, x.grad, rng.random(3)  # the stream goes on where the forward left it


def test_recomputed_region_gives_the_same_values_gradients_and_random_stream():
    plain, again = run_small(False), run_small(True)
    for a, b in zip(plain, again):
        np.testing.assert_array_equal(a, b)


def test_a_region_whose_input_needs_no_gradient_still_gives_its_parameters_theirs():
    plain, again = run_small(False, x_requires_grad=False), run_small(True, x_requires_grad=False)
    assert again[2] is None
    np.testing.assert_array_equal(plain[1], again[1])


def test_without_grad_the_region_runs_plainly_and_keeps_nothing():
    w = Parameter(np.ones((3, 3)))
    with hpcpar.autograd.no_grad():
        y = recompute(lambda x: ops.linear(x, w), Tensor(np.ones((2, 3))), params=[w])
    assert y.is_leaf and not y.requires_grad


def test_a_region_must_return_one_tensor_and_take_tensors():
    with pytest.raises(TypeError, match="one Tensor"):
        recompute(lambda x: (x, x), Tensor(np.ones(2), requires_grad=True))
    with pytest.raises(TypeError, match="must be Tensors"):
        recompute(lambda x: x, np.ones(2))
    with pytest.raises(TypeError, match="random source"):
        recompute(lambda x: x, Tensor(np.ones(2), requires_grad=True), random=[object()])


def test_weight_gradients_of_the_rerun_graph_are_deferred_until_compute():
    """Zero-bubble pipelines: the rerun happens in B; its Linear weight gradients wait for W."""
    want = run_small(False)
    rng = np.random.default_rng(3)
    w = Parameter(np.random.default_rng(1).normal(size=(5, 5)))
    x = Tensor(np.random.default_rng(2).normal(size=(4, 5)), requires_grad=True)
    y = recompute(small_region(w, rng), x, params=[w], random=[rng])
    with deferred_weight_grads() as weights:
        (y * y).sum().backward()
    np.testing.assert_array_equal(x.grad, want[2])
    assert len(weights) == 1  # the linear's weight gradient; the matmul with w.T computed at once
    partial = w.grad.copy()
    weights.compute()
    np.testing.assert_array_equal(w.grad, want[1])
    assert not np.array_equal(partial, w.grad)


# ----- the GPT in one process --------------------------------------------------------------------
def gpt_step(mode, dtype=np.float64, steps=2, config=CONFIG):
    """Losses and gradients of ``steps`` forward+backward passes (the dropout stream runs on)."""
    model = GPT(config, dtype)
    model.recompute = mode
    out = []
    for step in range(steps):
        loss = model.loss(*batch(step, config=config))
        loss.backward()
        out.append((loss.item(), gradients(model.named_parameters())))
        for p in model.parameters():
            p.grad = None
    return out


@pytest.mark.parametrize("mode", MODES)
def test_gpt_recomputation_equals_no_recomputation_in_float64_with_dropout(mode):
    for step, ((loss, grads), (want_loss, want_grads)) in enumerate(zip(gpt_step(mode), gpt_step("none"))):
        assert abs(loss - want_loss) <= TOL
        assert_same(grads, want_grads, (mode, step))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_gpt_recomputation_in_16_bits_gives_the_same_bits(mode, dtype):
    dtype = pytest.importorskip("ml_dtypes").bfloat16 if dtype == "bfloat16" else np.float16
    for (loss, grads), (want_loss, want_grads) in zip(gpt_step(mode, dtype, 1), gpt_step("none", dtype, 1)):
        assert loss == want_loss
        for name in want_grads:
            np.testing.assert_array_equal(grads[name].astype(np.float32), want_grads[name].astype(np.float32))


def test_recompute_mode_is_checked_and_switchable():
    model = GPT(CONFIG, np.float64)
    with pytest.raises(ValueError, match="none, selective, full"):
        model.recompute = "some"
    model.recompute = "full"
    assert all(b.recompute_block and not b.attn.recompute_core for b in model.blocks)
    model.recompute = "selective"
    assert all(b.attn.recompute_core and not b.recompute_block for b in model.blocks)


def test_the_job_key_sets_the_models_recomputation():
    from hpcpar.train.build import build_model
    from hpcpar.train.config import JobError
    from hpcpar.train.config_load import load_job

    job = load_job(None, overrides=["model.recompute=\"selective\"", "model.n_layer=1", "model.n_embd=8",
                                    "model.n_head=2", "model.block_size=4"])
    ctx = hpcpar.init(device="cpu")
    assert build_model(job, ctx, np.float32).recompute == "selective"
    with pytest.raises(JobError, match="model.recompute"):
        load_job(None, overrides=["model.recompute=\"partial\""])


# ----- memory ------------------------------------------------------------------------------------
def kept_per_block(mode, dtype, dropout, rows=2, config=CONFIG, tp=None, sequence_parallel=False):
    """Bytes kept by one block: the count with n_layer + 1 blocks less the count with n_layer."""
    counted = []
    for layers in (1, 2):
        cfg = GPTConfig(**{**config.to_dict(), "n_layer": layers, "dropout": dropout, "attn_dropout": None})
        model = GPT(cfg, dtype, tp=tp)
        model.sequence_parallel = sequence_parallel
        model.recompute = mode
        with kept_for_backward(model.parameters()) as kept:
            model.loss(*batch(0, rows, cfg))
        counted.append(kept.bytes)
    return counted[1] - counted[0]


def dtypes():
    ml_dtypes = pytest.importorskip("ml_dtypes")
    return (np.float64, np.float32, ml_dtypes.bfloat16)


@pytest.mark.parametrize("mode", RECOMPUTE)
@pytest.mark.parametrize("shape", [(2, 8, 16, 4), (3, 16, 32, 2)])
def test_bytes_kept_per_block_equal_the_formula(mode, shape):
    rows, seq, width, heads = shape
    config = GPTConfig(vocab_size=16, block_size=seq, n_layer=1, n_head=heads, n_embd=width, seed=5)
    for dtype in dtypes():
        for dropout in (0.0, 0.1):
            want = block_kept_bytes(rows, seq, width, heads, dtype=dtype, recompute=mode, dropout=dropout)
            assert kept_per_block(mode, dtype, dropout, rows, config) == want, (np.dtype(dtype).name, dropout)


def whole_graph_bytes(config, dtype, mode, rows, tp=None, sequence_parallel=False):
    model = GPT(config, dtype, tp=tp)
    model.sequence_parallel = sequence_parallel
    model.recompute = mode
    rng = np.random.default_rng(0)
    ids, targets = (np.ascontiguousarray(rng.integers(0, config.vocab_size, (rows, config.block_size))) for _ in "it")
    with kept_for_backward(model.parameters()) as kept:
        model.loss(ids, targets)
    return kept.bytes


def formula_bytes(config, dtype, mode, rows, tp=1, sequence_parallel=False):
    """Embedding + n_layer blocks + head by the formulas."""
    shape = dict(dtype=dtype, tp=tp, sequence_parallel=sequence_parallel)
    block = block_kept_bytes(rows, config.block_size, config.n_embd, config.n_head, recompute=mode,
                             dropout=config.dropout, **shape)
    return (embedding_kept_bytes(rows, config.block_size, config.n_embd, **shape)
            + config.n_layer * block + head_kept_bytes(rows, config.block_size, config.n_embd, config.vocab_size, **shape))


@pytest.mark.parametrize("mode", RECOMPUTE)
def test_the_whole_graph_is_embedding_blocks_and_head_by_the_formulas(mode):
    for dtype in dtypes():
        for config in (CONFIG, GPTConfig(vocab_size=32, block_size=16, n_layer=3, n_head=2, n_embd=32, tie_weights=False)):
            assert whole_graph_bytes(config, dtype, mode, 3) == formula_bytes(config, dtype, mode, 3), np.dtype(dtype).name


@pytest.mark.parametrize("mode", RECOMPUTE)
def test_a_pipeline_stage_keeps_its_received_input_and_its_layers_by_the_formulas(mode):
    """A later stage's input is a leaf the graph keeps; the formulas count it where the first layer
    keeps it itself (``keeps_input``), and the planner adds it where not (``plan.memory``)."""
    from hpcpar.nn.activation_memory import keeps_input

    for dtype in dtypes():
        model = GPT(CONFIG, dtype)
        model.recompute = mode
        x = Tensor(np.random.default_rng(0).normal(size=(3, CONFIG.block_size, CONFIG.n_embd)).astype(dtype),
                   requires_grad=True)
        with dropout_key(DropoutKey(0)), kept_for_backward(model.parameters()) as kept:
            model.loss_from_logits(model.head(model.blocks[1](x)), batch(0, 3)[1])
        want = block_kept_bytes(3, CONFIG.block_size, CONFIG.n_embd, CONFIG.n_head, dtype=dtype, recompute=mode,
                                dropout=CONFIG.dropout)
        want += head_kept_bytes(3, CONFIG.block_size, CONFIG.n_embd, CONFIG.vocab_size, dtype=dtype)
        assert kept.bytes == want + (0 if keeps_input(dtype, mode) else x.data.nbytes), np.dtype(dtype).name


def test_recomputation_saves_what_the_formula_says():
    """Selective drops the (T, T) arrays; full keeps one activation per block."""
    none, selective, full = (block_kept_bytes(8, 128, 256, 4, recompute=m, dropout=0.1) for m in RECOMPUTE)
    assert none - selective == 2 * 8 * 128 * 256 * 4 + 8 * 4 * 128 * 128 * 4  # q scaled, attention's output; (T, T) probabilities
    assert full == 8 * 128 * 256 * 4
    assert selective < none and full < selective


def test_the_count_matches_the_memory_tracemalloc_sees_kept_after_forward():
    """The kept bytes are real: the allocations alive after the forward (less the loss) are the count."""
    import tracemalloc

    for mode in RECOMPUTE:
        model = GPT(GPTConfig(vocab_size=16, block_size=32, n_layer=2, n_head=4, n_embd=64, dropout=0.1), np.float64)
        model.recompute = mode
        ids, targets = batch(0, 4, model.config)
        tracemalloc.start()
        try:
            before = tracemalloc.get_traced_memory()[0]
            with kept_for_backward(model.parameters()) as kept:
                loss = model.loss(ids, targets)
            alive = tracemalloc.get_traced_memory()[0] - before
        finally:
            tracemalloc.stop()
        assert kept.bytes <= alive <= kept.bytes * 1.05 + 64 * 1024, (mode, kept.bytes, alive)
        del loss


# ----- every layout: the same numbers with and without recomputation -----------------------------
def layout_context(world, dp, pp, tp):
    from mpi4py import MPI

    if world.Get_size() < dp * pp * tp:
        pytest.skip(f"needs {dp * pp * tp} ranks")
    group = world.Split(0 if world.Get_rank() < dp * pp * tp else MPI.UNDEFINED, world.Get_rank())
    return None if group == MPI.COMM_NULL else hpcpar.init(dp=dp, pp=pp, tp=tp, comm=group, device="cpu")


def pipeline_steps(ctx, mode, schedule="1f1b", sequence_parallel=False, chunks=1, micro=2, steps=2):
    """Loss and gradients of ``steps`` pipeline steps (dp-averaged) under ``mode``; also the tp counters."""
    from hpcpar.parallel.pipeline import PipelineParallel

    model = GPT(CONFIG, np.float64, tp=ctx.tp)
    model.sequence_parallel = sequence_parallel
    model.recompute = mode
    pipe = PipelineParallel(model, ctx, schedule=schedule, micro_batches=micro, chunks=chunks)
    rows = slice(ctx.dp_rank * 8 // ctx.dp_size, (ctx.dp_rank + 1) * 8 // ctx.dp_size)
    out = []
    for step in range(steps):
        ids, targets = batch(step)
        with dropout_key(DropoutKey(step, rows.start)):  # this replica's rows of the step's batch
            loss = pipe.train_step(ids[rows], targets[rows])
        out.append((loss, gradients(pipe.named_parameters())))
        for _, p in pipe.named_parameters():
            p.grad = None
    return out


def check_layout(world, dp, pp, tp, **options):
    ctx = layout_context(world, dp, pp, tp)
    if ctx is not None:
        want = pipeline_steps(ctx, "none", **options)
        for mode in MODES:
            for step, ((loss, grads), (want_loss, want_grads)) in enumerate(zip(pipeline_steps(ctx, mode, **options), want)):
                assert abs(loss - want_loss) <= TOL, (dp, pp, tp, options, mode, step)
                assert_same(grads, want_grads, (dp, pp, tp, options, mode, step))
    world.Barrier()


SCHEDULE_OPTIONS = [{"schedule": "gpipe"}, {"schedule": "1f1b"}, {"schedule": "zb1"},
                    {"schedule": "interleaved", "chunks": 2}]


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("layout, options", [((2, 1, 1), {}), ((1, 1, 2), {}), ((1, 1, 2), {"sequence_parallel": True})]
                         + [((1, 2, 1), o) for o in SCHEDULE_OPTIONS])
def test_recomputation_equals_none_on_two_ranks(world, layout, options):
    check_layout(world, *layout, **options)


@pytest.mark.mpi(min_size=4)
@pytest.mark.parametrize("layout, options", [((4, 1, 1), {}), ((1, 1, 4), {}), ((1, 1, 4), {"sequence_parallel": True}),
                                             ((2, 1, 2), {"sequence_parallel": True}), ((1, 2, 2), {"schedule": "zb1"}),
                                             ((2, 2, 1), {"schedule": "interleaved", "chunks": 2})]
                         + [((1, 4, 1), o) for o in SCHEDULE_OPTIONS[:3]])
def test_recomputation_equals_none_on_four_ranks(world, layout, options):
    check_layout(world, *layout, **options)


@pytest.mark.mpi(min_size=2)
def test_recomputation_with_ddp_buckets_overlapped_with_backward(world):
    """DDP's hooks fire inside the rerun graph's backward: the all-reduced gradients are the same."""
    ctx = layout_context(world, 2, 1, 1)
    if ctx is not None:
        results = {mode: ddp_step(ctx, mode) for mode in RECOMPUTE}
        for mode in MODES:
            assert abs(results[mode][0] - results["none"][0]) <= TOL
            assert_same(results[mode][1], results["none"][1], ("ddp", mode))
    world.Barrier()


def ddp_step(ctx, mode):
    from hpcpar.parallel.data import DistributedDataParallel

    model = GPT(CONFIG, np.float64)
    model.recompute = mode
    ddp = DistributedDataParallel(model, ctx, bucket_mb=0.001, overlap=True)  # several buckets
    ids, targets = batch(0)
    rows = slice(ctx.dp_rank * 4, ctx.dp_rank * 4 + 4)
    with dropout_key(DropoutKey(0, rows.start)):
        loss = model.loss(ids[rows], targets[rows])
    loss.backward()
    ddp.finish_grad_sync()
    return loss.item(), gradients(model.named_parameters())


def zero_training(ctx, mode, steps=2):
    """Parameters after AdamW steps under ZeRO-1 (the optimizer reduces the gradients over dp)."""
    from hpcpar.optim import AdamW
    from hpcpar.parallel.pipeline import PipelineParallel
    from hpcpar.parallel.zero import ZeroRedundancyOptimizer

    model = GPT(CONFIG, np.float64, tp=ctx.tp)
    model.recompute = mode
    pipe = PipelineParallel(model, ctx, schedule="1f1b", micro_batches=2, dp_average=False)
    optimizer = ZeroRedundancyOptimizer(pipe.named_parameters(), ctx.dp, AdamW, lr=1e-2, weight_decay=0.1)
    rows = slice(ctx.dp_rank * 8 // ctx.dp_size, (ctx.dp_rank + 1) * 8 // ctx.dp_size)
    losses = []
    for step in range(steps):
        ids, targets = batch(step)
        with dropout_key(DropoutKey(step, rows.start)):
            losses.append(pipe.train_step(ids[rows], targets[rows]))
        optimizer.step()
        optimizer.zero_grad()
    return losses, {name: p.data.copy() for name, p in pipe.named_parameters()}


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("layout", [(2, 1, 1), (2, 2, 1), (2, 1, 2)])
def test_recomputation_with_zero_1_trains_to_the_same_parameters(world, layout):
    ctx = layout_context(world, *layout)
    if ctx is not None:
        want_losses, want = zero_training(ctx, "none")
        for mode in MODES:
            losses, params = zero_training(ctx, mode)
            np.testing.assert_allclose(losses, want_losses, rtol=0, atol=TOL)
            assert_same(params, want, ("zero", mode))
    world.Barrier()


def bf16_pipeline_gradients(ctx, mode, schedule, sequence_parallel):
    """bfloat16 model, float32 masters (MixedPrecision, no loss scale): the model gradients of one step."""
    ml_dtypes = pytest.importorskip("ml_dtypes")
    from hpcpar.optim import MixedPrecision
    from hpcpar.parallel.pipeline import PipelineParallel

    model = GPT(CONFIG, ml_dtypes.bfloat16, tp=ctx.tp)
    model.sequence_parallel = sequence_parallel
    model.recompute = mode
    amp = MixedPrecision(model, None)
    pipe = PipelineParallel(model, ctx, schedule=schedule, micro_batches=2, backward_loss=amp.backward)
    with dropout_key(DropoutKey(0)):
        loss = pipe.train_step(*batch(0))
    return loss, {name: p.grad.astype(np.float32) for name, p in pipe.named_parameters()}


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("layout, schedule, sequence_parallel", [((1, 2, 1), "zb1", False), ((1, 1, 2), "1f1b", True)])
def test_recomputation_under_bfloat16_mixed_precision_gives_the_same_bits(world, layout, schedule, sequence_parallel):
    ctx = layout_context(world, *layout)
    if ctx is not None:
        want_loss, want = bf16_pipeline_gradients(ctx, "none", schedule, sequence_parallel)
        for mode in MODES:
            loss, grads = bf16_pipeline_gradients(ctx, mode, schedule, sequence_parallel)
            assert loss == want_loss
            for name in want:
                np.testing.assert_array_equal(grads[name], want[name], err_msg=f"{mode} {name}")
    world.Barrier()


def tp_calls(ctx, mode, sequence_parallel):
    """{op: (calls, bytes)} on the tp communicator during one pipeline step."""
    model = GPT(CONFIG, np.float64, tp=ctx.tp)
    model.sequence_parallel = sequence_parallel
    model.recompute = mode
    from hpcpar.parallel.pipeline import PipelineParallel

    pipe = PipelineParallel(model, ctx, schedule="1f1b", micro_batches=2)
    stats = ctx.tp.stats
    stats.reset()
    with dropout_key(DropoutKey(0)):
        pipe.train_step(*batch(0))
    return {op: (stats.calls(op), stats.bytes(op)) for op in ("allreduce", "allgather", "reduce_scatter")}


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_full_recomputation_reissues_each_blocks_forward_tp_communication_and_selective_none(world, sequence_parallel):
    """Full: per block and micro-batch, the forward's two all-reduces again (sp: two all-gathers and two
    reduce-scatters) with the same bytes; selective reruns attention's heads only, which are local."""
    ctx = layout_context(world, 1, 1, 2)
    if ctx is not None:
        counts = {mode: tp_calls(ctx, mode, sequence_parallel) for mode in RECOMPUTE}
        assert counts["selective"] == counts["none"]
        activation = 4 * CONFIG.block_size * CONFIG.n_embd * 8  # a micro-batch of 4 rows, float64
        reruns = 2 * CONFIG.n_layer  # micro-batches x blocks
        if sequence_parallel:
            extra = {"allreduce": (0, 0), "allgather": (2 * reruns, 2 * reruns * activation // 2),
                     "reduce_scatter": (2 * reruns, 2 * reruns * activation)}
        else:
            extra = {"allreduce": (2 * reruns, 2 * reruns * activation), "allgather": (0, 0), "reduce_scatter": (0, 0)}
        for op, (calls, nbytes) in extra.items():
            assert counts["full"][op] == (counts["none"][op][0] + calls, counts["none"][op][1] + nbytes), op
    world.Barrier()


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_bytes_kept_on_a_tensor_parallel_rank_equal_the_formulas(world, sequence_parallel):
    tp = 4 if world.Get_size() >= 4 else 2
    ctx = layout_context(world, 1, 1, tp)
    if ctx is not None:
        for mode in RECOMPUTE:
            for dtype in dtypes():
                want = block_kept_bytes(2, CONFIG.block_size, CONFIG.n_embd, CONFIG.n_head, dtype=dtype, tp=tp,
                                        sequence_parallel=sequence_parallel, recompute=mode, dropout=0.1)
                got = kept_per_block(mode, dtype, 0.1, 2, CONFIG, ctx.tp, sequence_parallel)
                assert got == want, (mode, np.dtype(dtype).name, tp, sequence_parallel)
                whole = whole_graph_bytes(CONFIG, dtype, mode, 2, ctx.tp, sequence_parallel)
                assert whole == formula_bytes(CONFIG, dtype, mode, 2, tp, sequence_parallel), (mode, dtype, "whole")
    world.Barrier()


def test_the_rerun_runs_inside_the_context_made_at_forward_time():
    """State a region reads that is gone by backward (a context variable) is re-entered for the rerun."""
    import contextlib
    import contextvars

    factor = contextvars.ContextVar("factor", default=1.0)

    @contextlib.contextmanager
    def use(value):
        token = factor.set(value)
        try:
            yield
        finally:
            factor.reset(token)

    def region(x):
        return ops.tanh(x * factor.get())

    x = Tensor(np.linspace(-1, 1, 5), requires_grad=True)
    with use(3.0):
        y = recompute(region, x, context=use(factor.get()))
    y.sum().backward()
    np.testing.assert_allclose(x.grad, 3.0 * (1 - np.tanh(3.0 * x.data) ** 2), rtol=1e-14)


def test_bench_recompute_prints_each_mode_with_counted_and_formula_bytes():
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "hpcpar", "bench", "recompute", "--n-layer", "1", "--n-embd", "32",
                           "--block", "16", "--batch", "2", "--steps", "1", "--warmup", "0"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    at = next(i for i, line in enumerate(lines) if line.split()[:1] == ["recompute"])
    rows = [line.split() for line in lines[at + 2:at + 5]]
    assert [row[0] for row in rows] == list(RECOMPUTE)
    assert all(row[6] == row[7] for row in rows)  # per block: counted = formula
    kept = [float(row[5]) for row in rows]
    assert kept[0] > kept[1] > kept[2]


def test_recomputation_is_no_part_of_the_run_identity_and_may_change_on_resume():
    """The same numbers: a checkpoint written with another mode (or before the key existed) continues the run."""
    from hpcpar.train import identity
    from hpcpar.train.config_load import load_job

    none, full = (load_job(None, [f'model.recompute="{mode}"']) for mode in ("none", "full"))
    assert identity.fingerprint(none, None) == identity.fingerprint(full, None)
    assert "recompute" not in identity.fingerprint(full, None)["model"]
    saved_job = none.to_dict()
    lines = identity.changes(saved_job, full, None, {}, {}, {})
    assert lines == ["model.recompute: none in the checkpoint, full now (allowed: the job's value is used)"]
