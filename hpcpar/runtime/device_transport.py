"""How device (CuPy) buffers reach MPI: what the MPI library can take, and host staging.

``query_cuda_aware`` asks the library whether it takes device pointers; ``DEVICE_NONBLOCKING``
says which libraries take them in non-blocking collectives; ``HostStaging`` and ``_Staged`` copy
device buffers through reused host buffers where the library is not CUDA-aware. The
Communicator (``comm.py``) uses these; NumPy buffers pass through untouched.
"""
from __future__ import annotations

import ctypes
import functools
import os
import re

import numpy as np
from mpi4py import MPI

from ..backend import copy_to_device, copy_to_host, is_gpu_array, pinned_empty, synchronize


# ----------------------------------------------------------------------------------------
# Facts about the MPI library
# ----------------------------------------------------------------------------------------
def query_cuda_aware() -> bool:
    """Whether MPI accepts device pointers: ``HPCPAR_CUDA_AWARE=0|1`` or the library's own answer.

    mpi4py does not wrap ``MPIX_Query_cuda_support``, so it is called through ctypes on
    the already loaded libmpi (reached through mpi4py's extension module). Unknown means no:
    staging through host memory is always correct, only slower.
    """
    override = os.environ.get("HPCPAR_CUDA_AWARE")
    if override is not None:
        if override not in ("0", "1"):
            raise ValueError(f"HPCPAR_CUDA_AWARE must be 0 or 1, got {override!r}")
        return override == "1"
    try:
        query = ctypes.CDLL(MPI.__file__).MPIX_Query_cuda_support
    except (OSError, AttributeError):
        return False
    query.restype = ctypes.c_int
    return bool(query())


# Whether a CUDA-aware MPI takes device buffers in NON-BLOCKING collectives, by library and
# version: (library name as MPI_Get_library_version starts, first version, last version or None,
# verdict). What is not listed counts as no: a blocking collective is always correct, a
# non-blocking one on device memory where the library does not support it reads garbage.
DEVICE_NONBLOCKING = (
    # Open MPI's FAQ for v4.x and earlier (open-mpi.org/faq/?category=runcuda): device pointers
    # work in send/receive and blocking collectives, not in non-blocking collectives.
    ("Open MPI", (1, 7), (4, 99), False),
    # Open MPI 5's coll/cuda component stages reductions on GPU buffers for the blocking calls;
    # its documentation promises nothing for the non-blocking ones.
    ("Open MPI", (5, 0), None, False),
    # MPICH 4's GPU support (yaksa) moves and reduces device buffers in every communication
    # call through one datatype engine, non-blocking collectives included.
    ("MPICH", (4, 0), None, True),
)


def library_version(text: str | None = None) -> tuple[str, tuple[int, ...]]:
    """(library, version) from MPI_Get_library_version's ``text``: ("MPICH", (4, 2, 0)), ("Open MPI", (4, 1, 5))."""
    text = MPI.Get_library_version() if text is None else text
    for name in ("Open MPI", "CRAY MPICH", "MVAPICH", "MPICH", "Intel(R) MPI"):  # Cray's MPICH numbers its own versions
        if name in text:
            match = re.search(r"(\d+(?:\.\d+)+)", text[text.index(name):])
            return name, tuple(int(p) for p in match.group(1).split(".")) if match else ()
    return text.split()[0] if text.split() else "unknown", ()


def device_nonblocking_supported(library: str | None = None, version: tuple | None = None) -> bool:
    """Whether non-blocking collectives may take device buffers: ``HPCPAR_DEVICE_NONBLOCKING=0|1``,
    else ``DEVICE_NONBLOCKING`` for this library and version (unknown: no)."""
    override = os.environ.get("HPCPAR_DEVICE_NONBLOCKING")
    if override not in (None, ""):
        if override not in ("0", "1"):
            raise ValueError(f"HPCPAR_DEVICE_NONBLOCKING must be 0 or 1, got {override!r}")
        return override == "1"
    if library is None:
        library, version = library_version()
    for name, first, last, verdict in DEVICE_NONBLOCKING:
        if library == name and tuple(version[:len(first)]) >= first and (last is None or tuple(version[:2]) <= last):
            return verdict
    return False


# ----------------------------------------------------------------------------------------
# Buffers: contiguity and host staging
# ----------------------------------------------------------------------------------------
def _require_contiguous(array, what: str) -> None:
    if not array.flags.c_contiguous:
        raise ValueError(
            f"{what}: the buffer must be C-contiguous (shape {array.shape}, strides {array.strides}); "
            "pass xp.ascontiguousarray(x) and read the result from the returned array")


@functools.lru_cache(maxsize=None)
def _is_bfloat16(dtype) -> bool:
    """bfloat16 (ml_dtypes on CPUs) has no MPI datatype: it moves as 16-bit words, reduces in float32.

    Cached: NumPy computes ``dtype.name`` anew each time, ~3 us, more than a small all-reduce.
    """
    return np.dtype(dtype).name == "bfloat16"


class HostStaging:
    """Host buffers for staging device buffers through an MPI that is not CUDA-aware, reused.

    A call takes a buffer at least as large as it needs from the free ones (the smallest that
    fits) and gives it back when it finishes; only when none fits is one allocated (pinned
    when CuPy is there: ``backend.pinned_empty``), rounded up to a power of two so that
    buckets of about the same size share buffers. Non-blocking calls in flight hold theirs,
    so DDP's overlapping buckets never share one. ``allocations``, ``reuses`` and
    ``bytes_allocated`` count what happened (the tests check that a second step allocates
    nothing).
    """

    def __init__(self):
        self._free: list[np.ndarray] = []
        self.allocations = 0
        self.reuses = 0
        self.bytes_allocated = 0

    def acquire(self, nbytes: int) -> np.ndarray:
        fitting = [i for i, b in enumerate(self._free) if b.nbytes >= nbytes]
        if fitting:
            self.reuses += 1
            return self._free.pop(min(fitting, key=lambda i: self._free[i].nbytes))
        size = 1 << max(12, (max(nbytes, 1) - 1).bit_length())
        self.allocations += 1
        self.bytes_allocated += size
        return pinned_empty(size)

    def release(self, buffer: np.ndarray) -> None:
        self._free.append(buffer)


class _Staged:
    """The buffer MPI actually touches for ``array``: the array itself, or a host copy.

    ``device`` is where results go back to on the GPU when staged; ``buffer`` is what MPI is
    handed (bfloat16 as raw 16-bit words: only data-movement calls see it, reductions of
    bfloat16 go through float32 in the Communicator). A staged buffer comes from the
    communicator's ``HostStaging`` and goes back to it in ``finish``, which every user calls
    once the call is complete (``copy_out=False``: a send buffer, nothing comes back).

    Before MPI or the staging copy reads device memory the whole device is synchronized, not
    only the current stream: CuPy arrays do not remember the stream that wrote them, so an
    event on "the producing stream" could only be recorded on the current one, and buffers
    here are also written on other streams (an NCCL communicator's stream when a pipeline's
    tied-weights or a parameter server's MPI communicator shares a buffer with it, a user's
    ``cupy.cuda.Stream``). hpcpar computes on one stream, so the device sync waits for the
    same work a stream sync would; it only costs more where other streams are busy, and
    those are exactly the cases a stream sync gets wrong.
    """

    def __init__(self, array, comm, copy_in: bool = True, copy_out: bool = True):
        self.device = array if is_gpu_array(array) else None
        self._pool, self._raw, self._copy_out = None, None, copy_out
        if self.device is None:
            self.host = array
            return
        synchronize(array)
        if comm.cuda_aware:
            self.host = array
            return
        self._pool = comm.staging
        self._raw = self._pool.acquire(array.nbytes)
        self.host = self._raw[:array.nbytes].view(array.dtype).reshape(array.shape)
        if copy_in:
            copy_to_host(array, self.host)

    @property
    def staged(self) -> bool:
        return self._raw is not None

    @property
    def buffer(self):
        return self.host.view(np.uint16) if _is_bfloat16(self.host.dtype) else self.host

    def finish(self):
        """Copy a staged result back to the device buffer, free the host buffer; return the user-visible array."""
        if self._raw is not None:
            if self._copy_out:
                copy_to_device(self.host, self.device)
            self._pool.release(self._raw)
            self._raw = None
            self.host = self.device
        return self.host if self.device is None else self.device
