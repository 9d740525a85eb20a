"""Modules, state dicts, initialisation, the GPT and the digits CNN (serial, float64 where checked)."""
import math

import numpy as np
import pytest

from hpcpar.autograd import Parameter, Tensor
from hpcpar.nn import (GPT, DigitsCNN, Dropout, DropoutKey, GPTConfig, HeadDropout, Linear, Module, ModuleList, Sequential,
                       ReLU, active_dropout_key, dropout_key, init, offset_dropout_key, replay_dropout_key)
from hpcpar.nn.dropout_keys import keyed_uniform

TINY = dict(vocab_size=11, block_size=8, n_layer=2, n_head=2, n_embd=8, dropout=0.0, seed=3)


def tiny_gpt(**overrides) -> GPT:
    return GPT(GPTConfig(**{**TINY, **overrides}), dtype=np.float64)


def batch(config_overrides=None, B=2, T=6, seed=0):
    config = {**TINY, **(config_overrides or {})}
    rng = np.random.default_rng(seed)
    return rng.integers(0, config["vocab_size"], (B, T)), rng.integers(0, config["vocab_size"], (B, T))


# ----- Module -----------------------------------------------------------------------------
def test_gpt_parameter_names_are_dotted_and_in_registration_order():
    names = [name for name, _ in tiny_gpt().named_parameters()]
    block0 = ["ln_1.weight", "ln_1.bias", "attn.qkv.weight", "attn.qkv.bias", "attn.proj.weight", "attn.proj.bias",
              "ln_2.weight", "ln_2.bias", "mlp.fc.weight", "mlp.fc.bias", "mlp.proj.weight", "mlp.proj.bias"]
    assert names == (["embed.wte.weight", "embed.wpe.weight"] + [f"blocks.{i}.{n}" for i in range(2) for n in block0]
                     + ["head.ln_f.weight", "head.ln_f.bias"])  # tied: the head's weight is embed.wte.weight
    assert [n for n, _ in tiny_gpt().named_parameters()] == names
    untied = [name for name, _ in tiny_gpt(tie_weights=False).named_parameters()]
    assert untied == names + ["head.lm_head.weight"]
    no_bias = [name for name, _ in tiny_gpt(bias=False).named_parameters()]
    assert not [n for n in no_bias if n.endswith(".bias")] and "blocks.1.attn.qkv.weight" in no_bias


def test_attribute_assignment_registers_and_unregisters():
    class Net(Module):
        def __init__(self):
            super().__init__()
            self.body = Linear(2, 3, dtype=np.float64)
            self.scale = Parameter(np.ones(3))
            self.note = "not a parameter"

    net = Net()
    assert [n for n, _ in net.named_parameters()] == ["scale", "body.weight", "body.bias"]
    net.scale = None
    assert [n for n, _ in net.named_parameters()] == ["body.weight", "body.bias"]
    del net.body
    assert net.parameters() == []

    class Forgetful(Module):
        def __init__(self):
            self.w = Parameter(np.ones(2))

    with pytest.raises(AttributeError, match=r"super\(\).__init__\(\)"):
        Forgetful()


def test_module_list_sequential_train_eval_and_cast():
    seq = Sequential([Linear(3, 4, dtype=np.float64), ReLU(), Linear(4, 2, dtype=np.float64)])
    init.initialize(seq, seed=0)
    assert len(seq) == 3 and isinstance(seq[1], ReLU) and len(seq[0:2]) == 2
    assert [n for n, _ in seq.named_parameters()] == ["0.weight", "0.bias", "2.weight", "2.bias"]
    x = np.random.default_rng(0).normal(size=(5, 3))
    expected = np.maximum(x @ seq[0].weight.data + seq[0].bias.data, 0) @ seq[2].weight.data + seq[2].bias.data
    np.testing.assert_allclose(seq(Tensor(x)).data, expected, rtol=1e-12)

    model = tiny_gpt(dropout=0.1)
    assert model.eval() is model and not any(m.training for _, m in model.named_modules())
    model.train()
    assert all(m.training for _, m in model.named_modules())

    params = model.parameters()
    model.to(np.float32)
    assert model.parameters() == params and all(p.dtype == np.float32 for p in params)


def test_layers_are_nan_until_initialised():
    layer = Linear(3, 2)
    assert np.isnan(layer.weight.data).all()
    init.initialize(layer, seed=0)
    assert np.isfinite(layer.weight.data).all() and layer.weight.dtype == np.float32
    bound = 1 / math.sqrt(3)
    assert np.abs(layer.weight.data).max() <= bound


# ----- state dict -------------------------------------------------------------------------
def test_state_dict_round_trip_loads_in_place():
    source, target = tiny_gpt(seed=1), tiny_gpt(seed=2)
    ids, _ = batch()
    assert not np.allclose(source(ids).data, target(ids).data)
    arrays_before = [p.data for p in target.parameters()]
    result = target.load_state_dict({k: v.copy() for k, v in source.state_dict().items()})
    assert result.missing == [] and result.unexpected == []
    np.testing.assert_array_equal(source(ids).data, target(ids).data)
    assert all(p.data is a for p, a in zip(target.parameters(), arrays_before))  # optimizers keep their arrays
    assert list(source.state_dict()) == [n for n, _ in source.named_parameters()]


def test_load_state_dict_shape_and_dtype_errors_name_the_key():
    model = tiny_gpt()
    state = {k: v.copy() for k, v in model.state_dict().items()}
    state["blocks.1.mlp.fc.weight"] = np.zeros((8, 33))
    with pytest.raises(ValueError, match=r"'blocks\.1\.mlp\.fc\.weight' has shape \(8, 33\).*\(8, 32\)"):
        model.load_state_dict(state)
    state["blocks.1.mlp.fc.weight"] = np.zeros((8, 32), dtype=np.float32)
    with pytest.raises(TypeError, match=r"'blocks\.1\.mlp\.fc\.weight' has dtype float32.*float64"):
        model.load_state_dict(state)


def test_load_state_dict_missing_and_unexpected_keys():
    model = tiny_gpt()
    state = {k: np.full(v.shape, 0.5) for k, v in model.state_dict().items()}
    del state["embed.wpe.weight"]
    state["head.lm_head.weight"] = np.zeros((8, 11))
    with pytest.raises(KeyError, match=r"missing keys \['embed.wpe.weight'\], unexpected keys \['head.lm_head.weight'\]"):
        model.load_state_dict(state)
    wpe_before = model.embed.wpe.weight.data.copy()
    result = model.load_state_dict(state, strict=False)
    assert result.missing == ["embed.wpe.weight"] and result.unexpected == ["head.lm_head.weight"]
    np.testing.assert_array_equal(model.embed.wpe.weight.data, wpe_before)
    assert (model.blocks[0].attn.qkv.weight.data == 0.5).all()


# ----- initialisation ---------------------------------------------------------------------
def test_init_is_per_name_and_independent_of_creation_order():
    a, b = tiny_gpt(seed=5), tiny_gpt(seed=5)
    for (name, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters()):
        np.testing.assert_array_equal(pa.data, pb.data, err_msg=name)
    assert not np.allclose(a.embed.wte.weight.data, tiny_gpt(seed=6).embed.wte.weight.data)

    # A deeper model shares every parameter of the same name; only the residual scale differs.
    deeper = dict(tiny_gpt(seed=5, n_layer=3).named_parameters())
    for name, param in a.named_parameters():
        if name.endswith("proj.weight"):
            np.testing.assert_allclose(deeper[name].data, param.data * math.sqrt(4 / 6), rtol=1e-12)
        else:
            np.testing.assert_array_equal(deeper[name].data, param.data, err_msg=name)

    # The values are those of the parameter's own stream: a shard can generate and slice them.
    full = init.generate(5, "blocks.1.attn.qkv.weight", (8, 24), init.normal(0.02))
    np.testing.assert_array_equal(a.blocks[1].attn.qkv.weight.data, full)
    assert a.blocks[1].attn.qkv.bias.data.tolist() == [0.0] * 24
    assert a.head.ln_f.weight.data.tolist() == [1.0] * 8
    np.testing.assert_allclose(a.blocks[0].mlp.proj.weight.data.std(), 0.02 / math.sqrt(4), rtol=0.15)

    class XY(Module):
        def __init__(self, x_first):
            super().__init__()
            if x_first:
                self.x, self.y = Linear(3, 4), Linear(4, 5)
            else:
                self.y, self.x = Linear(4, 5), Linear(3, 4)

    first, second = XY(True), XY(False)
    init.initialize(first, seed=9)
    np.random.default_rng().random(100)  # no global stream is involved
    init.initialize(second, seed=9)
    for name in ("x.weight", "x.bias", "y.weight", "y.bias"):
        np.testing.assert_array_equal(dict(first.named_parameters())[name].data,
                                      dict(second.named_parameters())[name].data)


# ----- GPT --------------------------------------------------------------------------------
def test_gpt_config_validation():
    with pytest.raises(ValueError, match=r"n_embd \(10\) must be divisible by n_head \(3\)"):
        GPTConfig(n_embd=10, n_head=3)
    with pytest.raises(ValueError, match="dropout"):
        GPTConfig(dropout=1.0)
    with pytest.raises(ValueError, match="n_layer must be a positive integer"):
        GPTConfig(n_layer=0)


def test_gpt_forward_shapes_and_initial_loss():
    model = tiny_gpt()
    ids, targets = batch()
    logits = model(ids)
    assert logits.shape == (2, 6, 11) and logits.dtype == np.float64
    loss = model.loss(ids, targets)
    assert loss.shape == () and abs(loss.item() - math.log(11)) < 0.05  # N(0, 0.02) init: nearly uniform
    float32_model = GPT(GPTConfig(**TINY))
    assert float32_model(ids).dtype == np.float32
    with pytest.raises(ValueError, match="sequence length 9 exceeds the context block_size 8"):
        model(np.zeros((1, 9), dtype=np.int64))


@pytest.mark.parametrize("tie_weights", [True, False])
def test_gpt_gradients_match_finite_differences(tie_weights):
    model = tiny_gpt(tie_weights=tie_weights)
    ids, targets = batch()
    targets[1, 2] = -100  # an ignored position

    def loss_value():
        return model.loss(ids, targets).item()

    model.loss(ids, targets).backward()
    params = dict(model.named_parameters())
    checked = ["embed.wte.weight", "embed.wpe.weight", "blocks.0.ln_1.weight", "blocks.0.attn.qkv.weight",
               "blocks.1.attn.proj.bias", "blocks.1.mlp.fc.weight", "blocks.1.ln_2.bias", "head.ln_f.bias"]
    if not tie_weights:
        checked.append("head.lm_head.weight")
    rng = np.random.default_rng(1)
    eps = 1e-6
    for name in checked:
        param = params[name]
        for flat_index in rng.choice(param.size, size=3, replace=False):
            index = np.unravel_index(flat_index, param.shape)
            original = param.data[index]
            param.data[index] = original + eps
            plus = loss_value()
            param.data[index] = original - eps
            minus = loss_value()
            param.data[index] = original
            numeric = (plus - minus) / (2 * eps)
            assert abs(param.grad[index] - numeric) <= 1e-7 + 1e-5 * abs(numeric), (name, index)


def test_gpt_layers_compose_to_forward_and_backward_stage_by_stage():
    """What a pipeline does: each stage runs on a detached input, gradients are passed back."""
    reference, staged = tiny_gpt(dropout=0.0), tiny_gpt(dropout=0.0)
    ids, targets = batch()
    layers = staged.layers()
    assert len(layers) == TINY["n_layer"] + 2

    x, stage_inputs, stage_outputs = ids, [], []
    for layer in layers:
        if isinstance(x, Tensor):
            x = Tensor(x.data, requires_grad=True)
        stage_inputs.append(x)
        x = layer(x)
        stage_outputs.append(x)
    np.testing.assert_array_equal(x.data, reference(ids).data)

    staged.loss_from_logits(stage_outputs[-1], targets).backward()
    for i in range(len(layers) - 2, -1, -1):
        stage_outputs[i].backward(stage_inputs[i + 1].grad)
    reference.loss(ids, targets).backward()
    for (name, p_ref), (_, p_staged) in zip(reference.named_parameters(), staged.named_parameters()):
        np.testing.assert_allclose(p_staged.grad, p_ref.grad, rtol=1e-12, atol=1e-15, err_msg=name)


def test_gpt_dropout_masks_are_keyed_by_step_and_sample():
    model = tiny_gpt(dropout=0.5)
    ids, _ = batch(B=4)
    assert [(m.seed, m.site) for _, m in model.named_modules() if isinstance(m, (Dropout, HeadDropout))] == \
        [(3, site) for site in range(1 + 3 * 2)]  # embedding; per block: attention probabilities, attention, MLP
    first, second = model(ids).data, model(ids).data
    assert not np.allclose(first, second)  # no key: each forward draws the next step's masks
    with dropout_key(DropoutKey(0)):
        np.testing.assert_array_equal(model(ids).data, first)  # ... which are step 0's, then step 1's
    with dropout_key(DropoutKey(1)):
        np.testing.assert_array_equal(model(ids).data, second)
    with dropout_key(DropoutKey(7, first_sample=10)):
        whole = model(ids).data
        with offset_dropout_key(2):  # the last two rows alone, as a micro-batch or replica holding them draws them
            np.testing.assert_array_equal(model(ids[2:]).data, whole[2:])
    with dropout_key(DropoutKey(7, first_sample=12)):
        np.testing.assert_array_equal(model(ids[2:]).data, whole[2:])
        np.testing.assert_array_equal(tiny_gpt(dropout=0.5)(ids[2:]).data, whole[2:])  # a pure function: any copy
    with dropout_key(DropoutKey(7, first_sample=12)), offset_dropout_key(1):
        replay = replay_dropout_key()  # what a recomputed region takes at its forward ...
    assert active_dropout_key() is None
    with replay:  # ... and reruns under in backward
        assert active_dropout_key() == DropoutKey(7, first_sample=13)
    model.eval()
    np.testing.assert_array_equal(model(ids).data, tiny_gpt(dropout=0.0)(ids).data)
    with pytest.raises(RuntimeError, match="dropout key"):
        Dropout(0.5)(Tensor(np.ones((2, 3))))  # a layer outside a model needs a key
    with dropout_key(DropoutKey(0)):  # any rank of input: axis 0 samples, axis 1 positions
        for shape in ((6,), (6, 5), (6, 5, 4, 3)):
            y = Dropout(0.5)(Tensor(np.ones(shape))).data
            assert y.shape == shape and set(np.unique(y)) == {0.0, 2.0}


def test_keyed_draws_of_any_rows_are_the_draws_of_the_whole():
    for dtype in (np.float32, np.float64):
        whole = keyed_uniform((1, 2, 3), (6, 5), range(0, 4), None, dtype)
        assert whole.shape == (4, 6, 5) and whole.dtype == dtype and 0 <= whole.min() and whole.max() < 1
        for samples in (range(0, 4), range(1, 3), range(3, 4)):
            for rows in (range(0, 6), range(1, 4), range(5, 6)):  # odd starts: a float32 draw from half an output
                got = keyed_uniform((1, 2, 3), (6, 5), samples, rows, dtype)
                np.testing.assert_array_equal(got, whole[samples.start:samples.stop, rows.start:rows.stop])
        assert not np.array_equal(keyed_uniform((1, 2, 4), (6, 5), range(0, 4), None, dtype), whole)


def test_head_dropout_streams_are_per_head_and_layout_independent():
    p = 0.3
    whole = HeadDropout(p, range(0, 4), seed=9, site=1)
    second_half = HeadDropout(p, range(2, 4), seed=9, site=1)  # a tp rank holding heads 2 and 3
    with dropout_key(DropoutKey(5)):
        keep = whole(2, 5, np.float64, np)
        assert keep.shape == (2, 4, 5, 5) and set(np.unique(keep)) == {0.0, 1 / (1 - p)}
        np.testing.assert_array_equal(second_half(2, 5, np.float64, np), keep[:, 2:])
        assert all(not np.array_equal(keep[:, 0], keep[:, h]) for h in (1, 2, 3))  # every head its own mask
        assert abs(np.mean(keep == 0) - p) < 0.1
    with dropout_key(DropoutKey(5, first_sample=1)):
        np.testing.assert_array_equal(whole(1, 5, np.float64, np), keep[1:])  # the second sample alone
    with dropout_key(DropoutKey(6)):
        assert not np.array_equal(whole(2, 5, np.float64, np), keep)  # another step, other masks
    whole.eval()
    assert whole(2, 5, np.float64, np) is None


def test_gpt_attention_dropout_alone_changes_training_only():
    model = tiny_gpt(dropout=0.0, attn_dropout=0.5)
    assert model.config.attn_dropout == 0.5 and tiny_gpt(dropout=0.2).config.attn_dropout == 0.2
    ids, _ = batch()
    plain = tiny_gpt(dropout=0.0)(ids).data
    assert not np.allclose(model(ids).data, plain)
    model.eval()
    np.testing.assert_array_equal(model(ids).data, plain)
    with pytest.raises(ValueError, match="attn_dropout"):
        GPTConfig(attn_dropout=1.0)


def test_gpt_generate():
    model = tiny_gpt()
    prompt = np.array([[1, 2, 3], [4, 5, 6]])
    out = model.generate(prompt, max_new_tokens=7, rng=np.random.default_rng(0))
    assert out.shape == (2, 10) and (out[:, :3] == prompt).all() and out.min() >= 0 and out.max() < 11
    np.testing.assert_array_equal(out, model.generate(prompt, 7, rng=np.random.default_rng(0)))
    assert model.training and all(p.grad is None for p in model.parameters())

    greedy = model.generate(prompt, 7, temperature=0)  # past block_size: the context is cropped
    np.testing.assert_array_equal(model.generate(prompt, 7, top_k=1, rng=np.random.default_rng(3)), greedy)
    np.testing.assert_array_equal(greedy[:, 3], model(prompt).data[:, -1].argmax(axis=-1))
    for tokens, bad in ((1, dict(top_k=0)), (1, dict(top_k=-2)), (1, dict(temperature=-1.0)), (-1, {})):
        with pytest.raises(ValueError, match="top_k >= 1"):  # top_k=0 once sampled every token
            model.generate(prompt, tokens, **bad)


# ----- CNN ----------------------------------------------------------------------------------
def test_digits_cnn_forward_and_layers():
    model = DigitsCNN(dtype=np.float64, seed=1)
    images = Tensor(np.random.default_rng(0).random((4, 1, 8, 8)))
    logits = model(images)
    assert logits.shape == (4, 10) and logits.dtype == np.float64
    x = images
    for layer in model.layers():
        x = layer(x)
    np.testing.assert_array_equal(x.data, logits.data)
    logits.sum().backward()
    assert all(p.grad is not None and p.grad.shape == p.shape for p in model.parameters())
    assert isinstance(model.net, ModuleList) and len(model.parameters()) == 6
