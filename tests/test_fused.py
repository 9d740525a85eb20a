"""The fused elementwise passes (``native/fused.c`` through ``hpcpar.autograd.fused``) give the
NumPy path's results bit for bit: GELU, LayerNorm and attention (its masked softmax) forward
and backward, and Adam(W) steps through the optimizer, in float32 and float64; 16-bit and non-contiguous arrays take the NumPy path;
``HPCPAR_FUSED=0`` turns the library off."""
import os
import subprocess
import sys

import numpy as np
import pytest

from hpcpar.autograd import Tensor, fused
from hpcpar.autograd.ops import elementwise, nn_functional
from hpcpar.optim import Adam, AdamW
from hpcpar.optim.groups import DecayRuns

BUILT = (fused.library_path().parent / fused.LIB_NAME).exists()
needs_library = pytest.mark.skipif(not BUILT, reason="libhpcpar_fused.so is not built (make native)")


def both_paths(function, monkeypatch):
    """``function()`` on the native path, then on the NumPy one."""
    native = function()
    with fused.numpy_path():
        numpy = function()
    assert fused.status().startswith("native")
    return native, numpy


@needs_library
def test_the_built_library_is_the_one_that_runs():
    assert fused.status().startswith("native (")


@needs_library
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("shape", [(7,), (3, 5, 257), (2, 0, 4)])
def test_gelu_forward_and_backward_are_numpy_s_bits(dtype, shape, monkeypatch):
    rng = np.random.default_rng(1)
    x = (rng.standard_normal(shape) * 3).astype(dtype)
    seed = rng.standard_normal(shape).astype(dtype)

    def run():
        t = Tensor(x.copy(), requires_grad=True)
        out = elementwise.gelu(t)
        out.backward(seed)
        return out.data, t.grad

    (out, grad), (out_np, grad_np) = both_paths(run, monkeypatch)
    assert np.array_equal(out, out_np) and np.array_equal(grad, grad_np)
    assert out.dtype == dtype and grad.dtype == dtype


@needs_library
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("shape", [(5,), (2, 3, 7), (4, 129), (2, 9, 256), (3, 300)])
@pytest.mark.parametrize("affine", [(True, True), (True, False), (False, False)])
def test_layer_norm_forward_and_backward_are_numpy_s_bits(dtype, shape, affine, monkeypatch):
    """Rows below 8, up to 128 and above (NumPy's pairwise sums: a loop, eight accumulators, halves)."""
    rng = np.random.default_rng(3)
    x = (rng.standard_normal(shape) * 5 + 2).astype(dtype)
    params = [rng.standard_normal(shape[-1]).astype(dtype) for used in affine if used]
    seed = rng.standard_normal(shape).astype(dtype)

    def run():
        tensors = [Tensor(a.copy(), requires_grad=True) for a in (x, *params)]
        weight, bias = (tensors[1:] + [None, None])[:2]
        out = nn_functional.layer_norm(tensors[0], weight, bias)
        out.backward(seed)
        return [out.data] + [t.grad for t in tensors]

    native, numpy = both_paths(run, monkeypatch)
    assert len(native) == 2 + len(params)
    assert all(np.array_equal(a, b) and a.dtype == dtype for a, b in zip(native, numpy))


@needs_library
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("causal", [True, False])
def test_attention_is_numpy_s_bits_with_its_softmax_fused(dtype, causal, monkeypatch):
    rng = np.random.default_rng(4)
    q, k, v, seed = ((rng.standard_normal((2, 3, 37, 8)) * 3).astype(dtype) for _ in range(4))

    def run():
        tensors = [Tensor(a.copy(), requires_grad=True) for a in (q, k, v)]
        out = nn_functional.attention(*tensors, causal=causal)
        out.backward(seed)
        return [out.data] + [t.grad for t in tensors]

    native, numpy = both_paths(run, monkeypatch)
    assert all(np.array_equal(a, b) for a, b in zip(native, numpy))


def test_a_nan_score_stays_nan_through_the_fused_softmax():
    scores = np.zeros((1, 1, 4, 4), np.float32)
    scores[0, 0, 2, 1] = np.nan
    out = fused.attention_softmax(scores, True)
    assert np.isnan(out[0, 0, 2]).all() and np.isfinite(out[0, 0, [0, 1, 3]]).all()
    assert out[0, 0, 0].tolist() == [1, 0, 0, 0]


def test_arrays_the_loops_do_not_take_go_the_numpy_way():
    x = np.ones((4, 6), dtype=np.float32)
    assert fused._fits(x[:, ::2], np.empty((4, 3), np.float32)) is None  # strided
    assert fused._fits(x, x.astype(np.float64)) is None  # mixed dtypes
    assert fused._fits(x.astype(np.float16)) is None
    assert fused._fits(x, np.ones(5, np.float32)) is None  # lengths differ
    t = np.tanh(x[:, ::2])
    assert np.array_equal(fused.gelu_from_tanh(x[:, ::2], t, np.empty_like(t)), ((t + 1) * x[:, ::2]) * 0.5)


@needs_library
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("optimizer, decay", [(AdamW, 0.1), (AdamW, 0.0), (Adam, 0.01), (AdamW, "runs")])
def test_adam_steps_are_numpy_s_bits(dtype, optimizer, decay, monkeypatch):
    rng = np.random.default_rng(2)
    start = rng.standard_normal(1031).astype(dtype)
    grads = [rng.standard_normal(1031).astype(dtype) for _ in range(3)]

    def run():
        param = Tensor(start.copy(), requires_grad=True)
        opt = optimizer([("w", param)], lr=1e-2, weight_decay=0.0 if decay == "runs" else decay)
        if decay == "runs":  # a flat buffer with per-run rates (ZeRO's shards)
            opt.weight_decay_of = lambda name: DecayRuns([(0, 500, 0.1), (500, 1031, 0.0)])
        for grad in grads:
            param.grad = grad.copy()
            opt.step()
        state = opt.state["w"]
        return param.data, state["exp_avg"], state["exp_avg_sq"]

    native, numpy = both_paths(run, monkeypatch)
    assert all(np.array_equal(a, b) for a, b in zip(native, numpy))


def test_hpcpar_fused_0_turns_the_library_off():
    code = "from hpcpar.autograd import fused; print(fused.status())"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "HPCPAR_FUSED": "0"})
    assert proc.stdout.strip() == "off (HPCPAR_FUSED=0)", proc.stderr


@needs_library
def test_a_library_built_from_older_sources_is_left_aside(monkeypatch):
    """A build without one of the loops (here: another of hpcpar's libraries) is named, and NumPy runs."""
    monkeypatch.setattr(fused, "LIB_NAME", "libhpcpar_shm.so")
    monkeypatch.setattr(fused, "_state", {})
    assert "has no hpcpar_gelu_inner (built from older sources: make native)" in fused.status()
    x = np.ones(3, np.float32)
    assert np.array_equal(fused.gelu_from_tanh(x, x, np.empty_like(x)), np.ones(3, np.float32) * 1.0)
