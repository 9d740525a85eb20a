"""CRC-32 of checkpoint bytes: zlib's checksum, computed by ``build/libhpcpar_crc.so`` (carry-less
multiplication, 2-4x zlib's speed here) when it is built and passes a check against zlib, else
by zlib itself. The two give the same values, so either reads what the other wrote."""
from __future__ import annotations

import ctypes
import zlib

import numpy as np

from ..native import library_path

LIB_NAME = "libhpcpar_crc.so"  # next to libhpcpar_native.so (CMakeLists.txt builds both)
_state: dict = {}


def native_library():
    """``libhpcpar_crc.so`` (the checkpoint's native helpers), or None where it is not built."""
    if "lib" not in _state:
        try:
            _state["lib"] = ctypes.CDLL(str(library_path().parent / LIB_NAME))
        except OSError:
            _state["lib"] = None
    return _state["lib"]


def _blocks():
    """The native function over whole 16-byte blocks, or None (not built, no PCLMUL, or wrong)."""
    if "blocks" not in _state:
        _state["blocks"] = None
        lib = native_library()
        if lib is None:
            return None
        lib.hpcpar_crc32_blocks.restype = ctypes.c_uint32
        lib.hpcpar_crc32_blocks.argtypes = [ctypes.c_uint32, ctypes.c_void_p, ctypes.c_size_t]
        if lib.hpcpar_crc32_supported():
            probe = np.random.default_rng(0).integers(0, 256, 4099, dtype=np.uint8)
            blocks = lib.hpcpar_crc32_blocks
            if zlib.crc32(probe[4096:], blocks(7, probe.ctypes.data, 4096)) == zlib.crc32(probe, 7):
                _state["blocks"] = blocks
    return _state["blocks"]


def _spans():
    """The native many-spans function, or None (not built, unsupported, or a library built before it)."""
    if "spans" not in _state:
        spans = getattr(native_library(), "hpcpar_crc32_spans", None) if _blocks() is not None else None
        if spans is not None:
            spans.restype = None
            spans.argtypes = [ctypes.c_void_p, ctypes.c_size_t] + [ctypes.c_void_p] * 3
        _state["spans"] = spans
    return _state["spans"]


def crc32(data, crc: int = 0) -> int:
    """``zlib.crc32(data, crc)`` for any contiguous buffer (bytes, a NumPy array or view)."""
    blocks = _blocks()
    if blocks is None:
        return zlib.crc32(data, crc)
    array = np.frombuffer(data, dtype=np.uint8) if not isinstance(data, np.ndarray) else data.reshape(-1).view(np.uint8)
    whole = array.size & ~15
    if whole < 64:
        return zlib.crc32(array, crc)
    return zlib.crc32(array[whole:], blocks(crc, array.ctypes.data, whole))


def crc32_spans(data: np.ndarray, offsets: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """CRC-32 of each span ``data[offsets[k]: offsets[k] + lengths[k]]`` of a uint8 array, as
    uint32: many MiB chunks in one native call (else zlib, a span at a time)."""
    offsets = np.ascontiguousarray(offsets, dtype=np.uint64)
    lengths = np.ascontiguousarray(lengths, dtype=np.uint64)
    out = np.empty(offsets.size, dtype=np.uint32)
    if out.size and int((offsets + lengths).max()) > data.size:
        raise ValueError(f"crc32_spans: a span ends past the {data.size} bytes given")
    if _spans() is None or not data.size:
        out[:] = [crc32(data[at: at + n]) for at, n in zip(offsets.tolist(), lengths.tolist())]
    elif out.size:
        _spans()(data.ctypes.data, out.size, offsets.ctypes.data, lengths.ctypes.data, out.ctypes.data)
    return out


# The exponent field of each float dtype a checkpoint holds: inf or NaN has all of its bits set.
EXPONENT_MASKS = {"float16": (2, 0x7C00), "bfloat16": (2, 0x7F80), "float32": (4, 0x7F800000),
                  "float64": (8, 0x7FF0000000000000)}


def _check():
    """The native fused CRC and finiteness pass, or None (not built, unsupported, or an older build)."""
    if "check" not in _state:
        check = getattr(native_library(), "hpcpar_crc32_check", None) if _blocks() is not None else None
        if check is not None:
            check.restype = None
            check.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_size_t] + \
                [ctypes.c_void_p] * 5
        _state["check"] = check
    return _state["check"]


def crc32_chunks_and_nonfinite(data: np.ndarray, chunk: int, ranges: list) -> tuple[list[int], list[int]]:
    """(zlib's CRC-32 of each ``chunk`` bytes of the uint8 array ``data``, how many floats of each
    range are inf or NaN), in one pass over ``data``: natively each 64 KiB block is checked as the
    CRC reads it. ``ranges``: (first byte, element count, dtype name), sorted by first byte and
    disjoint; a dtype that is not a float counts 0."""
    floats = [(k, start, count, *EXPONENT_MASKS[dtype]) for k, (start, count, dtype) in enumerate(ranges)
              if dtype in EXPONENT_MASKS and count]
    bad = [0] * len(ranges)
    check = _check()
    if check is None or not data.size or chunk % (64 * 1024):
        crcs = [crc32(data[at: at + chunk]) for at in range(0, data.size, chunk)]
        for k, start, count, width, mask in floats:
            view = data[start: start + count * width].view(f"<u{width}")
            bad[k] = int(np.count_nonzero((view & mask) == mask))
        return crcs, bad
    crcs = np.zeros(-(-data.size // chunk), dtype=np.uint32)
    columns = [np.ascontiguousarray([row[i] for row in floats], dtype=np.uint64) for i in range(1, 5)]
    found = np.zeros(len(floats), dtype=np.uint64)
    check(data.ctypes.data, data.size, chunk, crcs.ctypes.data, len(floats),
          *(c.ctypes.data for c in columns), found.ctypes.data)
    for (k, *_), n in zip(floats, found.tolist()):
        bad[k] = n
    return crcs.tolist(), bad
