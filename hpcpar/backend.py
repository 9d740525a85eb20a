"""Array backend: NumPy on CPUs, CuPy on GPUs, chosen once per process.

Everything in hpcpar reaches the array library through ``xp = get_array_module(x)``
(docs/architecture.md), so one code path serves both. ``import cupy`` is guarded:
on a machine without CuPy (or without a working CUDA driver) everything still imports
and runs on NumPy.
"""
from __future__ import annotations

import os

import numpy as np

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


_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc mallopt parameters


def tune_host_allocator() -> bool:
    """Keep large NumPy buffers in glibc's heap instead of fresh mmaps (opt out: HPCPAR_MALLOC_TUNING=0).

    By default glibc serves each allocation above ~128 KiB-32 MiB with its own mmap and unmaps
    it on free, so every activation, gradient and temporary of a training step costs page
    faults to create and an munmap to drop: measured here, freeing the gradients of the
    benchmark GPT took 4 ms of a 5 ms data-parallel sync, 0.2 ms with the heap reused. The
    price is that the process keeps its peak memory (as caching allocators do). Returns
    whether the setting was applied (False off glibc).
    """
    if os.environ.get("HPCPAR_MALLOC_TUNING", "1") == "0":
        return False
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6")
        return bool(libc.mallopt(_M_MMAP_THRESHOLD, 1 << 30) and libc.mallopt(_M_TRIM_THRESHOLD, 1 << 31))
    except (OSError, AttributeError):
        return False


BLAS_THREAD_VARIABLES = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")


def share_cores(ranks_on_node: int) -> int | None:
    """Give this rank's BLAS its share of the node's cores, unless the user chose (the variables above).

    Left alone, each of R ranks on a node starts a BLAS pool of one thread per core, R x cores
    threads fighting over the cores: ``hpcpar bench dp`` at 2 ranks on 2 cores took 3 s a step
    instead of 0.07 s. A rank the launcher pinned to some CPUs (SLURM's --cpus-per-task) gets
    those; otherwise cores // ranks, at least 1 (torchrun sets OMP_NUM_THREADS=1 for the same
    reason). Returns the thread count set, or None when left alone.
    """
    if any(os.environ.get(name) for name in BLAS_THREAD_VARIABLES):
        return None
    cores = os.cpu_count() or 1
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else cores
    threads = usable if usable < cores else max(1, usable // ranks_on_node)
    if threads == cores:
        return None  # the libraries' own default
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:
        return None
    threadpool_limits(limits=threads, user_api="blas")
    return threads


def blas_threads() -> str:
    """The thread counts of the loaded BLAS libraries, e.g. ``openblas 1``."""
    try:
        from threadpoolctl import threadpool_info
    except ImportError:
        return os.environ.get("OPENBLAS_NUM_THREADS") or os.environ.get("OMP_NUM_THREADS") or "default"
    pools = [f"{pool['internal_api']} {pool['num_threads']}" for pool in threadpool_info() if pool["user_api"] == "blas"]
    return ", ".join(pools) or "no BLAS loaded"


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
    info["blas_threads"] = blas_threads()
    return info
