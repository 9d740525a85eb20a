"""The guard's device array: NumPy memory that behaves like a CuPy array on a GPU.

It refuses everything that would silently copy it to the host (``np.asarray`` through
``__array__``, ``float()``, ``int()``, ``bool()``, ``.item()``, ``.tolist()``, formatting its
values, NumPy functions and ufuncs) and host arrays where CuPy would refuse them; the only
ways out are the explicit, counted copies (``asnumpy``, ``.get()``; ``backend.to_host``).
Every operation runs on the current stream and is checked against stream order
(``streams.check_ready``); every array remembers the stream and the operation that last wrote
it, shared by its views.
"""
from __future__ import annotations

import sys

import numpy as np

from .streams import check_ready, check_synchronized, get_current_stream, stats

# NumPy functions that read only an array's metadata (np.ndim(x) works on CuPy arrays too)
METADATA = frozenset((np.ndim, np.shape, np.size, np.result_type))
# dtypes CuPy supports (no bfloat16, no object, no strings)
SUPPORTED_KINDS = frozenset("biufc")


class TransferGuardError(TypeError):
    """An implicit device-to-host transfer, a host array where CuPy takes none, or a dtype CuPy lacks."""


class Written:
    """The stream that last wrote a buffer and the number of that operation (shared by views)."""

    __slots__ = ("stream", "seq")

    def __init__(self, stream=None, seq: int = 0):
        self.stream, self.seq = stream, seq


def refuse(what: str):
    stats.implicit += 1
    raise TransferGuardError(f"{what} on a device array is an implicit device-to-host transfer (refused by the "
                             f"transfer guard): copy explicitly with hpcpar.backend.to_host (cupy.asnumpy)")


def call_site() -> str:
    """The first frame outside the guard and the backend, "file:line in function": who asked for a copy."""
    frame = sys._getframe(1)
    while frame is not None and ("/hpcpar/guard/" in frame.f_code.co_filename
                                 or frame.f_code.co_filename.endswith("/hpcpar/backend.py")):
        frame = frame.f_back
    return "?" if frame is None else f"{frame.f_code.co_filename}:{frame.f_lineno} in {frame.f_code.co_name}"


def count_transfer(direction: str, nbytes: int) -> None:
    if direction == "to_device":
        stats.to_device += 1
        stats.bytes_to_device += int(nbytes)
    else:
        stats.to_host += 1
        stats.bytes_to_host += int(nbytes)
    stats.log.append((direction, int(nbytes), call_site()))


def check_dtype(dtype) -> None:
    dtype = np.dtype(dtype)
    if dtype.kind not in SUPPORTED_KINDS or dtype.names is not None:
        raise TransferGuardError(f"CuPy has no dtype {dtype} (device arrays hold bool, integers, float16/32/64, "
                                 f"complex)")


class ndarray:  # noqa: N801 - named after cupy.ndarray, which isinstance checks look for
    """``cupy.ndarray`` on the host's memory, under the transfer guard."""

    __slots__ = ("_a", "_written", "__weakref__")
    __array_priority__ = 100
    __hash__ = None

    def __init__(self, shape, dtype=float):
        wrap(np.empty(shape, dtype=dtype), self)

    # -- what it is ---------------------------------------------------------------------------
    shape = property(lambda self: self._a.shape)
    dtype = property(lambda self: self._a.dtype)
    ndim = property(lambda self: self._a.ndim)
    size = property(lambda self: self._a.size)
    nbytes = property(lambda self: self._a.nbytes)
    itemsize = property(lambda self: self._a.itemsize)
    strides = property(lambda self: self._a.strides)
    flags = property(lambda self: self._a.flags)
    T = property(lambda self: self.transpose())

    def __len__(self) -> int:
        return len(self._a)

    def __repr__(self) -> str:
        return f"<guard ndarray shape={self.shape} dtype={self.dtype}>"

    __str__ = __repr__

    def __format__(self, spec: str) -> str:
        return refuse(f"format(x, {spec!r})") if spec else repr(self)

    # -- the refused ways to the host ---------------------------------------------------------
    def __array__(self, dtype=None, copy=None):
        refuse("np.asarray / np.array (__array__)")

    def __float__(self):
        refuse("float()")

    def __int__(self):
        refuse("int()")

    def __index__(self):
        refuse("use as an index (__index__)")

    def __bool__(self):
        refuse("bool() (an if or and/or on a device value)")

    def __complex__(self):
        refuse("complex()")

    def item(self, *args):
        refuse(".item()")

    def tolist(self):
        refuse(".tolist()")

    def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
        refuse(f"the NumPy ufunc np.{ufunc.__name__}.{method} (use xp = get_array_module(x))")

    def __array_function__(self, func, types, args, kwargs):
        if func in METADATA:  # what the array is, not what it holds: no transfer (as on CuPy)
            return func(*(unwrap(a, []) for a in args), **kwargs)
        refuse(f"the NumPy function np.{func.__name__} (use xp = get_array_module(x))")

    @property
    def __cuda_array_interface__(self) -> dict:
        """What CUDA-aware MPI (through mpi4py) reads: the pointer, once the producer is synchronized."""
        check_synchronized(self)
        if not self._a.flags.c_contiguous:
            raise TransferGuardError("MPI needs a C-contiguous device buffer")
        return {"shape": self.shape, "typestr": self.dtype.str, "data": (self._a.ctypes.data, False),
                "strides": None, "version": 2}

    # -- explicit, counted copies -------------------------------------------------------------
    def get(self, stream=None, order="C", out=None) -> np.ndarray:
        """``cupy.ndarray.get``: an explicit device-to-host copy."""
        return asnumpy(self, stream, order, out)

    def set(self, arr, stream=None) -> None:
        """``cupy.ndarray.set``: an explicit host-to-device copy into this array."""
        host = np.asarray(arr)
        if host.shape != self.shape:
            raise ValueError(f"set: shape {host.shape} != {self.shape}")
        stream = stream or get_current_stream()
        check_ready(self, stream)
        self._a[...] = host
        mark_written(self, stream)
        count_transfer("to_device", host.nbytes)

    # -- indexing -----------------------------------------------------------------------------
    def __getitem__(self, key):
        return apply(np.ndarray.__getitem__, (self, key), {})

    def __setitem__(self, key, value) -> None:
        stream = get_current_stream()
        inputs: list = []
        key, value = unwrap(key, inputs), unwrap(value, inputs)
        for array in (self, *inputs):
            check_ready(array, stream)
        self._a[key] = value
        mark_written(self, stream)

    def fill(self, value) -> None:
        self[...] = value


def wrap(a: np.ndarray, into: ndarray | None = None, written: Written | None = None) -> ndarray:
    check_dtype(a.dtype)
    out = into if into is not None else object.__new__(ndarray)
    out._a = a
    out._written = written or Written()
    return out


def mark_written(array: ndarray, stream) -> None:
    array._written.stream, array._written.seq = stream, stream._advance()


def unwrap(value, inputs: list):
    """Replace device arrays by their NumPy memory (collecting them in ``inputs``); refuse host arrays."""
    if isinstance(value, ndarray):
        inputs.append(value)
        return value._a
    if isinstance(value, np.ndarray):
        stats.implicit += 1
        raise TransferGuardError("a NumPy array passed to a device operation: CuPy refuses it; copy it to the "
                                 "device explicitly (backend.to_device / xp.asarray)")
    if isinstance(value, (list, tuple)):
        return type(value)(unwrap(v, inputs) for v in value)
    if isinstance(value, dict):
        return {k: unwrap(v, inputs) for k, v in value.items()}
    return value


def apply(function, args: tuple, kwargs: dict):
    """Run ``function`` (a NumPy function or method) as one operation on the current stream."""
    stream = get_current_stream()
    out = kwargs.get("out")
    inputs: list = []
    args, kwargs = unwrap(args, inputs), unwrap(kwargs, inputs)
    for array in inputs:
        check_ready(array, stream)
    result = function(*args, **kwargs)
    seq = stream._advance()
    if isinstance(out, ndarray):  # written in place, perhaps through a view of another array
        out._written.stream, out._written.seq = stream, seq
        return out
    return wrap_result(result, inputs, stream, seq)


def wrap_result(result, inputs: list, stream, seq: int):
    if isinstance(result, tuple):
        return tuple(wrap_result(r, inputs, stream, seq) for r in result)
    if isinstance(result, (np.generic, bool, int, float, complex)):
        result = np.asarray(result)  # CuPy returns 0-d device arrays where NumPy returns scalars
    if not isinstance(result, np.ndarray):
        return result
    for array in inputs:
        if result is array._a:  # written in place (out=)
            array._written.stream, array._written.seq = stream, seq
            return array
    for array in inputs:
        if np.may_share_memory(result, array._a):  # a view: same memory, same last write
            return wrap(result, written=array._written)
    return wrap(result, written=Written(stream, seq))


def asnumpy(a, stream=None, order="C", out=None) -> np.ndarray:
    """``cupy.asnumpy``: the one way to the host; counted. Host data passes through uncounted."""
    if not isinstance(a, ndarray):
        return np.asarray(a)
    stream = stream or get_current_stream()
    check_ready(a, stream)
    host = np.array(a._a, order=order)
    stream.host_synced = max(stream.host_synced, stream.seq)  # the copy blocks until the stream got there
    count_transfer("to_host", host.nbytes)
    if out is not None:
        out[...] = host
        return out
    return host


def _method(name: str):
    numpy_method = getattr(np.ndarray, name)

    def method(self, *args, **kwargs):
        return apply(numpy_method, (self, *args), kwargs)

    method.__name__ = name
    method.__doc__ = f"``cupy.ndarray.{name}``"
    return method


# cupy.ndarray's documented methods that hpcpar may use (docs.cupy.dev, reference/generated/cupy.ndarray)
METHODS = ("all", "any", "argmax", "argmin", "argsort", "astype", "clip", "conj", "copy", "cumsum", "diagonal",
           "dot", "flatten", "max", "mean", "min", "nonzero", "prod", "ravel", "repeat", "reshape", "round",
           "squeeze", "std", "sum", "swapaxes", "take", "transpose", "var", "view")
OPERATORS = ("add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "matmul", "and", "or", "xor",
             "lshift", "rshift")
COMPARISONS = ("lt", "le", "gt", "ge", "eq", "ne")
UNARY = ("neg", "pos", "abs", "invert")

for _name in METHODS:
    setattr(ndarray, _name, _method(_name))
for _op in OPERATORS:
    for _dunder in (f"__{_op}__", f"__r{_op}__", f"__i{_op}__"):
        setattr(ndarray, _dunder, _method(_dunder))
for _op in COMPARISONS + UNARY:
    setattr(ndarray, f"__{_op}__", _method(f"__{_op}__"))
