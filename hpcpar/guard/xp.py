"""The guard's array module: the subset of CuPy's API that hpcpar uses, on NumPy memory.

``backend.array_module("guard")`` returns this module and ``get_array_module`` returns it for
guard arrays, so hpcpar's one code path runs here as it would on CuPy. Every name below is in
CuPy's documented API (docs.cupy.dev, "API reference"); a name CuPy lacks is not here, so code
that needs it fails under the guard as it would fail on a GPU. Ufuncs are callable only: CuPy
has no portable ``ufunc.at``/``reduceat`` (older releases have no ufunc methods, newer ones
only for some ufuncs); scatter-adds go through ``scatter_add`` (``cupyx.scatter_add``).
"""
from __future__ import annotations

import builtins
import types

import numpy as np

from .array import TransferGuardError, apply, asnumpy, check_dtype, count_transfer, mark_written, ndarray, wrap
from .streams import Event, Stream, check_ready, get_current_stream, synchronize_device

# dtypes and constants (cupy re-exports NumPy's)
bool_, int8, int16, int32, int64 = np.bool_, np.int8, np.int16, np.int32, np.int64
uint8, uint16, uint32, uint64 = np.uint8, np.uint16, np.uint32, np.uint64
float16, float32, float64, complex64, complex128 = np.float16, np.float32, np.float64, np.complex64, np.complex128
dtype, finfo, iinfo, inf, nan, pi, e, newaxis = np.dtype, np.finfo, np.iinfo, np.inf, np.nan, np.pi, np.e, np.newaxis
result_type, can_cast, promote_types = np.result_type, np.can_cast, np.promote_types


class ufunc:  # noqa: N801 - named after cupy.ufunc
    """A CuPy ufunc: callable, with none of NumPy's methods (see the module docstring)."""

    def __init__(self, name: str):
        self.name = self.__name__ = name
        self._numpy = getattr(np, name)

    def __call__(self, *args, **kwargs):
        return apply(self._numpy, args, kwargs)

    def __getattr__(self, method: str):
        raise AttributeError(f"cupy.{self.name}.{method} is not portable CuPy (older releases have no ufunc "
                             f"methods, newer ones only for some ufuncs): use backend.scatter_add for add.at, "
                             f"a sort and a scatter-add for reduceat (refused by the transfer guard)")

    def __repr__(self) -> str:
        return f"<guard ufunc {self.name}>"


# cupy's ufuncs (docs.cupy.dev reference/ufunc.html) that hpcpar calls or may call
UFUNCS = ("add", "subtract", "multiply", "divide", "true_divide", "floor_divide", "negative", "power", "remainder",
          "mod", "absolute", "sign", "exp", "exp2", "log", "log2", "log10", "expm1", "log1p", "logaddexp", "sqrt",
          "square",
          "reciprocal", "sin", "cos", "tanh", "maximum", "minimum", "fmax", "fmin", "greater", "greater_equal",
          "less", "less_equal", "equal", "not_equal", "logical_and", "logical_or", "logical_xor", "logical_not",
          "isfinite", "isinf", "isnan", "floor", "ceil", "rint", "bitwise_and", "bitwise_or", "bitwise_xor",
          "invert", "left_shift", "right_shift")
# cupy's documented functions (routines: creation, manipulation, math, sorting, logic, statistics, indexing)
FUNCTIONS = ("zeros", "ones", "empty", "full", "zeros_like", "ones_like", "empty_like", "full_like", "arange",
             "linspace", "eye", "identity", "tri", "tril", "triu", "concatenate", "stack", "hstack", "vstack",
             "split", "array_split", "reshape", "ravel", "transpose", "swapaxes", "moveaxis", "expand_dims",
             "squeeze", "broadcast_to", "pad", "repeat", "tile", "flip", "where", "take", "take_along_axis",
             "nonzero", "flatnonzero", "count_nonzero", "argsort", "sort", "argpartition", "argmax", "argmin",
             "dot", "matmul", "einsum", "tensordot", "outer", "sum", "prod", "mean", "var", "std", "max", "min",
             "amax", "amin", "cumsum", "clip", "abs", "all", "any", "allclose", "isclose", "array_equal",
             "bincount")
for _name in UFUNCS:
    globals()[_name] = ufunc(_name)


def _function(name: str):
    numpy_function = getattr(np, name)

    def function(*args, **kwargs):
        return apply(numpy_function, args, kwargs)

    function.__name__ = function.__qualname__ = name
    function.__doc__ = f"``cupy.{name}``"
    return function


for _name in FUNCTIONS:
    globals()[_name] = _function(_name)


def copyto(dst, src, casting="same_kind", where=True):  # noqa: F811 - writes dst in place
    """``cupy.copyto``."""
    apply(np.copyto, (dst, src), {"casting": casting, "where": where})
    mark_written(dst, get_current_stream())


def asarray(a, dtype=None, order=None):
    """``cupy.asarray``: device arrays pass through (cast if asked); host data is a counted copy."""
    if isinstance(a, ndarray):
        return a if dtype is None or np.dtype(dtype) == a.dtype else a.astype(dtype)
    return _from_host(np.asarray(a, dtype=dtype, order=order))


def array(a, dtype=None, copy=True, order="K", ndmin=0):
    """``cupy.array``: a copy (a counted host-to-device one for host data)."""
    if isinstance(a, ndarray):
        out = a.astype(a.dtype if dtype is None else dtype, copy=True)
        return out if out.ndim >= ndmin else out.reshape((1,) * (ndmin - out.ndim) + out.shape)
    return _from_host(np.array(a, dtype=dtype, order=order, ndmin=ndmin))


def ascontiguousarray(a, dtype=None):
    """``cupy.ascontiguousarray``."""
    if not isinstance(a, ndarray):
        return _from_host(np.ascontiguousarray(a, dtype=dtype))
    return apply(np.ascontiguousarray, (a,), {"dtype": dtype})


def _from_host(host: np.ndarray) -> ndarray:
    check_dtype(host.dtype)
    stream = get_current_stream()
    out = wrap(np.array(host, copy=True))
    mark_written(out, stream)
    count_transfer("to_device", host.nbytes)
    return out


def get_array_module(*args):
    """``cupy.get_array_module``: this module for guard arrays, else NumPy."""
    return _this if builtins.any(isinstance(a, ndarray) for a in args) else np


def scatter_add(a, slices, value) -> None:
    """``cupyx.scatter_add(a, slices, value)``: ``a[slices] += value`` with repeats summed, in place."""
    apply(np.add.at, (a, slices, value), {})
    mark_written(a, get_current_stream())


def _as_strided(x, shape=None, strides=None):
    """``cupy.lib.stride_tricks.as_strided``: a view of the same memory."""
    return apply(np.lib.stride_tricks.as_strided, (x,), {"shape": shape, "strides": strides})


class _Generator:
    """``cupy.random.Generator`` (from ``cupy.random.default_rng``): draws on the device."""

    def __init__(self, seed=None):
        self._rng = np.random.default_rng(seed)

    def _draw(self, method: str, *args, **kwargs):
        stream = get_current_stream()
        out = wrap(np.asarray(getattr(self._rng, method)(*args, **kwargs)))
        mark_written(out, stream)
        return out

    def random(self, size=None, dtype=np.float64, out=None):
        return self._draw("random", size, dtype=dtype)

    def integers(self, low, high=None, size=None, dtype=np.int64, endpoint=False):
        return self._draw("integers", low, high, size, dtype=dtype, endpoint=endpoint)

    def standard_normal(self, size=None, dtype=np.float64, out=None):
        return self._draw("standard_normal", size, dtype=dtype)

    def uniform(self, low=0.0, high=1.0, size=None, dtype=np.float64):
        return self._draw("uniform", low, high, size).astype(dtype, copy=False)


class _Device:
    """``cupy.cuda.Device``: one device, id 0."""

    def __init__(self, device=None):
        self.id = 0

    def use(self) -> None:
        pass

    def synchronize(self) -> None:
        synchronize_device()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        pass


class MemoryPool:
    """``cupy.cuda.MemoryPool``'s counters, for code that reports memory (the guard holds none)."""

    def used_bytes(self) -> int:
        return 0

    def total_bytes(self) -> int:
        return 0

    def free_all_blocks(self) -> None:
        pass


_pool = MemoryPool()


def get_default_memory_pool() -> MemoryPool:
    return _pool


def _qr(a, mode="reduced"):
    """``cupy.linalg.qr``."""
    return apply(np.linalg.qr, (a,), {"mode": mode})


def _norm(x, ord=None, axis=None, keepdims=False):  # noqa: A002 - NumPy's name
    """``cupy.linalg.norm``."""
    return apply(np.linalg.norm, (x,), {"ord": ord, "axis": axis, "keepdims": keepdims})


random = types.SimpleNamespace(default_rng=_Generator, Generator=_Generator)
linalg = types.SimpleNamespace(qr=_qr, norm=_norm)
lib = types.SimpleNamespace(stride_tricks=types.SimpleNamespace(as_strided=_as_strided))
cuda = types.SimpleNamespace(
    Stream=Stream, Event=Event, get_current_stream=get_current_stream, Device=_Device, MemoryPool=MemoryPool,
    runtime=types.SimpleNamespace(getDeviceCount=lambda: 1, deviceSynchronize=synchronize_device))

__all__ = ["ndarray", "asarray", "array", "asnumpy", "ascontiguousarray", "get_array_module", "scatter_add",
           "random", "linalg", "lib", "cuda", "check_ready", "TransferGuardError", *UFUNCS, *FUNCTIONS]

import sys as _sys  # noqa: E402

_this = _sys.modules[__name__]
