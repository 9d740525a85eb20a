"""Which positions of each sequence a rank's activations hold: context parallelism's chunks, then tp's slices.

With context parallelism over C ranks a sequence of T tokens is cut into 2C chunks of T/2C
and cp rank i holds chunks i and 2C-1-i (``zigzag``): under a causal mask every rank then
has the same attention work (a contiguous split, ``zigzag=False``, gives the last rank the
most). Sequence parallelism then splits a rank's T/C positions over tp, in order. Positions
are given as runs of consecutive global positions (``ranges``), which is what embeddings,
dropout masks (keyed by global position: ``nn.dropout_keys``) and the loss's targets need.
"""
from __future__ import annotations

from dataclasses import dataclass

from ...backend import get_array_module


@dataclass(frozen=True)
class ChunkLayout:
    """The chunks of each sequence that the ``size`` ranks of a cp group hold (``rank``: this one)."""

    rank: int = 0
    size: int = 1
    zigzag: bool = True

    @classmethod
    def of(cls, comm) -> "ChunkLayout":
        """This rank's layout in the cp group ``comm`` (None: the whole sequence, one rank)."""
        return cls() if comm is None else cls(comm.rank, comm.size)

    def chunks(self, rank: int | None = None) -> tuple[int, int]:
        """The two chunk numbers (of 2 x size) that ``rank`` (default: this one) holds, in order."""
        r = self.rank if rank is None else rank
        return (r, 2 * self.size - 1 - r) if self.zigzag else (2 * r, 2 * r + 1)

    def chunk_length(self, total: int) -> int:
        if total % (2 * self.size):
            raise ValueError(f"context parallelism cuts each sequence into 2 x cp = {2 * self.size} chunks: "
                             f"{total} tokens do not divide (use a block_size that is a multiple of {2 * self.size})")
        return total // (2 * self.size)

    def ranges(self, total: int, rank: int | None = None) -> tuple[range, ...]:
        """The global positions ``rank`` holds of a sequence of ``total`` tokens, as runs."""
        if self.size == 1:
            return (range(total),)
        c = self.chunk_length(total)
        return merge_runs(range(a * c, (a + 1) * c) for a in self.chunks(rank))

    def take(self, x):
        """This rank's positions of ``x`` (B, T, ...) along axis 1, as one contiguous array."""
        if self.size == 1:
            return x
        return get_array_module(x).concatenate([x[:, run.start:run.stop] for run in self.ranges(x.shape[1])], axis=1)


@dataclass(frozen=True)
class SequencePlace:
    """Where an activation's axis 1 sits in the sequence: the cp chunks (``chunks``), then, under
    sequence parallelism, the tp slice ``shard`` of ``shards`` of them."""

    chunks: ChunkLayout = ChunkLayout()
    shards: int = 1
    shard: int = 0

    def ranges(self, length: int) -> tuple[range, ...]:
        """The global positions of an activation holding ``length`` of them on this rank."""
        local = length * self.shards
        whole = self.chunks.ranges(local * self.chunks.size)
        return slice_runs(whole, self.shard * length, (self.shard + 1) * length)

    def total(self, length: int) -> int:
        """The whole sequence's length, for an activation holding ``length`` positions here."""
        return length * self.shards * self.chunks.size


def merge_runs(runs) -> tuple[range, ...]:
    """Runs with the adjacent ones joined: (0..3, 4..7) -> (0..7)."""
    merged: list[range] = []
    for run in runs:
        if merged and merged[-1].stop == run.start:
            merged[-1] = range(merged[-1].start, run.stop)
        elif len(run):
            merged.append(run)
    return tuple(merged)


def slice_runs(runs, start: int, stop: int) -> tuple[range, ...]:
    """Items ``start`` to ``stop`` of the concatenation of ``runs``, as runs."""
    out, offset = [], 0
    for run in runs:
        lo, hi = max(start - offset, 0), min(stop - offset, len(run))
        if lo < hi:
            out.append(run[lo:hi])
        offset += len(run)
    return merge_runs(out)

