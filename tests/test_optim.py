"""Optimizers against their textbook formulas (and PyTorch where installed), schedules, clipping."""
import math

import numpy as np
import pytest

from hpcpar.autograd import Parameter
from hpcpar.optim import SGD, Adam, AdamW, WarmupCosine, clip_grad_norm

STEPS = 4


def gradient_sequence(shape=(3, 2), steps=STEPS, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.normal(size=shape) for _ in range(steps)]


def run(optimizer_factory, start, grads):
    param = Parameter(start.copy())
    optimizer = optimizer_factory([("w", param)])
    for grad in grads:
        param.grad = grad.copy()
        optimizer.step()
    return param.data, optimizer


START = np.random.default_rng(7).normal(size=(3, 2))


@pytest.mark.parametrize("momentum,nesterov,weight_decay", [(0.0, False, 0.0), (0.9, False, 0.0), (0.9, True, 0.0),
                                                            (0.8, True, 0.1), (0.0, False, 0.05)])
def test_sgd_matches_formula(momentum, nesterov, weight_decay):
    grads, lr = gradient_sequence(), 0.1
    got, _ = run(lambda p: SGD(p, lr, momentum=momentum, nesterov=nesterov, weight_decay=weight_decay), START, grads)
    w, buffer = START.copy(), None
    for g in grads:
        d = g + weight_decay * w
        if momentum:
            buffer = d if buffer is None else momentum * buffer + d
            d = d + momentum * buffer if nesterov else buffer
        w = w - lr * d
    np.testing.assert_allclose(got, w, rtol=1e-14, atol=1e-15)


@pytest.mark.parametrize("decoupled,weight_decay", [(False, 0.0), (False, 0.1), (True, 0.1)])
def test_adam_and_adamw_match_formula(decoupled, weight_decay):
    grads, lr, b1, b2, eps = gradient_sequence(), 0.01, 0.9, 0.99, 1e-8
    if decoupled:
        factory = lambda p: AdamW(p, lr, betas=(b1, b2), eps=eps, weight_decay=weight_decay)  # noqa: E731
    else:
        factory = lambda p: Adam(p, lr, betas=(b1, b2), eps=eps, weight_decay=weight_decay)  # noqa: E731
    got, optimizer = run(factory, START, grads)
    w, m, v = START.copy(), 0.0, 0.0
    for t, g in enumerate(grads, start=1):
        if decoupled:
            w = w * (1 - lr * weight_decay)
        else:
            g = g + weight_decay * w
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        m_hat, v_hat = m / (1 - b1 ** t), v / (1 - b2 ** t)
        w = w - lr * m_hat / (np.sqrt(v_hat) + eps)
    np.testing.assert_allclose(got, w, rtol=1e-12, atol=1e-14)
    assert optimizer.state["w"]["step"] == STEPS


def test_optimizers_match_pytorch():
    torch = pytest.importorskip("torch")
    grads = gradient_sequence()
    cases = [(lambda p: SGD(p, 0.1, momentum=0.9, nesterov=True, weight_decay=0.01),
              lambda p: torch.optim.SGD(p, 0.1, momentum=0.9, nesterov=True, weight_decay=0.01)),
             (lambda p: Adam(p, 0.01, weight_decay=0.1), lambda p: torch.optim.Adam(p, 0.01, weight_decay=0.1)),
             (lambda p: AdamW(p, 0.01, betas=(0.8, 0.95), weight_decay=0.1),
              lambda p: torch.optim.AdamW(p, 0.01, betas=(0.8, 0.95), weight_decay=0.1))]
    for ours, theirs in cases:
        got, _ = run(ours, START, grads)
        weight = torch.nn.Parameter(torch.tensor(START))
        optimizer = theirs([weight])
        for g in grads:
            weight.grad = torch.tensor(g)
            optimizer.step()
        np.testing.assert_allclose(got, weight.detach().numpy(), rtol=1e-12, atol=1e-14)


def test_step_skips_parameters_without_grad_and_updates_in_place():
    a, b = Parameter(np.ones(2)), Parameter(np.ones(2))
    optimizer = AdamW([a, b], lr=0.1)
    array = a.data
    a.grad = np.array([1.0, -1.0])
    optimizer.step()
    assert a.data is array and not np.allclose(a.data, 1.0)
    np.testing.assert_array_equal(b.data, 1.0)
    assert optimizer.state["1"] == {}
    optimizer.zero_grad()
    assert a.grad is None


def test_optimizer_state_dict_resumes_exactly():
    grads = gradient_sequence(steps=6)
    straight, _ = run(lambda p: AdamW(p, 0.01, weight_decay=0.1), START, grads)

    first_half, optimizer = run(lambda p: AdamW(p, 0.01, weight_decay=0.1), START, grads[:3])
    state = optimizer.state_dict()
    assert state["hyperparameters"] == {"lr": 0.01, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 0.1}
    assert set(state["state"]["w"]) == {"step", "exp_avg", "exp_avg_sq"} and state["state"]["w"]["step"] == 3
    saved = {"hyperparameters": dict(state["hyperparameters"]),
             "state": {"w": {k: np.array(v) for k, v in state["state"]["w"].items()}}}  # as read back from HDF5

    resumed = Parameter(first_half.copy())
    optimizer = AdamW([("w", resumed)], lr=0.5)
    optimizer.load_state_dict(saved)
    assert optimizer.lr == 0.01 and optimizer.state["w"]["step"] == 3
    for g in grads[3:]:
        resumed.grad = g.copy()
        optimizer.step()
    np.testing.assert_array_equal(resumed.data, straight)

    with pytest.raises(KeyError, match=r"unknown parameters \['v'\]"):
        optimizer.load_state_dict({"hyperparameters": saved["hyperparameters"], "state": {"v": {}}})
    saved["state"]["w"]["exp_avg"] = np.zeros((2, 3))
    with pytest.raises(ValueError, match=r"w/exp_avg has shape \(2, 3\) but the parameter has shape \(3, 2\)"):
        optimizer.load_state_dict(saved)


def test_optimizer_argument_errors():
    with pytest.raises(ValueError, match="nesterov"):
        SGD([Parameter(np.ones(1))], 0.1, nesterov=True)
    with pytest.raises(ValueError, match="betas"):
        Adam([Parameter(np.ones(1))], betas=(0.9, 1.0))
    p = Parameter(np.ones(1))
    with pytest.raises(ValueError, match="twice"):
        SGD([p, p], 0.1)


def test_warmup_cosine_schedule():
    optimizer = SGD([Parameter(np.ones(1))], lr=1.0)
    schedule = WarmupCosine(optimizer, warmup_steps=4, total_steps=14, min_lr=0.1)
    lrs = [optimizer.lr] + [schedule.step() for _ in range(15)]
    np.testing.assert_allclose(lrs[:5], [0.25, 0.5, 0.75, 1.0, 1.0])
    np.testing.assert_allclose(lrs[9], 0.55)  # halfway through the cosine: (1.0 + 0.1) / 2
    np.testing.assert_allclose(lrs[6], 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.2)))
    np.testing.assert_allclose(lrs[14:], [0.1, 0.1])
    assert all(a >= b for a, b in zip(lrs[3:], lrs[4:]))

    resumed = WarmupCosine(SGD([Parameter(np.ones(1))], lr=1.0), warmup_steps=0, total_steps=1)
    resumed.load_state_dict(dict(schedule.state_dict(), step_count=6))
    assert resumed.optimizer.lr == pytest.approx(lrs[6]) and resumed.step() == pytest.approx(lrs[7])
    with pytest.raises(ValueError, match="warmup_steps <= total_steps"):
        WarmupCosine(optimizer, warmup_steps=5, total_steps=4)


def test_clip_grad_norm_local_and_across_ranks():
    def params():
        a, b = Parameter(np.zeros(2)), Parameter(np.zeros(1))
        a.grad, b.grad = np.array([3.0, 0.0]), np.array([4.0])
        return [a, b, Parameter(np.zeros(3))]  # the last has no grad

    local = params()
    assert clip_grad_norm(local, max_norm=10.0) == pytest.approx(5.0)
    np.testing.assert_array_equal(local[0].grad, [3.0, 0.0])  # under the limit: untouched
    assert clip_grad_norm(local, max_norm=1.0) == pytest.approx(5.0)
    np.testing.assert_allclose(np.concatenate([local[0].grad, local[1].grad]), [0.6, 0.0, 0.8], rtol=1e-6)

    other_ranks_sum_of_squares = 11.0
    calls = []

    def fake_allreduce_sum(value):
        calls.append(value)
        return value + other_ranks_sum_of_squares

    distributed = params()
    assert clip_grad_norm(distributed, max_norm=3.0, allreduce_sum=fake_allreduce_sum) == pytest.approx(6.0)
    assert calls == [pytest.approx(25.0)]
    np.testing.assert_allclose(distributed[1].grad, [2.0], rtol=1e-6)

    half = Parameter(np.zeros(1000, dtype=np.float16))
    half.grad = np.full(1000, 300.0, dtype=np.float16)  # the sum of squares overflows float16
    assert clip_grad_norm([half], max_norm=1e9) == pytest.approx(300.0 * math.sqrt(1000), rel=1e-6)


# ----- weight-decay groups (E) ------------------------------------------------------------------

NO_DECAY = ("*.bias", "*ln_*", "embed.*")  # the job default (train/config.py)


def test_e_adamw_exempts_biases_norms_and_embeddings_by_name():
    """AdamW decayed every tensor it was given; GPT-2, nanoGPT and Megatron exempt these."""
    from hpcpar.nn import GPT, GPTConfig

    model = GPT(GPTConfig(vocab_size=8, block_size=4, n_layer=1, n_head=2, n_embd=4, tie_weights=False))
    optimizer = AdamW(model.named_parameters(), lr=0.1, weight_decay=0.5, no_decay=NO_DECAY)
    before = {name: p.data.copy() for name, p in model.named_parameters()}
    for p in model.parameters():
        p.grad = np.zeros_like(p.data)  # Adam's update of a zero gradient is 0: only the decay moves
    optimizer.step()
    exempt = {name for name in before if name.endswith(".bias") or ".ln_" in name or name.startswith("embed.")}
    assert exempt == {"embed.wte.weight", "embed.wpe.weight", "blocks.0.ln_1.weight", "blocks.0.ln_1.bias",
                      "blocks.0.attn.qkv.bias", "blocks.0.attn.proj.bias", "blocks.0.ln_2.weight",
                      "blocks.0.ln_2.bias", "blocks.0.mlp.fc.bias", "blocks.0.mlp.proj.bias", "head.ln_f.weight",
                      "head.ln_f.bias"}
    for name, p in model.named_parameters():
        expected = before[name] if name in exempt else before[name] * (1.0 - 0.1 * 0.5)
        np.testing.assert_array_equal(p.data, expected, err_msg=name)
    assert optimizer.named_weight_decays()["head.lm_head.weight"] == 0.5
    assert optimizer.named_weight_decays()["blocks.0.ln_1.weight"] == 0.0


def test_groups_as_dicts_match_pytorch_param_groups():
    torch = pytest.importorskip("torch")
    grads = gradient_sequence()
    starts = [START.copy(), START[:2].copy()]
    a, b = Parameter(starts[0].copy()), Parameter(starts[1].copy())
    ours = AdamW([{"params": [("a", a)], "weight_decay": 0.2}, {"params": [("b", b)], "weight_decay": 0.0}],
                 lr=0.01, betas=(0.8, 0.95), weight_decay=0.1)
    ta, tb = (torch.nn.Parameter(torch.tensor(s)) for s in starts)
    theirs = torch.optim.AdamW([{"params": [ta], "weight_decay": 0.2}, {"params": [tb], "weight_decay": 0.0}],
                               lr=0.01, betas=(0.8, 0.95), weight_decay=0.1)
    for g in grads:
        a.grad, b.grad = g.copy(), g[:2].copy()
        ta.grad, tb.grad = torch.tensor(g), torch.tensor(g[:2])
        ours.step()
        theirs.step()
    np.testing.assert_allclose(a.data, ta.detach().numpy(), rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(b.data, tb.detach().numpy(), rtol=1e-12, atol=1e-14)
    assert ours.named_weight_decays() == {"a": 0.2, "b": 0.0}


@pytest.mark.parametrize("factory", [
    lambda p, **kw: AdamW(p, 0.01, weight_decay=0.3, **kw),
    lambda p, **kw: Adam(p, 0.01, weight_decay=0.3, **kw),
    lambda p, **kw: SGD(p, 0.1, momentum=0.9, weight_decay=0.3, **kw)])
def test_decay_runs_along_a_flat_parameter_equal_per_parameter_decay(factory):
    """ZeRO-1 and the parameter server step one flat array: its DecayRuns give each element its
    parameter's decay, bitwise as the optimizer stepping the parameters one by one."""
    from hpcpar.optim.groups import DecayRuns

    rng = np.random.default_rng(3)
    sizes, names = [6, 4, 5, 3], ["w1", "b1", "w2", "b2"]
    values = [rng.normal(size=n) for n in sizes]
    separate = [(name, Parameter(v.copy())) for name, v in zip(names, values)]
    flat = Parameter(np.concatenate(values))
    one_by_one = factory(separate, no_decay=["b*"])
    together = factory([("shard", flat)])
    decays = one_by_one.named_weight_decays()
    together.set_weight_decay("shard", DecayRuns.over_range(names, sizes, decays, 0, flat.size))
    assert together.weight_decay_of("shard").runs == [(0, 6, 0.3), (6, 10, 0.0), (10, 15, 0.3), (15, 18, 0.0)]
    for _ in range(3):
        grads = [rng.normal(size=n) for n in sizes]
        for (_, p), g in zip(separate, grads):
            p.grad = g.copy()
        flat.grad = np.concatenate(grads)
        one_by_one.step()
        together.step()
    np.testing.assert_array_equal(flat.data, np.concatenate([p.data for _, p in separate]))


def test_weight_decay_groups_are_in_the_state_dict_and_checked():
    a, b = Parameter(np.ones(2)), Parameter(np.ones(3))
    optimizer = AdamW([("layer.weight", a), ("layer.bias", b)], lr=0.1, weight_decay=0.1, no_decay="*.bias")
    state = optimizer.state_dict()
    assert state["weight_decays"] == {"layer.weight": 0.1, "layer.bias": 0.0}
    plain = AdamW([("layer.weight", Parameter(np.ones(2))), ("layer.bias", Parameter(np.ones(3)))], lr=0.1)
    plain.load_state_dict(state)
    assert plain.named_weight_decays() == state["weight_decays"]
    optimizer.weight_decay = 0.2  # the default: every parameter no group or pattern sets
    assert optimizer.named_weight_decays() == {"layer.weight": 0.2, "layer.bias": 0.0}
    with pytest.raises(ValueError, match="keys are params, weight_decay"):
        AdamW([{"params": [a], "lr": 0.5}])
    with pytest.raises(TypeError, match="either parameter groups"):
        AdamW([{"params": [a]}, b])
    with pytest.raises(ValueError, match="weight_decay must be >= 0"):
        SGD([{"params": [a], "weight_decay": -1.0}], lr=0.1)


@pytest.mark.parametrize("sharded", [False, True], ids=["adamw", "zero-1"])
def test_a_checkpoint_sets_weight_decays_only_when_the_whole_load_succeeds(tmp_path, sharded):
    """The saved ``weight_decay/<param>`` scalars are staged by the load plan and applied in its
    finish: a load that fails (here: a parameter the checkpoint lacks) leaves the decays as they were."""
    from hpcpar import checkpoint
    from hpcpar.checkpoint import CheckpointError
    from hpcpar.runtime import single_process
    from hpcpar.parallel.zero import ZeroRedundancyOptimizer

    ctx = single_process()

    def build(names, weight_decay, **groups):
        named = [(name, Parameter(np.ones(3))) for name in names]
        if sharded:
            return named, ZeroRedundancyOptimizer(named, ctx.dp, AdamW, lr=0.1, weight_decay=weight_decay, **groups)
        return named, AdamW(named, lr=0.1, weight_decay=weight_decay, **groups)

    named, trained = build(["layer.weight", "layer.bias"], 0.1, no_decay="*.bias")
    checkpoint.save(str(tmp_path), 1, named, trained, ctx)
    named, wider = build(["layer.weight", "layer.bias", "extra"], 0.5)
    with pytest.raises(CheckpointError, match="no tensor 'model/extra'"):
        checkpoint.load(str(tmp_path), named, wider, ctx)
    assert wider.named_weight_decays() == {"layer.weight": 0.5, "layer.bias": 0.5, "extra": 0.5}
    named, same = build(["layer.weight", "layer.bias"], 0.5)
    checkpoint.load(str(tmp_path), named, same, ctx)
    assert same.named_weight_decays() == {"layer.weight": 0.1, "layer.bias": 0.0}
