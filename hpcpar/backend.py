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

_cupy_error: str | None = None  # why an installed CuPy failed to import (a broken install)
try:  # CuPy is optional; a broken CUDA install must not break CPU users either.
    import cupy as _cupy
except ModuleNotFoundError as _error:  # not installed: CPUs, nothing to report
    _cupy = None
    if _error.name != "cupy":  # CuPy is there but a module it needs is not
        _cupy_error = f"{type(_error).__name__}: {_error}"
except Exception as _error:  # noqa: BLE001 - an installed CuPy that fails: a driver, a CUDA library, ...
    _cupy = None
    _cupy_error = f"{type(_error).__name__}: {str(_error).splitlines()[0] if str(_error) else ''}"

DEVICES = ("auto", "cpu", "cuda", "guard")  # guard: the CuPy path on CPUs under the transfer guard (hpcpar.guard)
CUPY_FIX = "pip install 'hpcpar[gpu]' (the cupy-cuda12x or cupy-cuda13x wheel matching your CUDA driver)"


class DeviceError(RuntimeError):
    """The device (or a dtype on it) cannot be used; the message is one line naming the fix."""


def cupy_module():
    """The ``cupy`` module, or None without a working CuPy."""
    return _cupy


def cupy_broken() -> str | None:
    """Why an installed CuPy failed to import (None: it imported, or it is not installed)."""
    return _cupy_error


def gpu_count() -> int:
    """Number of CUDA devices CuPy can see (0 without CuPy or without a driver)."""
    if _cupy is None:
        return 0
    try:
        return int(_cupy.cuda.runtime.getDeviceCount())
    except Exception:  # noqa: BLE001 - no driver, no device
        return 0


def no_device_reason() -> str:
    """Why CuPy sees no device: "CuPy sees no CUDA device", with the driver's error when there was one."""
    try:
        _cupy.cuda.runtime.getDeviceCount()
        return "CuPy sees no CUDA device"
    except Exception as error:  # noqa: BLE001 - the driver's error is the reason
        return f"CuPy sees no CUDA device ({type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''})"


def resolve_device(device: str = "auto") -> str:
    """Turn "auto" into ``HPCPAR_DEVICE`` when set, else "cuda" when a GPU is usable, else "cpu";
    validate the name.

    Raises DeviceError (one line naming the fix) for "cuda" without CuPy or without a device,
    and for "auto" or "cuda" with a CuPy that is installed but fails to import: "auto" would
    otherwise train on the CPU in silence.
    """
    if device == "auto":
        device = os.environ.get("HPCPAR_DEVICE") or "auto"
    if device not in DEVICES:
        raise ValueError(f"device must be one of {DEVICES}, got {device!r}")
    if device in ("auto", "cuda") and _cupy_error is not None:
        raise DeviceError(f"device={device!r}: CuPy is installed but fails to import ({_cupy_error}); "
                          f"repair it ({CUPY_FIX}) or set the device to 'cpu'")
    if device == "auto":
        return "cuda" if gpu_count() > 0 else "cpu"
    if device == "cuda" and gpu_count() == 0:
        if _cupy is None:
            raise DeviceError(f"device='cuda' was requested but CuPy is not installed: {CUPY_FIX}")
        raise DeviceError(f"device='cuda' was requested but {no_device_reason()}: check nvidia-smi, "
                          "CUDA_VISIBLE_DEVICES and the driver, or set the device to 'cpu'")
    return device


def device_choice(requested: str, resolved: str) -> str:
    """One line saying which device a run uses and why (logged at start)."""
    if requested != "auto":
        return f"device {resolved} (requested)"
    if resolved == "guard":
        return "device guard (auto: HPCPAR_DEVICE=guard, the CuPy path on CPUs under the transfer guard)"
    if resolved == "cuda":
        return f"device cuda (auto: CuPy {_cupy.__version__} sees {gpu_count()} GPU(s))"
    return f"device cpu (auto: {'CuPy is not installed' if _cupy is None else no_device_reason()})"


def check_dtype(device: str, dtype) -> None:
    """Raise DeviceError when arrays of ``dtype`` cannot live on ``device`` (bfloat16 on a CuPy without it)."""
    if device not in ("cuda", "guard") or np.dtype(dtype).name != "bfloat16":
        return
    xp = array_module(device)
    try:
        xp.zeros(1, dtype=dtype)
    except Exception as error:  # noqa: BLE001 - CuPy raises several types for an unknown dtype
        version = f"CuPy {_cupy.__version__}" if device == "cuda" else "the transfer guard (as CuPy)"
        raise DeviceError(f"precision bf16 on the GPU needs bfloat16 arrays, which {version} lacks "
                          f"({type(error).__name__}); use precision fp16 (or fp32), or the CPU") from None


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
    """Wait for all work on the device (every stream); a no-op for NumPy.

    MPI reads device memory directly, outside CuPy's stream order, so every MPI call on a
    CuPy buffer must come after this or it may send stale data. The whole device, not the
    current stream: why, in ``hpcpar.runtime.device_transport._Staged``.
    """
    if isinstance(a, guard.ndarray):
        guard.synchronize_device()
    elif _cupy is not None and (a is None or isinstance(a, _cupy.ndarray)) and gpu_count() > 0:
        _cupy.cuda.Device().synchronize()


def pinned_empty(nbytes: int) -> np.ndarray:
    """``nbytes`` of page-locked host memory as a uint8 NumPy array (``cupyx.empty_pinned``; plain
    memory without a GPU).

    Copies between the device and pinned memory run at full bus speed and without an extra
    copy through a driver buffer; MPI's host staging reuses these (``HostStaging``).
    """
    if _cupy is None or gpu_count() == 0:
        return np.empty(nbytes, dtype=np.uint8)
    import cupyx

    return cupyx.empty_pinned((nbytes,), dtype=np.uint8)


def copy_to_host(a, out: np.ndarray) -> np.ndarray:
    """Copy the device array ``a`` into the host array ``out`` (same shape and dtype); returns ``out``."""
    if is_gpu_array(a):
        get_array_module(a).asnumpy(a, out=out)  # into the reused (pinned) buffer: no allocation
    else:
        out[...] = a
    return out


def copy_to_device(host: np.ndarray, a) -> None:
    """Copy the host array ``host`` into the device array ``a`` (same shape and dtype)."""
    if is_gpu_array(a):
        a.set(host)
    else:
        a[...] = host


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
    info = {"numpy": np.__version__, "cupy": None, "gpus": 0, "cupy_error": _cupy_error}
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
