"""scikit-learn's 8x8 digits (1,797 images, shipped with sklearn: no download) for the CNN.

    split = load_digits_split(seed=0)                     # x (N, 1, 8, 8) in [0, 1], y (N,) int64
    batches = DigitsBatches(split.x_train, split.y_train, global_batch=64,
                            dp_rank=ctx.dp_rank, dp_size=ctx.dp_size, seed=0)
    images, labels = next(batches)                        # this replica's 64 / dp rows of step 0

The train/test split is fixed by the seed. Batches follow ``GlobalBatches``: each epoch is
a permutation from (seed, epoch), step k takes the next ``global_batch`` of it (the last
partial batch of an epoch is dropped) and replica r its contiguous share — the same global
batch at every step whatever dp is.
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np

from .loader import GlobalBatches


class DigitsSplit(NamedTuple):
    x_train: np.ndarray  # (N_train, 1, 8, 8)
    y_train: np.ndarray  # (N_train,) int64 in 0..9
    x_test: np.ndarray
    y_test: np.ndarray


def load_digits_split(seed: int = 0, test_fraction: float = 0.2, dtype=np.float32) -> DigitsSplit:
    """Images scaled from 0..16 to [0, 1]; ``round(N * test_fraction)`` of them, chosen by ``seed``, for test."""
    try:
        from sklearn.datasets import load_digits
    except ModuleNotFoundError:  # pragma: no cover - depends on the environment
        raise ModuleNotFoundError("the digits data set comes with scikit-learn: pip install 'hpcpar[digits]'") from None
    if not 0 < test_fraction < 1:
        raise ValueError(f"test_fraction must be in (0, 1), got {test_fraction}")
    digits = load_digits()
    x = (digits.images / 16.0).astype(dtype)[:, None, :, :]  # (N, 8, 8) -> (N, 1, 8, 8)
    y = digits.target.astype(np.int64)
    order = np.random.default_rng(seed).permutation(len(y))
    n_test = int(round(len(y) * test_fraction))
    test, train = np.sort(order[:n_test]), np.sort(order[n_test:])
    return DigitsSplit(x[train], y[train], x[test], y[test])


class DigitsBatches(GlobalBatches):
    """(images, labels) of this replica's rows: epochs of permutations from (seed, epoch)."""

    def __init__(self, images: np.ndarray, labels: np.ndarray, global_batch: int, dp_rank: int = 0,
                 dp_size: int = 1, seed: int = 0):
        super().__init__(global_batch, dp_rank, dp_size, seed)
        if len(images) != len(labels):
            raise ValueError(f"{len(images)} images but {len(labels)} labels")
        if global_batch > len(labels):
            raise ValueError(f"global batch {global_batch} exceeds the {len(labels)} training images")
        self.images, self.labels = images, labels
        self.steps_per_epoch = len(labels) // global_batch

    def global_selection(self, step: int) -> np.ndarray:
        epoch, position = divmod(step, self.steps_per_epoch)
        order = np.random.default_rng([self.seed, epoch]).permutation(len(self.labels))
        return order[position * self.global_batch: (position + 1) * self.global_batch]

    def fetch(self, rows: np.ndarray):
        return self.images[rows], self.labels[rows]
