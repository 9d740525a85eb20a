"""Copying a load's checked bytes into their destinations in one native call: ``hpcpar_copy_pieces``
of ``build/libhpcpar_crc.so`` (native/ckpt_copy.c: large pieces with streaming stores, which
write the destination without reading it first), else NumPy's copy. Both copy the same bytes."""
from __future__ import annotations

import ctypes

import numpy as np

from .crc import native_library

_state: dict = {}


def _native():
    if "copy" not in _state:
        lib = native_library()
        _state["copy"] = getattr(lib, "hpcpar_copy_pieces", None) if lib is not None else None
        if _state["copy"] is not None:
            _state["copy"].restype = None
            _state["copy"].argtypes = [ctypes.c_size_t, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
    return _state["copy"]


def copy_pieces(pairs: list) -> None:
    """``destination[...] = source`` for each (destination, source) pair of uint8 arrays of the
    same size, contiguous (the GIL released for the whole copy when the library is built)."""
    native = _native()
    if native is None:
        for destination, source in pairs:
            np.copyto(destination, source)
        return
    table = np.array([(d.ctypes.data, s.ctypes.data, d.size) for d, s in pairs if d.size],
                     dtype=np.uint64).reshape(-1, 3)
    columns = [np.ascontiguousarray(table[:, k]) for k in range(3)]
    native(len(table), *(column.ctypes.data for column in columns))
