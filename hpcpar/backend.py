"""Array backend: NumPy on CPUs, CuPy on GPUs, chosen once per process.

Everything in hpcpar reaches the array library through ``xp = get_array_module(x)``
(docs/architecture.md), so one code path serves both. ``import cupy`` is guarded:
on a machine without CuPy (or without a working CUDA driver) everything still imports
and runs on NumPy.
"""
from __future__ import annotations


import os

import numpy as np

from . import guard, host

try:  # CuPy is optional; a broken CUDA install must not break CPU users either.
    import cupy as _cupy
except Exception:  # noqa: BLE001 - ImportError, CUDA driver errors, ...
    _cupy = None

DEVICES = ("auto", "cpu", "cuda", "guard")  # guard: the CuPy path on CPUs under the transfer guard (hpcpar.guard)


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
    """Turn "auto" into ``HPCPAR_DEVICE`` when set, else "cuda" when a GPU is usable, else "cpu";
    validate the name."""
    if device == "auto":
        device = os.environ.get("HPCPAR_DEVICE") or "auto"
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
    return {"cuda": _cupy, "guard": guard.xp}.get(device, np)


def get_array_module(*arrays):
    """``cupy`` if any argument is a CuPy array, else ``numpy`` (works without CuPy)."""
    if any(isinstance(a, guard.ndarray) for a in arrays):
        return guard.xp
    if _cupy is not None:
        for a in arrays:
            if isinstance(a, _cupy.ndarray):
                return _cupy
    return np


def is_gpu_array(a) -> bool:
    return isinstance(a, guard.ndarray) or (_cupy is not None and isinstance(a, _cupy.ndarray))


def to_host(a) -> np.ndarray:
    """A NumPy copy (or the array itself when it already lives on the host)."""
    if isinstance(a, guard.ndarray):
        return guard.asnumpy(a)
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
    if isinstance(a, guard.ndarray):
        guard.get_current_stream().synchronize()
    if _cupy is not None and (a is None or is_gpu_array(a)):
        if gpu_count() > 0:
            _cupy.cuda.get_current_stream().synchronize()


def scatter_add(a, indices, values) -> None:
    """``a[indices] += values`` in place with repeated indices summed: ``np.add.at`` on NumPy,
    ``cupyx.scatter_add`` on CuPy (CuPy's ufuncs have no portable ``add.at``)."""
    xp = get_array_module(a)
    if xp is np:
        np.add.at(a, indices, values)
    elif xp is guard.xp:
        guard.xp.scatter_add(a, indices, values)
    else:
        import cupyx

        cupyx.scatter_add(a, indices, values)


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
