"""Batches from an HDF5 token file, the same global batch at every step whatever dp is.

    train = TokenDataset("data/stdlib.h5", "train")
    batches = TextBatches(train, block_size=128, global_batch=32, dp_rank=ctx.dp_rank, dp_size=ctx.dp_size, seed=0)
    for step in range(steps):
        ids, targets = next(batches)            # (32 / dp, 128) each: this replica's rows only

Step k's global batch is a pure function of (seed, k): ``global_batch`` window starts drawn
from ``np.random.default_rng([seed, k])``. Replica r takes rows ``r * b : (r + 1) * b``
(b = global_batch / dp), so the replicas' batches stacked in rank order are the global batch — a
run at dp=1 and one at dp=4 see the same data at every step, which is what lets equivalence tests
compare layouts, and a checkpoint resumes at another dp with the same data stream. The position
is the step count: ``state_dict()`` / ``load_state_dict()`` resume exactly. Each replica reads
only its own windows from the file (``TokenDataset.batch``).
"""
from __future__ import annotations

import functools
import os
from abc import ABC, abstractmethod

import h5py
import numpy as np

from .corpus import batch_windows


SPLITS = ("train", "val")
ID_SCAN_TOKENS = 1 << 24  # ``id_range`` reads a split in blocks of this many tokens


def _version(path: str) -> tuple[str, int, int]:
    """A file's identity for the caches below: validation runs once per candidate layout in
    ``hpcpar plan`` and ``compare`` (thousands at large worlds), and a rewritten file is read again."""
    facts = os.stat(path)
    return os.path.realpath(path), facts.st_size, facts.st_mtime_ns


def dataset_info(path: str) -> dict:
    """vocab_size, the token counts of the ``train`` and ``val`` splits and their dtypes (``dtypes``);
    ValueError if not a token file (a split missing, or not 1-D integer token ids). Read once per
    version of the file."""
    info = _dataset_info(*_version(path))
    return {**info, "dtypes": dict(info["dtypes"])}  # the caller's own copy


@functools.lru_cache(maxsize=8)
def _dataset_info(path: str, size: int, mtime_ns: int) -> dict:  # size, time: the cache key
    with h5py.File(path, "r") as f:
        missing = [name for name in SPLITS if name not in f] + \
                  (["attribute vocab_size"] if "vocab_size" not in f.attrs else [])
        if missing:
            raise ValueError(f"it lacks {', '.join(missing)} (has {', '.join(f) or 'nothing'})")
        for name in SPLITS:
            split = f[name]
            if not isinstance(split, h5py.Dataset) or split.ndim != 1 or split.dtype.kind not in "iu":
                held = (f"{split.dtype} of shape {split.shape}" if isinstance(split, h5py.Dataset) else "a group")
                raise ValueError(f"its {name} split holds {held}, not 1-D integer token ids")
        return {"vocab_size": int(f.attrs["vocab_size"]), "train": f["train"].shape[0], "val": f["val"].shape[0],
                "dtypes": {name: f[name].dtype for name in SPLITS},
                "source": str(f.attrs.get("source", "")), "sha256": str(f.attrs.get("sha256", ""))}


def id_range(path: str, split: str) -> tuple[int, int]:
    """The smallest and largest token id of a split (0, 0 when empty), read in blocks once per version of
    the file."""
    real, size, mtime_ns = _version(path)
    return _id_range(real, split, size, mtime_ns)


@functools.lru_cache(maxsize=8)
def _id_range(path: str, split: str, size: int, mtime_ns: int) -> tuple[int, int]:  # size, time: the cache key
    low, high = 0, 0
    with h5py.File(path, "r") as f:
        tokens = f[split]
        for start in range(0, tokens.shape[0], ID_SCAN_TOKENS):
            block = tokens[start: start + ID_SCAN_TOKENS]
            low = int(block.min()) if start == 0 else min(low, int(block.min()))
            high = int(block.max()) if start == 0 else max(high, int(block.max()))
    return low, high


class TokenDataset:
    """One split of a token file, opened on first use; ``bytes_read`` and ``reads`` count file access."""

    def __init__(self, path: str, split: str = "train"):
        self.path, self.split = path, split
        self._file = None
        self._tokens = None
        self.bytes_read = 0
        self.reads = 0

    @property
    def tokens(self) -> h5py.Dataset:
        if self._tokens is None:
            self._file = h5py.File(self.path, "r")
            if self.split not in self._file:
                names = ", ".join(self._file)
                self.close()
                raise KeyError(f"{self.path} has no split {self.split!r}; it has {names}")
            self._tokens = self._file[self.split]
        return self._tokens

    @property
    def vocab_size(self) -> int:
        self.tokens  # noqa: B018 - opens the file
        return int(self._file.attrs["vocab_size"])

    def __len__(self) -> int:
        return self.tokens.shape[0]

    def num_windows(self, block_size: int) -> int:
        """How many windows of block_size inputs (+1 target) fit: valid starts are 0..num_windows-1."""
        return max(0, len(self) - block_size)

    def batch(self, starts, block_size: int) -> tuple[np.ndarray, np.ndarray]:
        """Inputs (B, T) and next-token targets (B, T), int64, of the windows at ``starts``.

        Overlapping or nearby windows are merged into one contiguous read, distant ones are read
        separately."""
        starts = np.asarray(starts, dtype=np.int64).reshape(-1)
        limit = self.num_windows(block_size)
        if starts.size and (starts.min() < 0 or starts.max() >= limit):
            raise ValueError(f"window starts must be in [0, {limit}) for block_size {block_size} in the "
                             f"{len(self)} tokens of {self.path}:{self.split}; got {starts.min()}..{starts.max()}")
        if starts.size == 0:
            return batch_windows(np.zeros(0, dtype=np.uint8), starts, block_size)
        window = block_size + 1
        order = np.argsort(starts, kind="stable")
        ordered = starts[order]
        # A new read begins where the gap to the previous window exceeds one window: reading a
        # few unneeded bytes is cheaper than another HDF5 call.
        first = np.concatenate([[True], ordered[1:] > ordered[:-1] + 2 * window])
        run = np.cumsum(first) - 1
        lows, highs = ordered[first], ordered[np.r_[np.flatnonzero(first)[1:] - 1, len(ordered) - 1]] + window
        pieces = [self.tokens[lo:hi] for lo, hi in zip(lows.tolist(), highs.tolist())]
        self.bytes_read += int((highs - lows).sum())
        self.reads += len(pieces)
        buffer = np.concatenate(pieces)
        run_offsets = np.concatenate([[0], np.cumsum(highs - lows)[:-1]])
        offsets = np.empty_like(starts)
        offsets[order] = run_offsets[run] + ordered - lows[run]  # each window's place in ``buffer``
        return batch_windows(buffer, offsets, block_size)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
        self._file = self._tokens = None

    def __getstate__(self):  # picklable: the file reopens lazily where it lands
        return {**self.__dict__, "_file": None, "_tokens": None}


class GlobalBatches(ABC):
    """Step k's global batch is ``global_selection(k)``; this dp replica yields its contiguous share of it.

    Contiguous, not strided: ``DistributedSampler`` deals samples out strided, so its per-rank order
    depends on the number of replicas. ``skipped``: global batches passed over so far (a rewind
    after a non-finite step skips the data of the failed steps): step k reads batch k + skipped.
    """

    def __init__(self, global_batch: int, dp_rank: int = 0, dp_size: int = 1, seed: int = 0):
        if global_batch < 1 or dp_size < 1 or global_batch % dp_size:
            raise ValueError(f"the global batch {global_batch} must be a positive multiple of dp = {dp_size}")
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank {dp_rank} is outside 0..{dp_size - 1}")
        self.global_batch, self.dp_rank, self.dp_size, self.seed = global_batch, dp_rank, dp_size, seed
        self.local_batch = global_batch // dp_size
        self.step = 0  # the next step to hand out
        self.skipped = 0  # batches skipped by rewinds (``train.on_nonfinite = "rewind"``)

    @abstractmethod
    def global_selection(self, step: int) -> np.ndarray:
        """The sample rows of step ``step``'s whole global batch (the same on every rank)."""

    @abstractmethod
    def fetch(self, rows: np.ndarray):
        """The data of ``rows``."""

    @property
    def first_sample(self) -> int:
        """The place of this replica's first row in every step's global batch (what keys its dropout masks)."""
        return self.dp_rank * self.local_batch

    def rows(self, step: int) -> np.ndarray:
        """This replica's part of step ``step``'s global selection."""
        return self.global_selection(step + self.skipped)[self.first_sample: self.first_sample + self.local_batch]

    def batch_at(self, step: int):
        return self.fetch(self.rows(step))

    def __iter__(self):
        return self

    def __next__(self):
        batch = self.batch_at(self.step)
        self.step += 1
        return batch

    def state_dict(self) -> dict:
        return {"step": self.step, "seed": self.seed, "global_batch": self.global_batch, "skipped": self.skipped}

    def load_state_dict(self, state: dict) -> None:
        if int(state["global_batch"]) != self.global_batch:
            raise ValueError(f"the saved data position is for a global batch of {state['global_batch']}, "
                             f"this run has {self.global_batch}: the data stream would not continue exactly")
        self.step, self.seed = int(state["step"]), int(state["seed"])
        self.skipped = int(state.get("skipped", 0))  # checkpoints from before rewinds existed: none skipped


class TextBatches(GlobalBatches):
    """(ids, targets) of this replica's windows: random window starts, with replacement, from (seed, step)."""

    def __init__(self, dataset: TokenDataset, block_size: int, global_batch: int, dp_rank: int = 0,
                 dp_size: int = 1, seed: int = 0):
        super().__init__(global_batch, dp_rank, dp_size, seed)
        self.dataset, self.block_size = dataset, block_size
        self.num_windows = dataset.num_windows(block_size)
        if self.num_windows < 1:
            raise ValueError(f"{dataset.path}:{dataset.split} has {len(dataset)} tokens, too few for one window "
                             f"of block_size {block_size} + 1")

    def global_selection(self, step: int) -> np.ndarray:
        return np.random.default_rng([self.seed, step]).integers(0, self.num_windows, self.global_batch)

    def fetch(self, rows: np.ndarray):
        return self.dataset.batch(rows, self.block_size)
