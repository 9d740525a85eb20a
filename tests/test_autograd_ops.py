"""Every op's gradient against central finite differences (float64), plus engine behaviour."""
import numpy as np
import pytest

from hpcpar.autograd import Tensor, no_grad
from hpcpar.autograd import ops


def numeric_grads(fn, arrays, weights, eps=1e-6):
    """d sum(fn(*arrays) * weights) / d arrays by central differences."""
    def loss():
        with no_grad():
            return float((fn(*(Tensor(a) for a in arrays)).data * weights).sum())

    grads = []
    for a in arrays:
        g = np.zeros_like(a)
        for i in np.ndindex(a.shape):
            saved = a[i]
            a[i] = saved + eps
            up = loss()
            a[i] = saved - eps
            down = loss()
            a[i] = saved
            g[i] = (up - down) / (2 * eps)
        grads.append(g)
    return grads


def check_grads(fn, arrays, seed=0):
    """Analytic gradients of a random projection of ``fn``'s output match numeric ones."""
    arrays = [np.array(a, dtype=np.float64) for a in arrays]
    tensors = [Tensor(a.copy(), requires_grad=True) for a in arrays]
    out = fn(*tensors)
    weights = np.random.default_rng(seed + 1).standard_normal(out.shape)
    (out * weights).sum().backward()
    for t, expected in zip(tensors, numeric_grads(fn, arrays, weights)):
        np.testing.assert_allclose(t.grad, expected, rtol=1e-6, atol=1e-8)


def _two_piece_split(x):
    a, b = ops.split(x, [1, 3], axis=1)
    return ops.concatenate([b * 2.0, a * a], axis=1)


IDS = np.array([[1, 0, 1], [3, 1, 1]])
TARGETS = np.array([[2, -100, 0], [4, 4, -100]])
# an attention-dropout scale with p = 0.25: 0 or 4/3, half the positions dropped
ATTENTION_KEEP = (np.random.default_rng(5).random((2, 2, 4, 4)) >= 0.5) / 0.75

CASES = {  # name: (function of tensors, input shapes, "positive" when inputs must be > 0)
    "add broadcast (3,4)+(4,)": (ops.add, [(3, 4), (4,)], False),
    "sub broadcast (2,1,4)-(3,1)": (ops.sub, [(2, 1, 4), (3, 1)], False),
    "mul broadcast (2,1,4)*(3,1)": (ops.mul, [(2, 1, 4), (3, 1)], False),
    "div broadcast (3,4)/(4,)": (ops.div, [(3, 4), (4,)], True),
    "scalar on the left": (lambda x: 1.5 - 2.0 / x, [(3, 2)], True),
    "neg": (ops.neg, [(3, 2)], False),
    "pow 3": (lambda x: x ** 3, [(3, 4)], False),
    "pow -2": (lambda x: ops.pow(x, -2), [(3, 4)], True),
    "pow 0.5": (lambda x: x ** 0.5, [(3, 4)], True),
    "pow 2.5": (lambda x: x ** 2.5, [(3, 4)], True),
    "tensor used twice x*x": (lambda x: x * x, [(3, 4)], False),
    "tensor used twice x@x.T": (lambda x: x @ x.T, [(3, 4)], False),
    "matmul batch broadcast": (ops.matmul, [(2, 1, 3, 4), (3, 4, 5)], False),
    "matmul N-D @ 2-D": (ops.matmul, [(2, 3, 4), (4, 5)], False),
    "matmul 2-D @ N-D": (ops.matmul, [(3, 4), (2, 4, 5)], False),
    "sum axis keepdims": (lambda x: ops.sum(x, axis=1, keepdims=True), [(2, 3, 4)], False),
    "sum all": (lambda x: x.sum(), [(2, 3)], False),
    "mean axes": (lambda x: ops.mean(x, axis=(0, 2)), [(2, 3, 4)], False),
    "max axis": (lambda x: ops.max(x, axis=-1), [(3, 5)], False),
    "reshape": (lambda x: x.reshape(4, -1), [(2, 3, 4)], False),
    "transpose axes": (lambda x: ops.transpose(x, (1, 0, 2)), [(2, 3, 4)], False),
    "transpose reversed": (lambda x: x.transpose(), [(2, 3, 4)], False),
    "getitem basic": (lambda x: x[1:, None, ::2], [(3, 5)], False),
    "getitem repeated indices": (lambda x: x[[0, 2, -3, 0, -1]], [(3, 2)], False),
    "getitem paired arrays": (lambda x: x[np.array([0, 1, 1]), np.array([2, 2, 2])], [(2, 3)], False),
    "getitem boolean mask": (lambda x: x[np.array([True, False, True])], [(3, 2)], False),
    "concatenate": (lambda a, b: ops.concatenate([a, b], axis=1), [(2, 3), (2, 1)], False),
    "split sizes": (_two_piece_split, [(2, 4)], False),
    "split count": (lambda x: (lambda a, b, c: a * b - c)(*ops.split(x, 3, axis=-1)), [(2, 6)], False),
    "where": (lambda a, b: ops.where(np.array([True, False, True]), a, b), [(2, 3), (3,)], False),
    "masked_fill": (lambda x: ops.masked_fill(x, np.array([[True], [False]]), -1.0), [(2, 3)], False),
    "exp": (ops.exp, [(3, 4)], False),
    "log": (ops.log, [(3, 4)], True),
    "sqrt": (ops.sqrt, [(3, 4)], True),
    "tanh": (ops.tanh, [(3, 4)], False),
    "relu": (ops.relu, [(3, 4)], False),
    "gelu": (ops.gelu, [(3, 4)], False),
    "softmax": (ops.softmax, [(3, 5)], False),
    "softmax axis 0": (lambda x: ops.softmax(x, axis=0), [(3, 5)], False),
    "log_softmax": (ops.log_softmax, [(2, 3, 5)], False),
    "cross_entropy ignore_index mean": (lambda x: ops.cross_entropy(x, TARGETS), [(2, 3, 5)], False),
    "cross_entropy sum": (lambda x: ops.cross_entropy(x, TARGETS, reduction="sum"), [(2, 3, 5)], False),
    "cross_entropy none": (lambda x: ops.cross_entropy(x, TARGETS, reduction="none"), [(2, 3, 5)], False),
    "embedding repeated ids": (lambda w: ops.embedding(w, IDS), [(4, 3)], False),
    "layer_norm": (lambda x, w, b: ops.layer_norm(x, w, b), [(2, 3, 5), (5,), (5,)], False),
    "layer_norm no affine": (lambda x: ops.layer_norm(x, None, None), [(3, 5)], False),
    "dropout": (lambda x: ops.dropout(x, 0.4, np.random.default_rng(7)), [(4, 5)], False),
    "linear": (ops.linear, [(2, 3, 4), (4, 5), (5,)], False),
    "linear no bias": (ops.linear, [(3, 4), (4, 2)], False),
    "attention causal": (ops.attention, [(2, 2, 4, 3)] * 3, False),
    "attention full": (lambda q, k, v: ops.attention(q, k, v, causal=False), [(1, 2, 3, 2)] * 3, False),
    "attention dropout": (lambda q, k, v: ops.attention(q, k, v, keep=ATTENTION_KEEP), [(2, 2, 4, 3)] * 3, False),
    "conv2d stride 2 padding 1": (lambda x, w, b: ops.conv2d(x, w, b, stride=2, padding=1),
                                  [(2, 2, 5, 5), (3, 2, 3, 3), (3,)], False),
    "conv2d no bias": (ops.conv2d, [(1, 2, 4, 3), (2, 2, 2, 2)], False),
    "conv2d stride skips an edge": (lambda x, w: ops.conv2d(x, w, stride=(2, 1)), [(1, 2, 6, 4), (2, 2, 3, 2)], False),
    "max_pool2d": (lambda x: ops.max_pool2d(x, 2), [(2, 2, 4, 4)], False),
    "max_pool2d overlapping": (lambda x: ops.max_pool2d(x, 3, stride=2), [(1, 2, 5, 5)], False),
    "avg_pool2d overlapping": (lambda x: ops.avg_pool2d(x, (2, 3), stride=1), [(1, 2, 4, 4)], False),
}


@pytest.mark.parametrize("name", list(CASES))
def test_gradient_matches_finite_differences(name):
    fn, shapes, positive = CASES[name]
    rng = np.random.default_rng(0)
    arrays = [rng.uniform(0.5, 2.0, s) if positive else rng.standard_normal(s) for s in shapes]
    check_grads(fn, arrays)


# ----- values, where a gradient check alone would not catch a wrong forward --------------

def test_forward_values_match_direct_formulas():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((2, 3, 5))
    logp = x - x.max(-1, keepdims=True)
    logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
    np.testing.assert_allclose(ops.log_softmax(Tensor(x)).data, logp)
    np.testing.assert_allclose(ops.softmax(Tensor(x)).data, np.exp(logp))
    kept = TARGETS != -100
    nll = -np.take_along_axis(logp, np.where(kept, TARGETS, 0)[..., None], -1)[..., 0]
    np.testing.assert_allclose(ops.cross_entropy(Tensor(x), TARGETS).data, nll[kept].mean())
    assert ops.cross_entropy(Tensor(x), np.full((2, 3), -100)).item() == 0.0  # all ignored: 0, not NaN
    gelu = 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x ** 3)))
    np.testing.assert_allclose(ops.gelu(Tensor(x)).data, gelu)
    mu, var = x.mean(-1, keepdims=True), x.var(-1, keepdims=True)
    np.testing.assert_allclose(ops.layer_norm(Tensor(x), None, None).data, (x - mu) / np.sqrt(var + 1e-5))


def test_attention_matches_masked_softmax_reference():
    rng = np.random.default_rng(2)
    q, k, v = (rng.standard_normal((2, 3, 4, 5)) for _ in range(3))
    scores = q @ k.swapaxes(-1, -2) / np.sqrt(5)
    scores[..., np.triu(np.ones((4, 4), bool), 1)] = -np.inf
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    np.testing.assert_allclose(ops.attention(Tensor(q), Tensor(k), Tensor(v)).data, probs @ v)


def test_conv2d_and_pools_match_loops():
    rng = np.random.default_rng(3)
    x, w, b = rng.standard_normal((2, 3, 6, 5)), rng.standard_normal((4, 3, 3, 2)), rng.standard_normal(4)
    padded = np.pad(x, ((0, 0), (0, 0), (1, 1), (1, 1)))
    expected = np.zeros((2, 4, 3, 3))
    for i in range(3):
        for j in range(3):
            patch = padded[:, :, 2 * i:2 * i + 3, 2 * j:2 * j + 2]
            expected[:, :, i, j] = np.einsum("nchw,ochw->no", patch, w) + b
    np.testing.assert_allclose(ops.conv2d(Tensor(x), Tensor(w), Tensor(b), stride=2, padding=1).data, expected)
    pooled = x[:, :, :6, :4].reshape(2, 3, 3, 2, 2, 2)
    np.testing.assert_allclose(ops.max_pool2d(Tensor(x), 2).data, pooled.max(axis=(3, 5)))
    np.testing.assert_allclose(ops.avg_pool2d(Tensor(x), 2).data, pooled.mean(axis=(3, 5)))


def test_max_splits_gradient_evenly_among_ties():
    x = Tensor(np.array([[1.0, 3.0, 3.0], [2.0, 0.0, 1.0]]), requires_grad=True)
    ops.max(x, axis=1).sum().backward()
    np.testing.assert_array_equal(x.grad, [[0, 0.5, 0.5], [1, 0, 0]])


def test_max_pool_gives_a_tied_window_gradient_to_its_first_maximum():
    x = Tensor(np.array([[[[1.0, 2.0, 0.0], [2.0, 2.0, 1.0], [0.0, 1.0, 0.5]]]]), requires_grad=True)
    ops.max_pool2d(x, 2, stride=1).sum().backward()  # the top 2 comes first in both top windows
    np.testing.assert_array_equal(x.grad[0, 0], [[0, 2, 0], [1, 1, 0], [0, 0, 0]])


def test_embedding_gradient_sums_repeated_ids():
    rng = np.random.default_rng(4)
    ids = rng.integers(0, 7, (5, 40))
    w = Tensor(rng.standard_normal((9, 3)), requires_grad=True)
    g = rng.standard_normal((5, 40, 3))
    ops.embedding(w, ids).backward(g)
    expected = np.zeros((9, 3))
    np.add.at(expected, ids.reshape(-1), g.reshape(-1, 3))
    np.testing.assert_allclose(w.grad, expected)


def test_dropout_scales_kept_values_and_is_identity_when_off():
    x = Tensor(np.ones((100, 100), np.float32))
    y = ops.dropout(x, 0.25, np.random.default_rng(0)).data
    assert set(np.unique(y)) == {0.0, np.float32(1 / 0.75)}
    assert 0.2 < (y == 0).mean() < 0.3
    assert ops.dropout(x, 0.25, np.random.default_rng(0), training=False) is x
    assert ops.dropout(x, 0.0, np.random.default_rng(0)) is x


# ----- errors --------------------------------------------------------------------------

def test_backward_of_non_scalar_without_grad_names_the_shape():
    x = Tensor(np.ones((2, 3)), requires_grad=True)
    with pytest.raises(ValueError, match=r"\(2, 3\)"):
        (x * 2.0).backward()


@pytest.mark.parametrize("call, pattern", [
    (lambda: ops.matmul(Tensor(np.ones((2, 3))), Tensor(np.ones((4, 5)))), r"matmul.*\(2, 3\).*\(4, 5\)"),
    (lambda: ops.matmul(Tensor(np.ones(3)), Tensor(np.ones((3, 5)))), r"matmul.*1-D"),
    (lambda: ops.matmul(Tensor(np.ones((2, 2, 3))), Tensor(np.ones((3, 3, 4)))), r"matmul.*batch"),
    (lambda: ops.add(Tensor(np.ones((3, 4))), Tensor(np.ones(5))), r"add.*\(3, 4\).*\(5,\)"),
    (lambda: ops.linear(Tensor(np.ones((2, 3))), Tensor(np.ones((4, 5)))), r"linear.*\(2, 3\).*\(4, 5\)"),
    (lambda: ops.split(Tensor(np.ones((2, 5))), 2, axis=1), r"split.*5.*2"),
    (lambda: ops.conv2d(Tensor(np.ones((1, 2, 4, 4))), Tensor(np.ones((3, 1, 2, 2)))), r"conv2d.*\(3, 1, 2, 2\)"),
])
def test_shape_errors_name_the_op_and_shapes(call, pattern):
    with pytest.raises(ValueError, match=pattern):
        call()


def test_integer_inputs_are_checked():
    w = Tensor(np.ones((4, 3)), requires_grad=True)
    with pytest.raises(TypeError, match="embedding: ids must be an integer array.*float64"):
        ops.embedding(w, np.array([0.0, 1.0]))
    with pytest.raises(TypeError, match="cross_entropy: targets must be an integer array"):
        ops.cross_entropy(w, np.zeros(4))
    with pytest.raises(IndexError, match="embedding: id 4"):
        ops.embedding(w, np.array([0, 4]))
    with pytest.raises(IndexError, match="cross_entropy: target 3"):
        ops.cross_entropy(w, np.array([0, 1, 3, 2]))


# ----- engine behaviour ----------------------------------------------------------------

def test_grad_hook_fires_once_per_backward_with_the_final_gradient():
    x = Tensor(np.array([1.0, 2.0]), requires_grad=True)
    seen = []
    x.register_grad_hook(lambda t: seen.append(t.grad.copy()))
    (x * x + x).sum().backward()  # three uses of x: the hook must wait for all of them
    np.testing.assert_array_equal(seen, [[3.0, 5.0]])
    (x * 3.0).sum().backward()
    np.testing.assert_array_equal(seen, [[3.0, 5.0], [6.0, 8.0]])


def test_gradients_accumulate_across_backward_calls():
    w = Tensor(np.array([[1.0, -2.0]]), requires_grad=True)
    for _ in range(2):
        ops.relu(w @ np.array([[3.0], [1.0]])).sum().backward()
    np.testing.assert_array_equal(w.grad, [[6.0, 2.0]])


def test_no_grad_records_nothing():
    x = Tensor(np.ones(3), requires_grad=True)
    with no_grad():
        y = ops.exp(x * 2.0).sum()
    assert not y.requires_grad and y.is_leaf
    with pytest.raises(RuntimeError, match="does not require grad"):
        y.backward()


def test_an_intermediate_no_backward_reads_is_freed_while_the_graph_lives():
    """The graph links a non-leaf input by a node without its array (PyTorch's grad_fn graph), so
    the inputs of an add, whose backward reads only shapes, die with the forward's last reference."""
    import weakref

    w = Tensor(np.arange(6.0).reshape(2, 3), requires_grad=True)
    a, b = w * 2.0, w + 1.0  # neither product's nor sum's output is saved by its own op
    loss = (a + b).sum()
    arrays = weakref.ref(a.data), weakref.ref(b.data)
    del a, b
    assert [ref() for ref in arrays] == [None, None]
    loss.backward()
    np.testing.assert_array_equal(w.grad, np.full((2, 3), 3.0))


FLOAT32_CASES = {
    "arithmetic": lambda x, w: ((x * 2 + 1 - w / 3) ** 3 - 0.5 / (w ** 2 + 1.0)).sum(),
    "mlp": lambda x, w: ops.gelu(ops.linear(x, w)).mean(),
    "norm+softmax": lambda x, w: ops.log_softmax(ops.layer_norm(x @ w, None, None) * 0.5).max(),
    "loss": lambda x, w: ops.cross_entropy(ops.tanh(x @ w), np.array([0, 1, 2, -100])),
    "attention": lambda x, w: ops.attention(*[ops.reshape(x @ w, (1, 2, 4, 2))] * 3).sum(),
    "conv": lambda x, w: ops.avg_pool2d(ops.conv2d(ops.reshape(x, (1, 1, 4, 4)), ops.reshape(w, (1, 1, 4, 4)),
                                                   padding=2), 2).sum(),
    "embedding": lambda x, w: (ops.sqrt(ops.exp(ops.embedding(w, np.array([[0, 1], [1, 3]])))) * x[:2]).sum(),
}


@pytest.mark.parametrize("name", list(FLOAT32_CASES))
def test_float32_stays_float32(name, monkeypatch):
    arriving = []  # dtypes of leaf gradients before Tensor casts them to the leaf's dtype
    accumulate = Tensor._accumulate
    monkeypatch.setattr(Tensor, "_accumulate", lambda t, g: (arriving.append(g.dtype), accumulate(t, g)))
    rng = np.random.default_rng(5)
    x = Tensor(rng.standard_normal((4, 4)).astype(np.float32), requires_grad=True)
    w = Tensor(rng.standard_normal((4, 4)).astype(np.float32), requires_grad=True)
    out = FLOAT32_CASES[name](x, w)
    assert out.dtype == np.float32
    out.backward()
    assert arriving == [np.float32, np.float32]


def test_python_constants_follow_float_dtypes_but_never_truncate():
    assert (Tensor(np.ones(2, np.float32)) * 2.5).dtype == np.float32
    np.testing.assert_array_equal((Tensor(np.array([1, 2])) * 0.5).data, [0.5, 1.0])


# ----- backward in two passes (zero-bubble pipelines) ------------------------------------

def test_deferred_weight_gradients_arrive_with_compute_and_equal_one_pass():
    from hpcpar.autograd.deferred import deferred_weight_grads
    from hpcpar.nn import GPT, GPTConfig

    config = GPTConfig(vocab_size=11, block_size=8, n_layer=2, n_head=2, n_embd=8, tie_weights=False, seed=4)
    ids = np.random.default_rng(0).integers(0, 11, (2, 9))
    reference, split = GPT(config, np.float64), GPT(config, np.float64)
    reference.loss(ids[:, :-1], ids[:, 1:]).backward()
    hooked = []
    split.head.lm_head.weight.register_grad_hook(lambda p: hooked.append(p.grad.copy()))
    x = Tensor(split.embed(ids[:, :-1]).data, requires_grad=True)  # a stage input, as in a pipeline
    with deferred_weight_grads() as weights:
        split.loss_from_logits(split.head(split.blocks[1](split.blocks[0](x))), ids[:, 1:]).backward()
    # the inputs of Linear ops (a row-parallel layer adds its bias after the reduction, outside)
    linears = {name for name, p in split.named_parameters()
               if name.endswith(("qkv.weight", "qkv.bias", "proj.weight", "fc.weight", "fc.bias", "lm_head.weight"))}
    assert len(weights) == 4 * 2 + 1  # qkv, attention proj, fc, mlp proj per block, and the lm head
    assert x.grad is not None and not hooked  # the input gradient now, the weights' later
    for name, p in split.named_parameters():
        assert (p.grad is None) == (name in linears or name.startswith("embed.")), name
    weights.compute()
    assert len(weights) == 0 and len(hooked) == 1
    expected = dict(reference.named_parameters())
    for name, p in split.named_parameters():
        if not name.startswith("embed."):  # the embedding stayed outside this backward
            np.testing.assert_array_equal(p.grad, expected[name].grad, err_msg=name)
