"""The elementwise passes that dominate a step outside its GEMMs, each in one place: a native loop
(``build/libhpcpar_fused.so``, ``native/fused.c``) where it can run, else the NumPy sequence.

GELU's two elementwise halves around NumPy's tanh and its gradient, LayerNorm forward and
backward row by row (NumPy's pairwise sums), attention's masked softmax around NumPy's exp, and
one Adam(W) step: each native loop is a single pass over memory where NumPy makes several, with
NumPy's operations in NumPy's order, so the results are the same bits. The library is loaded on
first use (not on import) and checked against the NumPy sequences on a probe; where it is not
built (or built without one of the loops: an old build), disagrees, or the arrays are not
contiguous float32/float64 NumPy arrays, each function runs its NumPy sequence instead (CuPy
arrays too). ``HPCPAR_FUSED=0`` turns the library off; ``status()`` says which path runs and why.
"""
from __future__ import annotations

import contextlib
import ctypes
import os

import numpy as np

from ..backend import get_array_module
from ..native import library_path

LIB_NAME = "libhpcpar_fused.so"  # next to libhpcpar_native.so (CMakeLists.txt builds both)
DTYPES = {np.dtype(np.float32): 0, np.dtype(np.float64): 1}
_state: dict = {}
_SIGNATURES = {
    "hpcpar_gelu_inner": [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_double,
                          ctypes.c_double],
    "hpcpar_gelu_outer": [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int],
    "hpcpar_gelu_backward": [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t,
                             ctypes.c_int, ctypes.c_double, ctypes.c_double],
    "hpcpar_adam": [ctypes.c_void_p] * 4 + [ctypes.c_size_t, ctypes.c_int] + [ctypes.c_double] * 7 + [ctypes.c_int],
    "hpcpar_layer_norm": [ctypes.c_void_p] * 7 + [ctypes.c_size_t, ctypes.c_size_t, ctypes.c_int, ctypes.c_double],
    "hpcpar_layer_norm_backward": [ctypes.c_void_p] * 8 + [ctypes.c_size_t, ctypes.c_size_t, ctypes.c_int],
    "hpcpar_softmax_shift": [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t, ctypes.c_int, ctypes.c_int],
    "hpcpar_softmax_scale": [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t, ctypes.c_int],
}


def _library():
    """The loaded functions by name, or None; loaded and probed once."""
    if "lib" not in _state:
        _state["lib"], _state["why"] = _load()
    return _state["lib"]


def _load():
    if os.environ.get("HPCPAR_FUSED", "1") == "0":
        return None, "off (HPCPAR_FUSED=0)"
    path = library_path().parent / LIB_NAME
    try:
        lib = ctypes.CDLL(str(path))
    except OSError:
        return None, f"{path} is not built (make native)"
    functions = {}
    for name, argtypes in _SIGNATURES.items():
        try:
            function = getattr(lib, name)
        except AttributeError:
            return None, f"{path} has no {name} (built from older sources: make native)"
        function.argtypes, function.restype = argtypes, ctypes.c_int
        functions[name] = function
    problem = disagreement(functions)
    if problem:
        return None, f"{path} differs from NumPy ({problem}): NumPy runs"
    return functions, f"native ({path})"


@contextlib.contextmanager
def numpy_path():
    """Inside: the NumPy sequences, the native loops set aside (what ``HPCPAR_FUSED=0`` runs)."""
    lib = _library()
    _state["lib"] = None
    try:
        yield
    finally:
        _state["lib"] = lib


def status() -> str:
    """Which path the fused passes take, and why."""
    _library()
    return _state["why"]


def _fits(*arrays) -> int | None:
    """The dtype code when every array is a C-contiguous NumPy array of one float dtype, else None."""
    first = arrays[0]
    if type(first) is not np.ndarray or first.dtype not in DTYPES:
        return None
    for array in arrays:
        if type(array) is not np.ndarray or array.dtype != first.dtype or not array.flags.c_contiguous \
                or array.size != first.size:
            return None
    return DTYPES[first.dtype]


def _pointer(array):
    return None if array is None else array.ctypes.data


def _native(name: str, *arrays) -> tuple:
    """(the native function, the dtype code) when it can take ``arrays``, else (None, None)."""
    lib = _library()
    code = _fits(*arrays) if lib is not None else None
    return (lib[name], code) if code is not None else (None, None)


def gelu_tanh_argument(x, out, a: float, c: float):
    """``out = c x (1 + a x^2)``, computed as ((x x) a + 1) x c; returns ``out``."""
    function, code = _native("hpcpar_gelu_inner", x, out)
    if function is not None and function(_pointer(x), _pointer(out), x.size, code, a, c) == 0:
        return out
    get_array_module(x).multiply(x, x, out=out)
    out *= a
    out += 1
    out *= x
    out *= c
    return out


def gelu_from_tanh(x, t, out):
    """``out = ((t + 1) x) 0.5`` (``out`` another array); returns ``out``."""
    function, code = _native("hpcpar_gelu_outer", x, t, out)
    if function is not None and function(_pointer(x), _pointer(t), _pointer(out), x.size, code) == 0:
        return out
    get_array_module(x).add(t, 1, out=out)
    out *= x
    out *= 0.5
    return out


def gelu_gradient(x, t, grad, a: float, c: float):
    """grad (0.5 (1 + t) + 0.5 x (1 - t^2) c (1 + 3 a x^2)), t = tanh(c (x + a x^3)): a new array."""
    function, code = _native("hpcpar_gelu_backward", x, t, grad)
    if function is not None:
        out = np.empty_like(x)
        if function(_pointer(x), _pointer(t), _pointer(grad), _pointer(out), x.size, code, 3 * a, c) == 0:
            return out
    xp = get_array_module(x)
    g = x * x
    g *= 3 * a
    g += 1
    g *= c
    g *= x
    one_minus_t2 = t * t
    xp.subtract(1, one_minus_t2, out=one_minus_t2)
    g *= one_minus_t2
    g += t
    g += 1
    g *= 0.5
    g *= grad
    return g


def adam_step(param, grad, m, v, tmp, decay: float | None, beta1: float, beta2: float, eps_hat: float,
              step_size: float) -> None:
    """One Adam(W) step in place: ``param *= decay`` (AdamW's 1 - lr wd; None: none), then
    m = b1 m + (1 - b1) g, v = b2 v + (1 - b2) g^2, param -= step_size m / (sqrt(v) + eps_hat);
    ``tmp``: a scratch array of the parameter's shape for the NumPy path."""
    function, code = _native("hpcpar_adam", param, grad, m, v)
    if function is not None and function(_pointer(param), _pointer(grad), _pointer(m), _pointer(v), param.size,
                                         code, 1.0 if decay is None else decay, beta1, 1.0 - beta1, beta2,
                                         1.0 - beta2, eps_hat, step_size, decay is not None) == 0:
        return
    xp = get_array_module(param)
    if decay is not None:
        param *= decay
    m *= beta1
    m += xp.multiply(grad, 1.0 - beta1, out=tmp)
    v *= beta2
    xp.multiply(grad, grad, out=tmp)
    tmp *= 1.0 - beta2
    v += tmp
    xp.sqrt(v, out=tmp)
    tmp += eps_hat
    xp.divide(m, tmp, out=tmp)
    tmp *= step_size
    param -= tmp


def layer_norm(x, weight, bias, eps: float) -> tuple:
    """``(out, xhat, mean, rstd)`` of LayerNorm over the last axis: mean and rstd = 1/sqrt(var + eps)
    per row (keepdims), xhat = (x - mean) rstd, out = xhat weight + bias (either may be None)."""
    params = [p for p in (weight, bias) if p is not None]
    function, code = _native("hpcpar_layer_norm", x) if all(_same_kind(x, p) for p in params) else (None, None)
    if function is not None:
        dim = x.shape[-1]
        out, xhat = np.empty_like(x), np.empty_like(x)
        mean, rstd = np.empty(x.shape[:-1] + (1,), x.dtype), np.empty(x.shape[:-1] + (1,), x.dtype)
        if function(_pointer(x), _pointer(weight), _pointer(bias), _pointer(out), _pointer(xhat), _pointer(mean),
                    _pointer(rstd), x.size // max(dim, 1), dim, code, eps) == 0:
            return out, xhat, mean, rstd
    xp = get_array_module(x)
    mean = x.mean(axis=-1, keepdims=True)
    xhat = x - mean  # a new array
    out = xhat * xhat
    rstd = out.mean(axis=-1, keepdims=True)
    rstd += eps
    xp.sqrt(rstd, out=rstd)
    xp.reciprocal(rstd, out=rstd)
    xhat *= rstd
    if weight is not None:
        xp.multiply(xhat, weight, out=out)
    else:
        out[...] = xhat
    if bias is not None:
        out += bias
    return out, xhat, mean, rstd


def layer_norm_backward(grad, xhat, rstd, weight, weight_grad: bool, bias_grad: bool) -> tuple:
    """``(dx, dweight or None, dbias or None)``: dx = rstd (gx - mean(gx) - xhat mean(gx xhat)),
    gx = grad weight; dweight = sum over rows of grad xhat, dbias of grad. ``xhat`` may be
    overwritten (the graph is single-use)."""
    dim = xhat.shape[-1]
    arrays = [a for a in (weight,) if a is not None]
    function, code = (_native("hpcpar_layer_norm_backward", grad, xhat)
                      if all(_same_kind(xhat, a) for a in arrays) else (None, None))
    if function is not None:
        dx = np.empty_like(xhat)
        dw = np.zeros(dim, xhat.dtype) if weight_grad else None
        db = np.zeros(dim, xhat.dtype) if bias_grad else None
        rstd_rows, scratch = np.ascontiguousarray(rstd), np.empty(2 * dim, xhat.dtype)  # alive through the call
        if function(_pointer(grad), _pointer(xhat), _pointer(rstd_rows), _pointer(weight), _pointer(dx), _pointer(dw),
                    _pointer(db), _pointer(scratch), xhat.size // max(dim, 1), dim, code) == 0:
            return dx, dw, db
    g_xhat = grad * weight if weight is not None else grad.copy()  # a temporary updated in place
    prod = grad * xhat
    dweight = prod.reshape(-1, dim).sum(axis=0) if weight_grad else None
    if weight is not None:
        prod *= weight  # g_xhat * xhat
    dbias = grad.reshape(-1, dim).sum(axis=0) if bias_grad else None
    proj = prod.mean(axis=-1, keepdims=True)
    g_xhat -= g_xhat.mean(axis=-1, keepdims=True)
    xhat *= proj
    g_xhat -= xhat
    g_xhat *= rstd
    return g_xhat, dweight, dbias


def softmax_rows(x, axis, in_place=False):
    """Numerically stable softmax along ``axis`` (NumPy or CuPy); ``in_place`` overwrites ``x``."""
    xp = get_array_module(x)
    peak = x.max(axis=axis, keepdims=True)
    if in_place:
        x -= peak
    else:
        x = x - peak
    xp.exp(x, out=x)
    total = x.sum(axis=axis, keepdims=True)
    x *= xp.reciprocal(total, out=total)  # one division per row, then multiplications
    return x


def attention_softmax(scores, causal: bool):
    """Softmax in place over the last axis of (..., T, T) scores, with the causal mask (-inf above
    the diagonal) when ``causal``: two native passes around NumPy's exp, or the NumPy sequence."""
    xp, steps = get_array_module(scores), scores.shape[-1]
    function, code = _native("hpcpar_softmax_shift", scores)
    if function is not None and function(_pointer(scores), scores.size // steps, steps, causal, code) == 0:
        xp.exp(scores, out=scores)
        if _library()["hpcpar_softmax_scale"](_pointer(scores), scores.size // steps, steps, code) == 0:
            return scores
    if causal:  # -inf above the diagonal: a key after the query gets probability 0
        scores += xp.where(xp.tri(steps, dtype=bool), scores.dtype.type(0), scores.dtype.type(-xp.inf))
    return softmax_rows(scores, -1, in_place=True)


def _same_kind(x, other) -> bool:
    """Whether a LayerNorm parameter can go to the loop with ``x``: a contiguous vector of its dtype."""
    return (type(other) is np.ndarray and other.dtype == x.dtype and other.flags.c_contiguous
            and other.shape == (x.shape[-1],))


def disagreement(functions) -> str | None:
    """Where the native loops' bits differ from the NumPy path's on a probe (float32 and float64,
    magnitudes from 1e-4 to 1e4, odd lengths for the vector loops' tails, LayerNorm rows of 260
    (over 128: the pairwise sum's halves) of scales from 1e-3 to 1e3), or None."""
    rng = np.random.default_rng(0)
    for dtype in (np.float32, np.float64):
        x = (rng.standard_normal(4099) * 10.0 ** rng.uniform(-4, 4, 4099)).astype(dtype)
        t, grad = np.tanh(x), rng.standard_normal(4099).astype(dtype)
        state = (x, grad, np.abs(grad) * 0.1, grad * grad * 1e-3)
        rows = (rng.standard_normal((3, 37, 260)) * 10.0 ** rng.uniform(-3, 3, (3, 37, 1))).astype(dtype)
        seed, weight, bias = (rng.standard_normal(shape).astype(dtype) for shape in (rows.shape, 260, 260))
        scores = (rng.standard_normal((2, 3, 131, 131)) * 10.0 ** rng.uniform(-2, 2, (2, 3, 131, 1))).astype(dtype)
        results = []
        for lib in (functions, None):
            _state["lib"] = lib  # the path the functions below take
            p, g, m, v = (a.copy() for a in state)
            adam_step(p, g, m, v, np.empty_like(p), 1 - 1e-5, 0.9, 0.95, 5e-9, 1e-3)
            forward = layer_norm(rows, weight, bias, 1e-5)
            results.append((gelu_tanh_argument(x, np.empty_like(x), 0.044715, 0.79788),
                            gelu_from_tanh(x, t, np.empty_like(x)), gelu_gradient(x, t, grad, 0.044715, 0.79788),
                            p, m, v, *forward, *layer_norm_backward(seed, forward[1].copy(), forward[3], weight,
                                                                    True, True),
                            attention_softmax(scores.copy(), True), attention_softmax(scores.copy(), False)))
        for name, ours, theirs in zip(("gelu argument", "gelu", "gelu gradient", "adam p", "adam m", "adam v",
                                       "layer norm", "layer norm xhat", "layer norm mean", "layer norm rstd",
                                       "layer norm dx", "layer norm dweight", "layer norm dbias",
                                       "causal softmax", "softmax"), *results):
            if not np.array_equal(ours, theirs):
                return f"{name}, {np.dtype(dtype).name}"
    return None
