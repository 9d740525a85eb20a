"""Causal attention over a sequence split across a context-parallel group: ring attention.

Each cp rank holds two chunks of every sequence (``sequence_chunks.ChunkLayout``). Forward
passes each rank's K/V block (one buffer: k and v stacked) around the ring, C - 1 times, with
non-blocking point-to-point: the next block's transfer is in flight while the current one is
computed. A query chunk's partial outputs over the blocks are merged with their log-sum-exp
(online softmax); chunk pairs the causal mask hides entirely are skipped, so with the zigzag
layout every rank computes 2C + 1 of its 4C chunk pairs (two of them causal diagonals).
Backward circulates the K/V blocks once more, recomputes each block's probabilities from the
kept log-sum-exp (nothing of size T x T is kept), and passes each block's dK/dV accumulator
along with it, so after C steps every rank holds its own keys' and values' gradients.
Statistics, accumulators and the travelling dK/dV are float32 for 16-bit inputs (float64 for
float64); the products take the compute dtype's operands as ``attention`` does.
"""
from __future__ import annotations

import math

from ...backend import get_array_module
from .. import precision
from ..function import Function
from .sequence_chunks import ChunkLayout

KV_TAG, GRAD_TAG = 71, 72  # the cp communicator carries only these: blocks forward and backward, dK/dV


class _Ring:
    """One ring step's transfers: post with ``start``, complete with ``finish`` (the received buffer)."""

    def __init__(self, comm):
        self.comm = comm
        self.next, self.prev = (comm.rank + 1) % comm.size, (comm.rank - 1) % comm.size

    def start(self, block, tag):
        incoming = get_array_module(block).empty(block.shape, dtype=block.dtype)
        return (self.comm.isend(block, self.next, tag), self.comm.irecv(incoming, self.prev, tag)), incoming

    @staticmethod
    def progress(posted) -> None:
        """Let MPI move the transfers on between two blocks of compute: without an asynchronous
        progress thread a large message moves only inside MPI calls, so a transfer nobody tests
        until its wait is not hidden behind anything."""
        if posted is not None:
            for handle in posted[0]:
                handle.test()

    @staticmethod
    def finish(posted):
        (send, recv), incoming = posted
        recv.wait()
        send.wait()
        return incoming


def chunk_pairs(chunks, mine, theirs):
    """(query chunk index, key chunk index, diagonal) of the pairs that the causal mask leaves:
    a key chunk after the query chunk is skipped, the same one is the diagonal."""
    return [(i, j, a == b) for i, a in enumerate(mine) for j, b in enumerate(theirs) if b <= a]


def pairs_per_rank(size: int, zigzag: bool = True) -> list[int]:
    """The chunk pairs each rank of a ring of ``size`` computes in one forward: its attention work
    (a diagonal pair costs a whole one: it is masked, not cut). Zigzag: 2C + 1 on every rank."""
    counts = []
    for rank in range(size):
        layout = ChunkLayout(rank, size, zigzag)
        counts.append(sum(len(chunk_pairs(layout, layout.chunks(), layout.chunks(owner))) for owner in range(size)))
    return counts


class RingAttention(Function):
    """softmax(q k^T / sqrt(hs) + causal mask) v over the cp group's whole sequence, for this rank's rows.

    q, k, v: (B, H, Tl, hs), this rank's two chunks of the sequence (Tl = T / C). ``keep``, optional:
    the attention-dropout scales of this rank's query rows against every key of the sequence,
    (B, H, Tl, T), as ``nn.HeadDropout`` draws them by global position.
    """

    op = "ring_attention"

    def forward(self, q, k, v, comm=None, chunks=None, keep=None):
        if q.ndim != 4 or q.shape != k.shape or q.shape != v.shape or q.shape[2] % 2:
            raise ValueError(f"ring_attention: q, k, v must share one (B, H, Tl, hs) shape with Tl even, "
                             f"got {q.shape}, {k.shape}, {v.shape}")
        xp = get_array_module(q)
        self.comm, self.chunks, self.keep = comm, chunks, keep
        self.c = c = q.shape[2] // 2
        self.scale = 1.0 / math.sqrt(q.shape[-1])
        self.acc = precision.accumulation_dtype(q.dtype)
        q_scaled = precision.gemm_operand(q) * self.scale
        outs = [xp.zeros(q.shape[:2] + (c, q.shape[3]), dtype=self.acc) for _ in range(2)]
        lses = [xp.full(q.shape[:2] + (c, 1), -xp.inf, dtype=self.acc) for _ in range(2)]
        ring, block = _Ring(comm), xp.stack([k, v])  # (2, B, H, Tl, hs): k and v travel as one buffer
        for step in range(comm.size):
            posted = ring.start(block, KV_TAG) if step < comm.size - 1 else None
            owner = (comm.rank - step) % comm.size
            for i, j, diagonal in chunk_pairs(chunks, chunks.chunks(), chunks.chunks(owner)):
                probs, lse = self._block_probs(q_scaled, block[0], i, j, diagonal, owner)
                weights = probs if keep is None else probs * self._keep(i, j, owner)
                part = precision.matmul(weights.astype(q.dtype, copy=False), block[1][:, :, j * c:(j + 1) * c])
                merged = xp.logaddexp(lses[i], lse)
                outs[i] = outs[i] * xp.exp(lses[i] - merged) + precision.upcast(part) * xp.exp(lse - merged)
                lses[i] = merged
                ring.progress(posted)
            if posted is not None:
                block = ring.finish(posted)
        out = xp.concatenate(outs, axis=2)
        self.q_scaled, self.k, self.v, self.out = q_scaled, k, v, out
        self.lse = xp.concatenate(lses, axis=2)  # (B, H, Tl, 1)
        return out.astype(q.dtype, copy=False)

    def _block_probs(self, q_scaled, keys, i, j, diagonal, owner, lse=None):
        """The scores of query chunk i against key chunk j (of ``owner``'s block), softmaxed: within
        the block with their own log-sum-exp (forward), or against the row's whole ``lse`` (backward)."""
        xp, c = get_array_module(q_scaled), self.c
        scores = precision.matmul(q_scaled[:, :, i * c:(i + 1) * c], keys[:, :, j * c:(j + 1) * c].swapaxes(-1, -2),
                                  keep_float32=True).astype(self.acc, copy=False)
        if diagonal:  # -inf above the diagonal: a key after the query gets probability 0
            scores += xp.where(xp.tri(c, dtype=bool), scores.dtype.type(0), scores.dtype.type(-xp.inf))
        if lse is None:
            peak = scores.max(axis=-1, keepdims=True)
            scores -= peak
            xp.exp(scores, out=scores)
            total = scores.sum(axis=-1, keepdims=True)
            scores /= total
            return scores, peak + xp.log(total)
        scores -= lse
        return xp.exp(scores, out=scores), lse

    def _keep(self, i, j, owner):
        """The dropout scales of query chunk i against key chunk j of ``owner``'s block."""
        c, key_chunk = self.c, self.chunks.chunks(owner)[j]
        return self.keep[:, :, i * c:(i + 1) * c, key_chunk * c:(key_chunk + 1) * c]

    def backward(self, grad):
        xp, c, comm = get_array_module(grad), self.c, self.comm
        grad = precision.gemm_operand(grad)
        # softmax backward's row term sum_j dP_ij P_ij = grad_i . out_i (with dropout too)
        row = precision.sum(precision.upcast(grad) * self.out, axis=-1, keepdims=True)
        grad_q = xp.zeros(self.out.shape, dtype=self.acc)
        ring, block = _Ring(comm), xp.stack([self.k, self.v])
        carried = None  # the dK/dV accumulator of the block held now, from the ranks that held it before
        mine = self.chunks.chunks()
        for step in range(comm.size):
            posted = ring.start(block, KV_TAG) if step < comm.size - 1 else None
            owner = (comm.rank - step) % comm.size
            part = xp.zeros((2,) + self.out.shape, dtype=self.acc)
            for i, j, diagonal in chunk_pairs(self.chunks, mine, self.chunks.chunks(owner)):
                rows, keys = slice(i * c, (i + 1) * c), slice(j * c, (j + 1) * c)
                probs, _ = self._block_probs(self.q_scaled, block[0], i, j, diagonal, owner, self.lse[:, :, rows])
                keep = None if self.keep is None else self._keep(i, j, owner)
                weights = probs if keep is None else probs * keep
                g = grad[:, :, rows]
                part[1][:, :, keys] += precision.matmul(weights.astype(grad.dtype, copy=False).swapaxes(-1, -2), g,
                                                         keep_float32=True)
                d_scores = precision.matmul(g, block[1][:, :, keys].swapaxes(-1, -2), keep_float32=True)
                if keep is not None:
                    d_scores *= keep
                d_scores -= row[:, :, rows]
                d_scores *= probs
                grad_q[:, :, rows] += precision.matmul(d_scores, block[0][:, :, keys], keep_float32=True)
                part[0][:, :, keys] += precision.matmul(d_scores.swapaxes(-1, -2), self.q_scaled[:, :, rows],
                                                         keep_float32=True)
                ring.progress(posted)
                ring.progress(carried)
            if carried is not None:
                part += ring.finish(carried)
            carried = ring.start(part, GRAD_TAG)  # on to the next rank: after C steps each is home
            if posted is not None:
                block = ring.finish(posted)
        grads = ring.finish(carried)
        grad_q *= self.scale
        return grad_q, grads[0], grads[1]


def ring_attention(q, k, v, comm, chunks, keep=None):
    """Causal attention of this rank's chunks (``sequence_chunks.ChunkLayout``) over the whole
    sequence of the cp group ``comm``; ``keep``: optional (B, H, Tl, T) attention-dropout scales."""
    return RingAttention.apply(q, k, v, comm=comm, chunks=chunks, keep=keep)
