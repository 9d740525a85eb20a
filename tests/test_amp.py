"""Mixed precision: loss scaling, overflow skipping, master weights."""
import numpy as np
import pytest

from hpcpar.nn import GPT, GPTConfig
from hpcpar.optim import AdamW, DynamicLossScaler, MixedPrecision

CONFIG = GPTConfig(vocab_size=16, block_size=8, n_layer=1, n_head=2, n_embd=16, seed=0)


def data(steps, B=4, T=8, seed=0):
    """A learnable pattern: each token is the previous one plus one, modulo the vocabulary."""
    rng = np.random.default_rng(seed)
    for _ in range(steps):
        start = rng.integers(0, CONFIG.vocab_size, (B, 1))
        seq = (start + np.arange(T + 1)) % CONFIG.vocab_size
        yield seq[:, :-1], seq[:, 1:]


def test_loss_scaler_backoff_and_growth():
    scaler = DynamicLossScaler(init_scale=1024.0, growth_interval=3)
    for _ in range(2):
        scaler.update(found_inf=False)
    assert scaler.scale == 1024.0
    scaler.update(found_inf=True)
    assert scaler.scale == 512.0 and scaler.clean_steps == 0
    for _ in range(3):
        scaler.update(found_inf=False)
    assert scaler.scale == 1024.0  # three clean steps in a row after the overflow
    state = scaler.state_dict()
    restored = DynamicLossScaler()
    restored.load_state_dict(state)
    assert restored.state_dict() == state
    with pytest.raises(ValueError, match="backoff_factor"):
        DynamicLossScaler(backoff_factor=1.5)


def test_float16_training_tracks_float32():
    """float16 compute + float32 master weights: every step's loss within 0.5% of the float32 run,
    the weights within 5e-3 after 40 AdamW steps at lr 1e-2 (they move by about 0.4)."""
    steps = 40
    reference = GPT(CONFIG, dtype=np.float32)
    optimizer = AdamW(reference.named_parameters(), lr=1e-2)
    reference_losses = []
    for ids, targets in data(steps):
        loss = reference.loss(ids, targets)
        reference_losses.append(loss.item())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()

    half = GPT(CONFIG, dtype=np.float16)
    amp = MixedPrecision(half, DynamicLossScaler(init_scale=2.0 ** 10))
    optimizer = AdamW(amp.named_master_parameters(), lr=1e-2)
    half_losses = []
    for ids, targets in data(steps):
        loss = half.loss(ids, targets)
        half_losses.append(loss.item())
        amp.backward(loss)
        assert amp.step(optimizer).taken
    assert all(p.dtype == np.float16 for p in half.parameters())
    assert all(p.dtype == np.float32 for p in amp.master_parameters())
    assert reference_losses[-1] < 0.5 * reference_losses[0]  # it learns
    np.testing.assert_allclose(half_losses, reference_losses, rtol=5e-3)  # measured: 0.08%
    for (name, master), ref in zip(amp.named_master_parameters(), reference.parameters()):
        ours, theirs = master.data, ref.data
        if name == "blocks.0.attn.qkv.bias":
            # The key third's gradient is exactly zero (softmax ignores a shift shared by all keys):
            # Adam turns each run's rounding noise into steps of size lr, unrelated between the runs.
            # qkv columns are laid out head by head, [q_h k_h v_h]: drop every head's key block.
            hs = CONFIG.n_embd // CONFIG.n_head
            keys = [h * 3 * hs + hs + i for h in range(CONFIG.n_head) for i in range(hs)]
            ours, theirs = np.delete(ours, keys), np.delete(theirs, keys)
        np.testing.assert_allclose(ours, theirs, atol=5e-3, err_msg=name)


def one_backward(model, amp):
    ids, targets = next(data(1))
    amp.backward(model.loss(ids, targets))


def test_injected_overflow_skips_the_step_and_halves_the_scale():
    model = GPT(CONFIG, dtype=np.float16)
    amp = MixedPrecision(model, DynamicLossScaler(init_scale=256.0, growth_interval=2))
    optimizer = AdamW(amp.named_master_parameters(), lr=1e-2)
    before = {name: p.data.copy() for name, p in model.named_parameters()}

    one_backward(model, amp)
    model.blocks[0].mlp.fc.weight.grad[0, 0] = np.inf
    assert amp.step(optimizer).taken is False
    assert amp.scale == 128.0
    for name, p in model.named_parameters():
        np.testing.assert_array_equal(p.data, before[name], err_msg=name)
        assert p.grad is None
    assert optimizer.state["blocks.0.mlp.fc.weight"] == {}  # the optimizer never ran

    for expected_scale in (128.0, 256.0, 256.0, 512.0):  # grows after growth_interval=2 clean steps
        one_backward(model, amp)
        assert amp.step(optimizer).taken is True
        assert amp.scale == expected_scale
    assert optimizer.state["blocks.0.mlp.fc.weight"]["step"] == 4
    assert not np.array_equal(model.blocks[0].mlp.fc.weight.data, before["blocks.0.mlp.fc.weight"])
    master = dict(amp.named_master_parameters())["blocks.0.mlp.fc.weight"]
    np.testing.assert_array_equal(model.blocks[0].mlp.fc.weight.data, master.data.astype(np.float16))


def test_all_ranks_skip_when_any_rank_overflowed():
    model = GPT(CONFIG, dtype=np.float16)
    amp = MixedPrecision(model, DynamicLossScaler(init_scale=256.0))
    optimizer = AdamW(amp.named_master_parameters(), lr=1e-2)
    one_backward(model, amp)
    seen = []

    def other_rank_overflowed(local_flag):
        seen.append(local_flag)
        return max(local_flag, 1.0)

    assert amp.step(optimizer, allreduce_max=other_rank_overflowed).taken is False
    assert seen == [0.0] and amp.scale == 128.0


def test_a_scale_too_large_for_float16_gradients_backs_off_until_they_fit():
    model = GPT(CONFIG, dtype=np.float16)
    amp = MixedPrecision(model, DynamicLossScaler(init_scale=2.0 ** 40))  # the float32 loss's seed is finite
    optimizer = AdamW(amp.named_master_parameters(), lr=1e-2)
    before = {name: p.data.copy() for name, p in model.named_parameters()}
    taken = []
    for ids, targets in data(40):
        amp.backward(model.loss(ids, targets))
        taken.append(amp.step(optimizer).taken)
        if taken[-1]:
            break
        for name, p in model.named_parameters():  # a skipped step changes nothing
            np.testing.assert_array_equal(p.data, before[name], err_msg=name)
    skipped = len(taken) - 1
    assert taken[-1] and skipped >= 10  # 2**40 x a gradient of ~1e-2 is far above float16's 65504
    assert amp.skipped_steps == skipped and amp.scale == 2.0 ** (40 - skipped)


def test_a_nan_loss_never_steps_whatever_the_gradients():
    """The old float16 cross entropy returned a NaN loss with all-zero gradients, and the step was taken."""
    model = GPT(CONFIG, dtype=np.float16)
    amp = MixedPrecision(model, DynamicLossScaler(init_scale=256.0))
    optimizer = AdamW(amp.named_master_parameters(), lr=1e-2)
    before = {name: p.data.copy() for name, p in model.named_parameters()}
    one_backward(model, amp)
    for p in model.parameters():
        p.grad[...] = 0  # finite gradients
    assert amp.step(optimizer, loss=float("nan")).taken is False
    assert amp.scale == 128.0 and amp.skipped_steps == 1
    for name, p in model.named_parameters():
        np.testing.assert_array_equal(p.data, before[name], err_msg=name)
    ids, targets = next(data(1))
    loss = model.loss(ids, targets)
    amp.backward(loss)
    assert amp.step(optimizer, loss=loss).taken is True  # a finite Tensor loss steps


def test_bfloat16_skips_and_counts_a_non_finite_step_without_a_scaler():
    ml_dtypes = pytest.importorskip("ml_dtypes")
    model = GPT(CONFIG, dtype=ml_dtypes.bfloat16)
    amp = MixedPrecision(model, scaler=None)
    optimizer = AdamW(amp.named_master_parameters(), lr=1e-2)
    weight = model.blocks[0].mlp.fc.weight
    before = weight.data.copy()
    one_backward(model, amp)
    weight.grad[0, 0] = np.nan
    assert amp.step(optimizer).taken is False and amp.skipped_steps == 1
    np.testing.assert_array_equal(weight.data, before)
    assert optimizer.state["blocks.0.mlp.fc.weight"] == {}
    one_backward(model, amp)
    assert amp.step(optimizer, loss=np.float32(np.inf)).taken is False and amp.skipped_steps == 2
    one_backward(model, amp)
    assert amp.step(optimizer).taken is True and amp.skipped_steps == 2
    restored = MixedPrecision(GPT(CONFIG, dtype=ml_dtypes.bfloat16), scaler=None)
    restored.load_state_dict(amp.state_dict())
    assert restored.skipped_steps == 2


def test_mixed_precision_state_dict_restores_master_weights():
    model = GPT(CONFIG, dtype=np.float16)
    amp = MixedPrecision(model, DynamicLossScaler(init_scale=64.0))
    optimizer = AdamW(amp.named_master_parameters(), lr=1e-2)
    one_backward(model, amp)
    amp.step(optimizer)
    state = {"master": {k: v.copy() for k, v in amp.state_dict()["master"].items()}, "scaler": amp.state_dict()["scaler"]}

    fresh_model = GPT(CONFIG, dtype=np.float16)
    fresh = MixedPrecision(fresh_model)
    fresh.load_state_dict(state)
    assert fresh.scale == 64.0
    for (name, a), (_, b) in zip(amp.named_master_parameters(), fresh.named_master_parameters()):
        np.testing.assert_array_equal(a.data, b.data, err_msg=name)
    for a, b in zip(model.parameters(), fresh_model.parameters()):
        np.testing.assert_array_equal(a.data, b.data)


def test_bfloat16_without_scaling():
    ml_dtypes = pytest.importorskip("ml_dtypes")
    model = GPT(CONFIG, dtype=ml_dtypes.bfloat16)
    amp = MixedPrecision(model, scaler=None)
    optimizer = AdamW(amp.named_master_parameters(), lr=1e-2)
    losses = []
    for ids, targets in data(10):
        loss = model.loss(ids, targets)
        losses.append(float(loss.item()))
        amp.backward(loss)
        assert amp.step(optimizer).taken
    assert all(p.dtype == ml_dtypes.bfloat16 for p in model.parameters())
    assert losses[-1] < losses[0]


# ----- mixed precision through the pipeline engine (two stages) --------------------------

def pipeline_amp_run(ctx, dtype, scaler, steps=3, poison_stage_0_at=None):
    """pp = 2 training of the float16/bfloat16 GPT with float32 masters; returns (pipe, amp, steps taken)."""
    from hpcpar.parallel.pipeline import PipelineParallel

    pipe = PipelineParallel(GPT(CONFIG, dtype=dtype), ctx, schedule="1f1b", micro_batches=1)
    amp = MixedPrecision(pipe.named_parameters(), scaler)
    pipe.backward_loss = amp.backward
    optimizer = AdamW(amp.named_master_parameters(), lr=1e-2)
    taken = []
    for step, (ids, targets) in enumerate(data(steps)):
        pipe.train_step(ids, targets)
        if step == poison_stage_0_at and ctx.pp_rank == 0:
            pipe.named_parameters()[0][1].grad[0, 0] = np.inf
        taken.append(amp.step(optimizer, allreduce_max=lambda v: float(ctx.world.allreduce(np.array([v]), "max")[0])).taken)
    return pipe, amp, taken


def single_process_amp_run(dtype, scaler, steps=3):
    model = GPT(CONFIG, dtype=dtype)
    amp = MixedPrecision(model, scaler)
    optimizer = AdamW(amp.named_master_parameters(), lr=1e-2)
    for ids, targets in data(steps):
        amp.backward(model.loss(ids, targets))
        amp.step(optimizer)
    return dict(amp.named_master_parameters())


def two_stage_context(world):
    import hpcpar
    from mpi4py import MPI

    group = world.Split(0 if world.Get_rank() < 2 else MPI.UNDEFINED, world.Get_rank())
    return None if group == MPI.COMM_NULL else hpcpar.init(dp=1, pp=2, tp=1, comm=group, device="cpu")


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("precision", ["float16", "bfloat16"])
def test_pipeline_mixed_precision_equals_one_process(world, precision):
    """Loss scaling seeds the last stage's backward; the scaled gradients cross the stages.

    With one micro-batch the two stages do the single process's arithmetic, except that the
    tied embedding's gradient is rounded in another order (each stage's part alone, then their
    sum, instead of one running sum). That shows in bfloat16's 8-bit mantissa, so the float32
    masters agree to well under one step's change (lr 1e-2), not bit for bit.
    """
    if precision == "bfloat16":
        dtype, scaler, tol = pytest.importorskip("ml_dtypes").bfloat16, None, 1e-3
    else:
        dtype, scaler, tol = np.float16, DynamicLossScaler(init_scale=1024.0), 1e-4
    ctx = two_stage_context(world)
    if ctx is not None:
        pipe, amp, taken = pipeline_amp_run(ctx, dtype, scaler)
        expected = single_process_amp_run(dtype, DynamicLossScaler(init_scale=1024.0) if scaler else None)
        assert taken == [True, True, True]
        for name, master in amp.named_master_parameters():
            np.testing.assert_allclose(master.data, expected[name].data, rtol=0, atol=tol, err_msg=name)
        assert all(p.dtype == dtype for _, p in pipe.named_parameters())
    world.Barrier()


@pytest.mark.mpi(min_size=2)
def test_pipeline_overflow_on_one_stage_skips_the_step_on_both(world):
    ctx = two_stage_context(world)
    if ctx is not None:
        _, amp, taken = pipeline_amp_run(ctx, np.float16, DynamicLossScaler(init_scale=1024.0), poison_stage_0_at=1)
        assert taken == [True, False, True]  # the last stage's gradients were finite: it skipped all the same
        assert amp.scale == 512.0
    world.Barrier()


@pytest.mark.mpi(min_size=2)
def test_pipeline_nan_loss_skips_the_step_on_both_stages(world):
    """Only the last stage computes the loss; its NaN skips the first stage's step too."""
    from hpcpar.parallel.pipeline import PipelineParallel

    ctx = two_stage_context(world)
    if ctx is not None:
        pipe = PipelineParallel(GPT(CONFIG, dtype=np.float16), ctx, schedule="1f1b", micro_batches=1)
        amp = MixedPrecision(pipe.named_parameters(), DynamicLossScaler(init_scale=1024.0))
        pipe.backward_loss = amp.backward
        optimizer = AdamW(amp.named_master_parameters(), lr=1e-2)
        before = [p.data.copy() for _, p in pipe.named_parameters()]
        ids, targets = next(data(1))
        loss = pipe.train_step(ids, targets)
        last = ctx.pp_rank == ctx.pp_size - 1
        taken = amp.step(optimizer, loss=float("nan") if last else None,
                         allreduce_max=lambda v: float(ctx.world.allreduce(np.array([v]), "max")[0])).taken
        assert np.isfinite(loss) and taken is False and amp.skipped_steps == 1 and amp.scale == 512.0
        for (name, p), old in zip(pipe.named_parameters(), before):
            np.testing.assert_array_equal(p.data, old, err_msg=name)
    world.Barrier()


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("precision", ["float16", "bfloat16"])
def test_zero_overflow_on_one_rank_skips_the_step_on_every_rank(world, precision):
    """ZeRO-1 over float32 masters: rank 1's inf skips everyone's step; no optimizer state is made."""
    import hpcpar
    from mpi4py import MPI

    from hpcpar.parallel.zero import ZeroRedundancyOptimizer

    dtype = pytest.importorskip("ml_dtypes").bfloat16 if precision == "bfloat16" else np.float16
    group = world.Split(0 if world.Get_rank() < 2 else MPI.UNDEFINED, world.Get_rank())
    if group != MPI.COMM_NULL:
        ctx = hpcpar.init(dp=2, pp=1, tp=1, comm=group, device="cpu")
        model = GPT(CONFIG, dtype=dtype)
        amp = MixedPrecision(model, DynamicLossScaler(init_scale=256.0) if precision == "float16" else None)
        zero = ZeroRedundancyOptimizer(amp.named_master_parameters(), ctx.dp, AdamW, lr=1e-2)
        amp.copy_to_model()
        before = [p.data.copy() for p in model.parameters()]
        maximum = lambda v: float(ctx.world.allreduce(np.array([v]), "max")[0])  # noqa: E731
        for step, (ids, targets) in enumerate(data(2, seed=ctx.dp_rank)):
            amp.backward(model.loss(ids, targets))
            if step == 0 and ctx.dp_rank == 1:
                model.blocks[0].attn.qkv.weight.grad[0, 0] = np.inf
            taken = amp.step(zero, allreduce_max=maximum).taken
            assert taken is (step == 1)
            if step == 0:
                assert zero.optimizer.state["shard"] == {} and zero.shard.grad is None
                for p, old in zip(model.parameters(), before):
                    np.testing.assert_array_equal(p.data, old)
        assert amp.skipped_steps == 1 and zero.optimizer.state["shard"]["step"] == 1
        flat = ctx.dp.allgather(zero.flat)  # the replicas agree after the taken step
        np.testing.assert_array_equal(flat[0], flat[1])
        group.Free()
    world.Barrier()
