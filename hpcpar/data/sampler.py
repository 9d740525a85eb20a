"""Which samples each data-parallel rank sees.

Policy for ranks that run out of data first, so that none waits forever:

- **Training** never lets that happen: every rank gets exactly the same number of samples
  per epoch, either by dropping the last ``n % replicas`` samples (``drop_last=True``) or by
  padding with samples from the start of the shuffled order (the default, as PyTorch does).
  Since every rank takes the same number of steps, every collective has all its ranks.
- **Evaluation** must count each sample exactly once, so shards are uneven (at most one
  apart) and nothing is padded: ``eval_indices()``. Each rank sums its loss and counts its
  samples locally and the sums are all-reduced *once* at the end (``reduce_metric``); where
  a forward itself communicates (tensor or pipeline parallel), ranks run ``eval_batches()``
  batches — the same count everywhere — and a rank past its data runs a padded batch whose
  weight is zero.
"""
from __future__ import annotations

import math

import numpy as np


class DistributedSampler:
    def __init__(self, num_samples: int, num_replicas: int, rank: int, shuffle: bool = True,
                 seed: int = 0, drop_last: bool = False):
        if num_samples < 1:
            raise ValueError(f"DistributedSampler needs at least one sample, got {num_samples}")
        if not 0 <= rank < num_replicas:
            raise ValueError(f"rank {rank} is outside 0..{num_replicas - 1}")
        if drop_last and num_samples < num_replicas:
            raise ValueError(f"drop_last with {num_samples} samples and {num_replicas} replicas leaves nothing")
        self.num_samples = num_samples
        self.num_replicas = num_replicas
        self.rank = rank
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        self.epoch = 0
        self.position = 0  # samples of this epoch already handed out (for exact resume)

    @property
    def per_rank(self) -> int:
        if self.drop_last:
            return self.num_samples // self.num_replicas
        return math.ceil(self.num_samples / self.num_replicas)

    def set_epoch(self, epoch: int) -> None:
        """A new epoch: a new shuffle (the same on every rank, from seed and epoch)."""
        self.epoch = epoch
        self.position = 0

    def _order(self) -> np.ndarray:
        if self.shuffle:
            return np.random.default_rng([self.seed, self.epoch]).permutation(self.num_samples)
        return np.arange(self.num_samples)

    def indices(self) -> np.ndarray:
        """This rank's samples of the current epoch, in order."""
        order = self._order()
        total = self.per_rank * self.num_replicas
        if total > len(order):  # pad with the start of the order (wrapping if needed)
            order = np.concatenate([order, np.resize(order, total - len(order))])
        return order[:total][self.rank::self.num_replicas]

    def next_batch(self, batch_size: int) -> np.ndarray:
        """The next ``batch_size`` indices, moving to the next epoch when this one is spent."""
        if batch_size > self.per_rank:
            raise ValueError(f"batch size {batch_size} per rank exceeds the {self.per_rank} samples per rank")
        if self.position + batch_size > self.per_rank:
            self.set_epoch(self.epoch + 1)
        batch = self.indices()[self.position: self.position + batch_size]
        self.position += batch_size
        return batch

    def eval_indices(self) -> np.ndarray:
        """Every sample exactly once across ranks, unshuffled and unpadded (shards differ by at most one)."""
        return np.arange(self.num_samples)[self.rank::self.num_replicas]

    def eval_batches(self, batch_size: int) -> int:
        """How many evaluation batches every rank must run when forwards communicate."""
        largest = math.ceil(self.num_samples / self.num_replicas)
        return math.ceil(largest / batch_size)

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed}

    def load_state_dict(self, state: dict) -> None:
        self.seed = int(state["seed"])
        self.epoch = int(state["epoch"])
        self.position = int(state["position"])


def reduce_metric(comm, total: float, count: int) -> float:
    """The global mean of a metric whose per-rank sum and sample count are given."""
    summed = comm.allreduce(np.array([total, count], dtype=np.float64), "sum")
    return float(summed[0] / summed[1])
