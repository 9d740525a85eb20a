"""Gradient compression for data parallelism, as pluggable bucket hooks.

A compressor's ``start(comm, bucket)`` begins averaging ``bucket.flat`` over ``comm`` and returns
something whose ``wait()`` gives the averaged flat buffer. It counts ``bytes_sent`` (what this rank
put on the wire) next to ``bytes_uncompressed`` (a plain all-reduce's), to report the saving.

- ``NoCompression``: the exact mean, non-blocking, overlapped with backward.
- ``FP16Compression``: cast to float16 for the wire (half the bytes), non-blocking.
- ``TopKCompression``: each rank sends its k largest entries (values + indices) by
  all-gather; with error feedback the rest is remembered and added to the next step.
- ``PowerSGDCompression``: rank-r factors P, Q of each matrix gradient (Vogels et al. 2019)
  with error feedback; vectors and small matrices go uncompressed.
Top-k and PowerSGD communicate when the bucket is launched (still during backward) but
with blocking calls: their second round depends on the first.
"""
from __future__ import annotations

from abc import ABC, abstractmethod

import numpy as np

from ..backend import get_array_module, scatter_add


class _Done:
    """An already completed result."""

    def __init__(self, result):
        self.result = result

    def test(self) -> bool:
        return True

    def wait(self):
        return self.result


class _Finish:
    """Wait for a handle, then run ``finish`` on its result."""

    def __init__(self, handle, finish):
        self.handle, self.finish = handle, finish

    def test(self) -> bool:
        return self.handle.test()

    def wait(self):
        return self.finish(self.handle.wait())


class Compressor(ABC):
    name = "none"
    # True (a linear compressor): bucket.flat holds gradient / ranks, and start() sums it. Data
    # parallelism copies each gradient into the bucket already divided by the number of ranks (one
    # pass it makes anyway), so the compressor only has to sum: no extra pass to divide. Compressors
    # with error feedback see raw gradients.
    sums_prescaled = False
    carries_state = False  # True: what a step leaves behind changes the next (state_arrays)
    # True: what it sends of an entry depends on the bucket's other entries (top-k ranks them all).
    # Then ranks holding the same parameters (tensor-parallel replicas) must bucket them alike.
    whole_bucket = False

    def __init__(self):
        self.bytes_sent = 0
        self.bytes_uncompressed = 0

    @abstractmethod
    def start(self, comm, bucket):
        """Begin averaging ``bucket.flat`` over ``comm``; return something whose ``wait()`` gives it."""

    @property
    def ratio(self) -> float:
        """Bytes sent over bytes a plain all-reduce would send (1.0 = no saving)."""
        return self.bytes_sent / self.bytes_uncompressed if self.bytes_uncompressed else 1.0

    def _count(self, sent: int, flat) -> None:
        self.bytes_sent += int(sent)
        self.bytes_uncompressed += flat.nbytes

    def state_arrays(self) -> dict:
        """{name: array} of what this rank carries from step to step (error feedback), which an
        exact resume needs; names are dot-separated integers after a word. None by default."""
        return {}

    def state_shapes(self, buckets) -> dict:
        """{name: shape} of the ``state_arrays`` this compressor carries once it has reduced
        ``buckets`` (a DDP's): a checkpoint's state is taken back only when it has exactly these."""
        return {}

    def load_state_arrays(self, arrays: dict) -> None:
        """Carry on from ``state_arrays``'s output of another run (the same names and shapes)."""


class NoCompression(Compressor):
    sums_prescaled = True

    def start(self, comm, bucket):
        self._count(bucket.flat.nbytes, bucket.flat)
        return comm.iallreduce(bucket.flat, "sum", out=bucket.flat)


class FP16Compression(Compressor):
    name = "fp16"
    sums_prescaled = True  # dividing before the cast also keeps the float16 sum from overflowing

    def start(self, comm, bucket):
        flat = bucket.flat
        half = flat.astype(np.float16)
        self._count(half.nbytes, flat)

        def finish(summed):
            flat[...] = summed
            return flat

        return _Finish(comm.iallreduce(half, "sum", out=half), finish)


class TopKCompression(Compressor):
    """Send the ``ratio`` fraction of largest-magnitude entries; remember the rest if ``error_feedback``."""

    name = "topk"
    whole_bucket = True

    def __init__(self, ratio: float = 0.01, error_feedback: bool = True):
        super().__init__()
        if not 0 < ratio <= 1:
            raise ValueError(f"top-k ratio must be in (0, 1], got {ratio}")
        self.topk_ratio = ratio
        self.error_feedback = self.carries_state = error_feedback
        self.residuals: dict[int, object] = {}

    def start(self, comm, bucket):
        flat = bucket.flat
        xp = get_array_module(flat)
        corrected = flat + self.residuals[bucket.index] if bucket.index in self.residuals else flat.copy()
        k = max(1, int(self.topk_ratio * flat.size))
        chosen = xp.argpartition(xp.abs(corrected), flat.size - k)[flat.size - k:].astype(np.int32)
        values = corrected[chosen]
        if self.error_feedback:
            corrected[chosen] = 0
            self.residuals[bucket.index] = corrected
        all_indices = comm.allgather(chosen).reshape(-1)
        all_values = comm.allgather(values).reshape(-1)
        self._count(chosen.nbytes + values.nbytes, flat)
        flat[...] = 0
        scatter_add(flat, all_indices, all_values)  # CuPy has no portable add.at
        flat /= comm.size
        return _Done(flat)

    def state_arrays(self) -> dict:
        return {f"residual.{bucket}": values for bucket, values in self.residuals.items()}

    def state_shapes(self, buckets) -> dict:
        return {f"residual.{b.index}": tuple(b.flat.shape) for b in buckets} if self.error_feedback else {}

    def load_state_arrays(self, arrays: dict) -> None:
        self.residuals = {int(name.split(".")[1]): values for name, values in arrays.items()}


class PowerSGDCompression(Compressor):
    """Rank-``rank`` PowerSGD with error feedback; Q starts from the same seed on every rank."""

    name = "powersgd"
    carries_state = True

    def __init__(self, rank: int = 4, seed: int = 0):
        super().__init__()
        if rank < 1:
            raise ValueError(f"PowerSGD rank must be >= 1, got {rank}")
        self.rank = rank
        self.seed = seed
        self.errors: dict[tuple, object] = {}
        self.qs: dict[tuple, object] = {}

    def _compressible(self, shape) -> bool:
        if len(shape) < 2:
            return False
        n, m = matrix_shape(shape)
        return (n + m) * self.rank < n * m

    def start(self, comm, bucket):
        flat = bucket.flat
        xp = get_array_module(flat)
        matrices, rest = [], []
        for slot, p in enumerate(bucket.params):
            (matrices if self._compressible(p.shape) else rest).append(slot)
        sent = 0
        if rest:  # vectors and small matrices: one plain all-reduce of their concatenation
            packed = xp.concatenate([bucket.view(s).reshape(-1) for s in rest])
            comm.allreduce(packed, "mean", out=packed)
            sent += packed.nbytes
            start = 0
            for s in rest:
                view = bucket.view(s)
                view[...] = packed[start: start + view.size].reshape(view.shape)
                start += view.size
        for s in matrices:
            sent += self._compress_matrix(comm, bucket, s, xp)
        self._count(sent, flat)
        return _Done(flat)

    def _compress_matrix(self, comm, bucket, slot, xp) -> int:
        view = bucket.view(slot)
        key = (bucket.index, slot)
        m = view.reshape(view.shape[0], -1)
        if key in self.errors:
            m = m + self.errors[key]
        if key not in self.qs:  # seeded by the shape: every rank holding this matrix (a tied weight) starts alike
            rng = np.random.default_rng([self.seed, *m.shape])
            self.qs[key] = xp.asarray(rng.standard_normal((m.shape[1], self.rank)).astype(m.dtype))
        p = m @ self.qs[key]
        comm.allreduce(p, "sum", out=p)
        # orthonormal columns, a well-conditioned basis; in float32 at least (LAPACK has no 16-bit QR:
        # float16 fails in it; bfloat16's products come out in float32 already)
        p, _ = xp.linalg.qr(p if p.dtype.itemsize >= 4 else p.astype(np.float32))
        q = m.T @ p
        comm.allreduce(q, "sum", out=q)
        self.qs[key] = q  # warm start for the next step
        approx = (p @ q.T) / comm.size
        self.errors[key] = m - approx
        view[...] = approx.reshape(view.shape)
        return p.nbytes + q.nbytes

    def state_shapes(self, buckets) -> dict:
        shapes = {}
        for b in buckets:
            for s, p in enumerate(b.params):
                if self._compressible(p.shape):
                    n, m = matrix_shape(p.shape)
                    shapes |= {f"error.{b.index}.{s}": (n, m), f"q.{b.index}.{s}": (m, self.rank)}
        return shapes

    def state_arrays(self) -> dict:
        arrays = {f"error.{b}.{s}": values for (b, s), values in self.errors.items()}
        return arrays | {f"q.{b}.{s}": values for (b, s), values in self.qs.items()}

    def load_state_arrays(self, arrays: dict) -> None:
        self.errors, self.qs = {}, {}
        for name, values in arrays.items():
            kind, bucket, slot = name.split(".")
            (self.errors if kind == "error" else self.qs)[(int(bucket), int(slot))] = values


def matrix_shape(shape) -> tuple[int, int]:
    """The (rows, columns) PowerSGD factors a parameter of ``shape`` as: its first axis by the rest."""
    return shape[0], int(np.prod(shape[1:]))


COMPRESSORS = {"none": NoCompression, "fp16": FP16Compression, "topk": TopKCompression,
               "powersgd": PowerSGDCompression}


def make_compressor(name: str | None, **options) -> Compressor:
    key = name or "none"
    if key not in COMPRESSORS:
        raise ValueError(f"compression must be one of {sorted(COMPRESSORS)}, got {name!r}")
    return COMPRESSORS[key](**options)
