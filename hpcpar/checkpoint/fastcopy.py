"""Copying a load's checked bytes into their destinations in one native call: ``hpcpar_copy_pieces``
of ``build/libhpcpar_crc.so`` (native/ckpt_copy.c: large pieces with streaming stores, which
write the destination without reading it first), else ``ctypes.memmove`` a piece at a time.
Both copy the same bytes.

The pieces are given as a table of addresses, computed with NumPy from one base address per
mapping: asking each of a load's hundreds of arrays for its address (``.ctypes.data``, ~1.5 us
each) cost more than the rest of the table."""
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


def address(array: np.ndarray) -> int:
    """The first byte of a writable contiguous array (a buffer export: ~4x cheaper than ``.ctypes.data``)."""
    return ctypes.addressof(ctypes.c_char.from_buffer(array))


def copy_spans(destinations: np.ndarray, sources: np.ndarray, lengths: np.ndarray) -> None:
    """``lengths[k]`` bytes from address ``sources[k]`` to address ``destinations[k]`` for each k
    (uint64 arrays; spans that do not overlap; the GIL released for the whole copy when the
    library is built). The caller keeps the memory behind every address alive."""
    table = [np.ascontiguousarray(column, dtype=np.uint64) for column in (destinations, sources, lengths)]
    native = _native()
    if native is None:
        for destination, source, length in zip(*(column.tolist() for column in table)):
            ctypes.memmove(destination, source, length)
        return
    native(table[0].size, *(column.ctypes.data for column in table))


def copy_pieces(pairs: list) -> None:
    """``destination[...] = source`` for each (destination, source) pair of uint8 arrays of the
    same size, contiguous (the destination writable)."""
    pairs = [(d, s) for d, s in pairs if d.size]
    if any(d.size != s.size for d, s in pairs):
        raise ValueError("copy_pieces: a destination and its source differ in size")
    copy_spans(np.array([address(d) for d, _ in pairs], dtype=np.uint64),
               np.array([s.ctypes.data for _, s in pairs], dtype=np.uint64),
               np.array([d.size for d, _ in pairs], dtype=np.uint64))


def copy_arrays(pairs: list) -> None:
    """``destination[...] = source`` for each (destination, source) pair of arrays of one shape:
    host arrays of one dtype, contiguous (the destination writable), in one ``copy_pieces``;
    any others by assignment (a cast, a device array)."""
    fast, slow = [], []
    for destination, source in pairs:
        alike = (isinstance(destination, np.ndarray) and isinstance(source, np.ndarray)
                 and destination.dtype == source.dtype and destination.shape == source.shape
                 and destination.flags.c_contiguous and destination.flags.writeable and source.flags.c_contiguous)
        (fast if alike else slow).append((destination, source))
    if fast:
        copy_pieces([(d.reshape(-1).view(np.uint8), s.reshape(-1).view(np.uint8)) for d, s in fast])
    for destination, source in slow:
        destination[...] = source
