"""Process-wide settings of the host: the CPUs a rank may use, BLAS threads, glibc's allocator.

Nothing here runs on import. ``hpcpar.init()`` applies the settings (``apply``) and keeps
what it did for ``hpcpar info``; a library that changed malloc or thread pools merely by
being imported would change them for every other library in the process.

- **CPUs**: what the scheduler lets this process run on: its affinity mask
  (``os.sched_getaffinity``, set by ``taskset``, SLURM's ``--cpus-per-task``, mpiexec's
  binding) capped by the cgroup's CPU quota (cgroup v2 ``cpu.max``, v1
  ``cpu.cfs_quota_us`` / ``cpu.cfs_period_us``; a container limited to 2 CPUs on a 64-core
  host sees 64 in ``os.cpu_count()``).
- **BLAS threads** (``share_cores``): each rank's share of those CPUs.
- **Allocator** (``tune_glibc_allocator``): large NumPy buffers kept in glibc's heap.
"""
from __future__ import annotations

import math
import os
from pathlib import Path

BLAS_THREAD_VARIABLES = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")
ALLOCATOR_VARIABLE = "HPCPAR_MALLOC_TUNING"  # 0: init() leaves glibc's allocator alone

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters (malloc.h)
_ALLOCATOR_THRESHOLD = 1 << 30  # 1 GiB; mallopt takes a C int, so at most 2**31 - 1


# ----------------------------------------------------------------------------------------
# CPUs
# ----------------------------------------------------------------------------------------
def affinity() -> set[int]:
    """The CPUs this process may run on (all of them where the OS has no affinity call)."""
    if hasattr(os, "sched_getaffinity"):
        return set(os.sched_getaffinity(0))
    return set(range(os.cpu_count() or 1))


def cgroup_cpu_limit(proc_self: str | Path = "/proc/self", cgroup_root: str | Path = "/sys/fs/cgroup") -> float | None:
    """CPUs' worth of time the cgroup quota allows (e.g. 1.5), or None when unlimited or unknown.

    The quota of this process's cgroup and of every cgroup above it counts (the tightest
    wins): cgroup v2's ``cpu.max`` (``max 100000`` or ``150000 100000``), or v1's
    ``cpu.cfs_quota_us`` (-1: none) over ``cpu.cfs_period_us`` in the cpu controller's
    hierarchy. The roots are parameters so tests can lay out a fake tree.
    """
    try:
        lines = Path(proc_self, "cgroup").read_text().splitlines()
    except OSError:
        return None
    limits = []
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # cgroup v2: "0::/path"
            limits += _quotas(Path(cgroup_root), path, _v2_quota)
        elif "cpu" in controllers.split(","):  # cgroup v1: "4:cpu,cpuacct:/path"
            for mount in (Path(cgroup_root, controllers), Path(cgroup_root, "cpu"), Path(cgroup_root, "cpu,cpuacct")):
                if mount.is_dir():
                    limits += _quotas(mount, path, _v1_quota)
                    break
    return min(limits) if limits else None


def _quotas(mount: Path, path: str, read) -> list[float]:
    """The quotas of ``path`` and of each cgroup above it, under ``mount``.

    Inside a container the path may be the host's while the mount shows only the
    container's own subtree: then the mount's root stands for this process's cgroup.
    """
    folder = mount / path.lstrip("/")
    if not folder.is_dir():
        folder = mount
    found = []
    while True:
        quota = read(folder)
        if quota is not None:
            found.append(quota)
        if folder == mount or mount not in folder.parents:
            return found
        folder = folder.parent


def _v2_quota(folder: Path) -> float | None:
    try:
        quota, period = Path(folder, "cpu.max").read_text().split()[:2]
    except (OSError, ValueError):
        return None
    return None if quota == "max" else int(quota) / int(period)


def _v1_quota(folder: Path) -> float | None:
    try:
        quota = int(Path(folder, "cpu.cfs_quota_us").read_text())
        period = int(Path(folder, "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    return None if quota <= 0 or period <= 0 else quota / period


def usable_cpus(cpus: set[int] | None = None, limit: float | None = None) -> int:
    """How many CPUs can run at once for these processes: the affinity mask (``cpus``,
    default this process's) capped by the cgroup quota (``limit``, default read), at least 1."""
    count = len(cpus if cpus is not None else affinity())
    limit = cgroup_cpu_limit() if limit is None else limit
    if limit is not None:
        count = min(count, math.ceil(limit))
    return max(1, count)


# ----------------------------------------------------------------------------------------
# BLAS threads
# ----------------------------------------------------------------------------------------
def share_cores(ranks_on_node: int) -> int | None:
    """Give this rank's BLAS its share of the node's cores, unless the user chose (the variables above).

    Left alone, each of R ranks on a node starts a BLAS pool of one thread per core, R x cores
    threads fighting over the cores: ``hpcpar bench dp`` at 2 ranks on 2 cores took 3 s a step
    instead of 0.07 s. A rank the launcher pinned to some CPUs (SLURM's --cpus-per-task) gets
    those; otherwise the usable CPUs // ranks, at least 1 (torchrun sets OMP_NUM_THREADS=1 for
    the same reason). Returns the thread count set, or None when left alone.
    """
    if any(os.environ.get(name) for name in BLAS_THREAD_VARIABLES):
        return None
    cores = os.cpu_count() or 1
    mine = affinity()
    usable = usable_cpus(mine)
    threads = usable if len(mine) < cores else max(1, usable // ranks_on_node)
    if threads == cores:
        return None  # the libraries' own default
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:
        return None
    threadpool_limits(limits=threads, user_api="blas")
    return threads


def blas_thread_count() -> int:
    """Threads of the loaded BLAS pool (the largest, if several), 1 when none is loaded or known."""
    try:
        from threadpoolctl import threadpool_info
    except ImportError:
        return int(os.environ.get("OPENBLAS_NUM_THREADS") or os.environ.get("OMP_NUM_THREADS") or 1)
    return max([pool["num_threads"] for pool in threadpool_info() if pool["user_api"] == "blas"] or [1])


def blas_threads() -> str:
    """The thread counts of the loaded BLAS libraries, e.g. ``openblas 1``."""
    try:
        from threadpoolctl import threadpool_info
    except ImportError:
        return os.environ.get("OPENBLAS_NUM_THREADS") or os.environ.get("OMP_NUM_THREADS") or "default"
    pools = [f"{pool['internal_api']} {pool['num_threads']}" for pool in threadpool_info() if pool["user_api"] == "blas"]
    return ", ".join(pools) or "no BLAS loaded"


def blas_kernel() -> str:
    """The loaded BLAS libraries' kernels as threadpoolctl names them, e.g. ``openblas Haswell``
    (what a benchmark states: ``OPENBLAS_CORETYPE`` may force one)."""
    try:
        from threadpoolctl import threadpool_info
    except ImportError:
        return "BLAS kernel unknown (no threadpoolctl)"
    pools = [f"{pool['internal_api']} {pool.get('architecture') or '?'}" for pool in threadpool_info()
             if pool["user_api"] == "blas"]
    return ", ".join(pools) or "no BLAS loaded"


# ----------------------------------------------------------------------------------------
# glibc's allocator
# ----------------------------------------------------------------------------------------
def tune_glibc_allocator() -> str:
    """Keep large NumPy buffers in glibc's heap instead of fresh mmaps; returns what was done.

    By default glibc serves each allocation above ~128 KiB-32 MiB with its own mmap and unmaps
    it on free, so every activation, gradient and temporary of a training step costs page
    faults to create and an munmap to drop: measured here, freeing the gradients of the
    benchmark GPT took 4 ms of a 5 ms data-parallel sync, 0.2 ms with the heap reused, and
    MPICH's own 64 MiB all-reduce at 2 ranks fell from 37 to 21.5 ms (its temporary buffers
    stop being mapped per call). The price is that the process keeps its peak memory (as
    caching allocators do). Process-wide, so only ``hpcpar.init()`` calls it.
    """
    try:
        import ctypes

        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):
        return "left alone (not glibc)"
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]  # int mallopt(int param, int value)
    mallopt.restype = ctypes.c_int
    if mallopt(_M_MMAP_THRESHOLD, _ALLOCATOR_THRESHOLD) != 1 or mallopt(_M_TRIM_THRESHOLD, _ALLOCATOR_THRESHOLD) != 1:
        return "left alone (glibc refused the thresholds)"
    return "tuned: mmap and trim thresholds 1 GiB (glibc mallopt)"


def apply(ranks_on_node: int, tune_allocator: bool, set_blas_threads: bool) -> dict:
    """What ``hpcpar.init()`` changes in the process; returns the facts for ``hpcpar info``.

    The allocator is tuned unless ``tune_allocator`` is False or HPCPAR_MALLOC_TUNING=0.
    """
    if not tune_allocator:
        allocator = "left alone (init(tune_allocator=False))"
    elif os.environ.get(ALLOCATOR_VARIABLE, "1") == "0":
        allocator = f"left alone ({ALLOCATOR_VARIABLE}=0)"
    else:
        allocator = tune_glibc_allocator()
    threads = share_cores(ranks_on_node) if set_blas_threads else None
    chosen = next((f"{name}={os.environ[name]}" for name in BLAS_THREAD_VARIABLES if os.environ.get(name)), None)
    blas = (f"{threads} per rank (set by hpcpar.init)" if threads is not None
            else f"left alone ({chosen})" if chosen else "left alone (the library's default)")
    return {"allocator": allocator, "blas": blas}
