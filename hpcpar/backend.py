"""Array backend: NumPy on CPUs, CuPy on GPUs, chosen once per process.

Everything in hpcpar reaches the array library through ``xp = get_array_module(x)``
(docs/architecture.md), so one code path serves both. ``import cupy`` is guarded:
on a machine without CuPy (or without a working CUDA driver) everything still imports
and runs on NumPy.
"""
from __future__ import annotations


import numpy as np

from . import host

try:  # CuPy is optional; a broken CUDA install must not break CPU users either.
    import cupy as _cupy
except Exception:  # noqa: BLE001 - ImportError, CUDA driver errors, ...
    _cupy = None

DEVICES = ("auto", "cpu", "cuda")


def cupy_available() -> bool:
    return _cupy is not None


def gpu_count() -> int:
    """Number of CUDA devices CuPy can see (0 without CuPy or without a driver)."""
    if _cupy is None:
        return 0
    try:
        return int(_cupy.cuda.runtime.getDeviceCount())
    except Exception:  # noqa: BLE001 - no driver, no device
        return 0


def resolve_device(device: str = "auto") -> str:
    """Turn "auto" into "cuda" when a GPU is usable, else "cpu"; validate the name."""
    if device not in DEVICES:
        raise ValueError(f"device must be one of {DEVICES}, got {device!r}")
    if device == "auto":
        return "cuda" if gpu_count() > 0 else "cpu"
    if device == "cuda" and gpu_count() == 0:
        reason = "CuPy is not installed (pip install 'hpcpar[gpu]')" if _cupy is None else "CuPy sees no CUDA device"
        raise RuntimeError(f"device='cuda' was requested but {reason}")
    return device


def select_gpu(node_local_rank: int) -> int:
    """Bind this process to GPU ``node_local_rank % device_count``.

    Must run before the first GPU allocation: CuPy allocates on the current device, and a
    buffer made on the wrong one stays there. Returns the device id.
    """
    count = gpu_count()
    if count == 0:
        raise RuntimeError("select_gpu called on a machine without a usable GPU")
    device_id = node_local_rank % count
    _cupy.cuda.Device(device_id).use()
    return device_id


def array_module(device: str):
    """The array library for a resolved device name."""
    return _cupy if device == "cuda" else np


def get_array_module(*arrays):
    """``cupy`` if any argument is a CuPy array, else ``numpy`` (works without CuPy)."""
    if _cupy is not None:
        for a in arrays:
            if isinstance(a, _cupy.ndarray):
                return _cupy
    return np


def is_gpu_array(a) -> bool:
    return _cupy is not None and isinstance(a, _cupy.ndarray)


def to_host(a) -> np.ndarray:
    """A NumPy copy (or the array itself when it already lives on the host)."""
    if is_gpu_array(a):
        return _cupy.asnumpy(a)
    return np.asarray(a)


def to_device(a, xp):
    """Move a host or device array to the array library ``xp``."""
    if xp is np:
        return to_host(a)
    return xp.asarray(a)


def synchronize(a=None) -> None:
    """Wait for the current CUDA stream; a no-op for NumPy.

    MPI reads device memory directly, outside CuPy's stream order, so every MPI call on a
    CuPy buffer must come after this or it may send stale data.
    """
    if _cupy is not None and (a is None or is_gpu_array(a)):
        if gpu_count() > 0:
            _cupy.cuda.get_current_stream().synchronize()


def describe() -> dict:
    """Facts for ``hpcpar info``."""
    info = {"numpy": np.__version__, "cupy": None, "gpus": 0}
    if _cupy is not None:
        info["cupy"] = _cupy.__version__
        info["gpus"] = gpu_count()
    try:
        import ml_dtypes  # noqa: F401

        info["bfloat16_on_cpu"] = True
    except ImportError:
        info["bfloat16_on_cpu"] = False
    info["blas_threads"] = host.blas_threads()
    return info
