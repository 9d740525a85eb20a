"""Bytes one GPT block keeps alive for backward, per micro-batch and rank: a formula, exact for NumPy.

What a graph keeps is what ``hpcpar.autograd.memory.kept_for_backward`` counts: the arrays the ops
saved and the input arrays the graph's nodes hold, each buffer once. ``tests/test_recompute.py``
checks this formula against that count, byte for byte, for each recomputation mode, float64,
float32 and bfloat16, with and without dropout, with tensor and sequence parallelism.

With b rows of s tokens (N = b s), width h, a heads, t tensor-parallel ranks, e the bytes of the
compute dtype, f those of its accumulation dtype (4 for 16-bit, else e), and sigma = 1/t under
sequence parallelism (else 1), a block keeps, by recomputation mode:

- ``full``: its input only, ``sigma N h e``.
- ``none``:
  - (2 + 2 [t > 1]) N h e: the two row-parallel products before their all-reduce, and their
    all-reduced sums (sequence parallelism: the all-gathered inputs of qkv and fc instead);
  - (6 + 2 [32/64-bit] + 2 [sp]) sigma N h e: block input, the two LayerNorm outputs, the residual
    sum, the two branch outputs, the LayerNorms' normalised inputs (kept in 32/64 bits; 16-bit
    LayerNorm keeps its input and recomputes them), the reduce-scatter outputs (sp);
  - LayerNorm statistics: 2 sigma N e (1/std twice), 16-bit: 4 sigma N f (mean and 1/std);
  - (12 + [a > t] + 4 [32/64-bit]) N h e / t: qkv's output (3, which k and v view), attention's
    output and its copy with the heads side by side (the proj input; a view with one head per
    rank), fc's output, GELU's output (4 each), GELU's tanh (4, 32/64-bit only); plus q scaled
    by 1/sqrt(hs), N h / t in e (NumPy 16-bit: float32, f);
  - b (a / t) s^2 (e + [attention dropout] f): the probabilities and the dropout scales;
  - with residual dropout: 2 sigma N h (f + e), its two scales (float32 under 16 bits) and outputs.
- ``selective``: ``none`` less the scaled q and the b (a/t) s^2 terms.

Outside the blocks (``embedding_kept_bytes``, ``head_kept_bytes``): the embedding keeps its token
and position rows (and under tensor parallelism the masked rows before their all-reduce), its
dropout's input and scales, and integer ids; the head keeps the final LayerNorm's input (the last
block's output), its output (gathered under sequence parallelism), the logits (N V / t) and the
loss's float32-or-wider softmax of them (N V / t f), and integer targets. A block keeps its own
input, so embedding + n_layer blocks + head is the whole graph.

Against Korthikanti et al. (2022), ``s b h (34 + 5 a s / h)`` bytes at 16 bits (t = 1), this
graph keeps 58 s b h + 6 a s^2 b bytes in bfloat16 with dropout, plus 16 s b: the extra s b h
terms are arrays no backward reads but the graph holds as inputs of its nodes (the products
before the bias adds, the dropout outputs, the residual sums), q scaled in float32 and the
attention output; dropout scales are float32 where a GPU keeps a 1-byte mask.
"""
from __future__ import annotations

import numpy as np

from ..autograd import precision
from .gpt import RECOMPUTE


def block_kept_bytes(batch: int, seq: int, n_embd: int, n_head: int, *, dtype=np.float32, tp: int = 1,
                     sequence_parallel: bool = False, recompute: str = "none", dropout: float = 0.0,
                     attn_dropout: float | None = None) -> float:
    """Bytes one block keeps for backward on one tp rank for one micro-batch of ``batch`` x ``seq`` tokens."""
    if recompute not in RECOMPUTE:
        raise ValueError(f"recompute must be one of {', '.join(RECOMPUTE)}, got {recompute!r}")
    dtype = np.dtype(dtype)
    low = precision.is_low(dtype)
    e, f = dtype.itemsize, precision.accumulation_dtype(dtype).itemsize
    t = tp
    sp = sequence_parallel and t > 1
    sigma = 1 / t if sp else 1
    n, h = batch * seq, n_embd
    if recompute == "full":
        return sigma * n * h * e
    wide = 0 if low else 1
    kept = (2 + 2 * (t > 1)) * n * h * e
    kept += (6 + 2 * wide + 2 * sp) * sigma * n * h * e
    kept += sigma * n * (4 * f if low else 2 * e)
    copy = 1 if n_head > t else 0  # (B, T, nh, hs) -> (B, T, nh hs) needs a copy unless one head per rank
    kept += (12 + copy + 4 * wide) * n * h * e / t
    if dropout > 0:
        kept += 2 * sigma * n * h * (f + e)
    if recompute == "selective":
        return kept
    attn_dropout = dropout if attn_dropout is None else attn_dropout
    kept += n * h / t * f  # q scaled: float32 under 16 bits on NumPy (and e otherwise, where f = e)
    kept += batch * (n_head / t) * seq * seq * (e + (f if attn_dropout > 0 else 0))
    return kept


def _shares(dtype, tp: int, sequence_parallel: bool):
    dtype = np.dtype(dtype)
    low = precision.is_low(dtype)
    sp = sequence_parallel and tp > 1
    return dtype.itemsize, precision.accumulation_dtype(dtype).itemsize, low, (1 / tp if sp else 1), sp


def embedding_kept_bytes(batch: int, seq: int, n_embd: int, *, dtype=np.float32, tp: int = 1,
                         sequence_parallel: bool = False, dropout: float = 0.0) -> float:
    """Bytes the embedding stage keeps for backward per micro-batch and tp rank (int64 ids, one array)."""
    e, f, _, sigma, _ = _shares(dtype, tp, sequence_parallel)
    n, h = batch * seq, n_embd
    kept = n * 8 + sigma * seq * 8  # token ids (tp: their local rows) and position ids
    if tp > 1:
        kept += n + n * h * e  # rows outside this rank's vocabulary; the masked rows before the all-reduce
    kept += sigma * (n + seq) * h * e  # token and position rows, the inputs of their sum
    if dropout > 0:
        kept += sigma * n * h * (e + f)  # the dropout's input and scales
    return kept


def head_kept_bytes(batch: int, seq: int, n_embd: int, vocab_size: int, *, dtype=np.float32, tp: int = 1,
                    sequence_parallel: bool = False) -> float:
    """Bytes the head (final LayerNorm, logits, cross entropy) keeps per micro-batch and tp rank, its input included."""
    e, f, low, sigma, sp = _shares(dtype, tp, sequence_parallel)
    n, h = batch * seq, n_embd
    kept = sigma * n * h * e * (2 if low else 3)  # LayerNorm input, output and (32/64-bit) normalised input
    kept += sigma * n * (2 * f if low else e)  # its statistics
    if sp:
        kept += n * h * e  # the gathered LayerNorm output, the logits' input
    kept += n * vocab_size / tp * (e + f)  # logits and the loss's softmax
    kept += (n * (8 + 8 + 1) if tp == 1 else n * (1 + 8 + 1)) + 8  # target rows, masks, the count (0-d int64)
    return kept
