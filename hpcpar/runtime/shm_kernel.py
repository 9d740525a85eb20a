"""The native loop of the shared-memory sums: ``build/libhpcpar_shm.so`` (``native/shm_reduce.c``).

``reduce_into(sources, targets, divisor)`` does what ``shm_reduce.reduce_into`` does for a sum
(and a mean) in one C call over a rank's whole slice: the sum of the sources in MPICH's order,
divided for a mean, written into every target, block by block while the block is in L1, and
for two ranks in one pass (each element read once, written into both buffers). No Python runs
between blocks and ctypes releases the GIL for the call. The results are NumPy's bit for bit:
the library is checked against ``shm_reduce.reference`` when it is loaded, and where it is not
built, or fails that check, or the dtype or operation is not one it does, ``reduce_into``
returns False and the caller runs the NumPy loop.
"""
from __future__ import annotations

import ctypes

import numpy as np

from ..native import library_path
from .shm_reduce import reference

LIB_NAME = "libhpcpar_shm.so"  # next to libhpcpar_native.so (CMakeLists.txt builds both)
DTYPE_CODES = {np.dtype(np.float32): 0, np.dtype(np.float64): 1, np.dtype(np.int32): 2, np.dtype(np.int64): 3}
_state: dict = {}


def _load():
    """The C function, or None (not built, or not equal to NumPy on a probe)."""
    if "sum" not in _state:
        _state["sum"] = None
        try:
            lib = ctypes.CDLL(str(library_path().parent / LIB_NAME))
        except OSError:
            return None
        function = lib.hpcpar_shm_sum
        function.restype = ctypes.c_int
        function.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t,
                             ctypes.c_int, ctypes.c_double]
        _state["sum"] = function if _agrees_with_numpy(function) else None
    return _state["sum"]


def _agrees_with_numpy(function) -> bool:
    """Three and two operands (the tree and the one-pass loop), float32 over many magnitudes."""
    rng = np.random.default_rng(0)
    for n in (3, 2):
        values = [(rng.standard_normal(5003) * 10.0 ** rng.uniform(-4, 4, 5003)).astype(np.float32)
                  for _ in range(n)]
        buffers = [v.copy() for v in values]
        if _call(function, buffers, buffers, 0.0) != 0:
            return False
        if not all(np.array_equal(b, reference(values)) for b in buffers):
            return False
    return True


def _pointers(arrays) -> ctypes.Array:
    return (ctypes.c_void_p * len(arrays))(*[a.ctypes.data for a in arrays])


def _call(function, sources, targets, divisor: float) -> int:
    return function(_pointers(sources), len(sources), _pointers(targets), len(targets), sources[0].size,
                    DTYPE_CODES[sources[0].dtype], float(divisor))


def available() -> bool:
    """Whether the native loop is built and gives NumPy's results."""
    return _load() is not None


def prepare(sources: list, targets: list, op: str, divisor: int = 0):
    """A call without arguments that sets every target to the sum of ``sources`` in MPICH's order
    (divided by ``divisor`` unless 0), its pointers computed once (for buffers reduced again and
    again, as DDP's buckets are); None when the native loop is not there or does not do ``op``
    on this dtype (it does "sum" and "mean" on float32/64 and int32/64; a mean only on floats).

    Sources and targets are contiguous 1-D arrays of one length and dtype, each either a
    distinct buffer or the very same memory as another (a source may be a target). The call
    keeps them alive; it must not outlive the memory they view.
    """
    function = _load()
    dtype = sources[0].dtype
    if function is None or op not in ("sum", "mean") or dtype not in DTYPE_CODES or (divisor and dtype.kind != "f"):
        return None
    arrays = (list(sources), list(targets))
    args = (_pointers(sources), len(sources), _pointers(targets), len(targets), sources[0].size, DTYPE_CODES[dtype],
            float(divisor))

    def run() -> None:
        if function(*args) != 0:
            raise RuntimeError(f"{LIB_NAME}: hpcpar_shm_sum refused {len(arrays[0])} sources of {dtype}")

    return run


def reduce_into(sources: list, targets: list, op: str, divisor: int = 0) -> bool:
    """``prepare(...)()`` once: True when done, False (nothing done) where ``prepare`` gives None."""
    run = prepare(sources, targets, op, divisor)
    if run is None:
        return False
    run()
    return True
