"""Bytes a GPT keeps alive for backward, per micro-batch and rank: formulas, exact for NumPy.

What a graph keeps is what ``hpcpar.autograd.memory.kept_for_backward`` counts: the arrays the ops
saved for their backward and the arrays of leaf inputs, each buffer once (an intermediate no
backward reads is not kept: the graph links it by a node without its array).
``tests/test_recompute.py`` checks these formulas against that count, byte for byte, for each
recomputation mode, float64, float32 and bfloat16, with and without dropout, with tensor and
sequence parallelism (and ``tests/test_cp_memory.py`` on a context-parallel rank, ``cp``: T / cp
tokens, ring attention's arrays). ``block_kept_bytes`` is one block (by recomputation mode),
``embedding_kept_bytes`` and ``head_kept_bytes`` what lies outside the blocks; each block counts
the input it keeps itself, so embedding + n_layer blocks + head is the whole graph (the planner's
activation term). docs/architecture.md ("Activation memory") compares it with Korthikanti et al.
"""
from __future__ import annotations

import numpy as np

from ..autograd import precision
from .gpt import RECOMPUTE


def block_kept_bytes(batch: int, seq: int, n_embd: int, n_head: int, *, dtype=np.float32, tp: int = 1,
                     sequence_parallel: bool = False, recompute: str = "none", dropout: float = 0.0,
                     attn_dropout: float | None = None, cp: int = 1) -> float:
    """Bytes one block keeps for backward on one tp (and cp) rank for one micro-batch of ``batch`` x ``seq`` tokens.

    With b rows of s tokens (N = b s; on a rank of C context-parallel ones N = b s / C, its two
    chunks of every sequence), width h, a heads, t tensor-parallel ranks, e the bytes of the
    compute dtype, f those of its accumulation dtype (4 for 16-bit, else e), and sigma = 1/t under
    sequence parallelism (else 1), a block keeps, by recomputation mode:

    - ``full``: its input only, ``sigma N h e``.
    - ``none``:
      - 2 N h e: the inputs of qkv and fc that their products save (the LayerNorm outputs; under
        sequence parallelism their all-gathers, the LayerNorm outputs themselves are not kept);
      - 2 sigma N h e: the LayerNorms' normalised inputs (32/64-bit), or at 16 bits their inputs,
        the block input and the residual sum (16-bit LayerNorm recomputes the normalised input);
      - LayerNorm statistics: 2 sigma N e (1/std twice), 16-bit: 4 sigma N f (mean and 1/std);
      - (12 + [a > t]) N h e / t: qkv's output (3, which k and v view), attention's output and its
        copy with the heads side by side (the proj input; a view with one head per rank), fc's
        output (GELU's input), GELU's output (4 each; GELU's tanh is recomputed in backward);
        plus q scaled by 1/sqrt(hs), N h / t in e (NumPy 16-bit: float32, f);
      - b (a / t) s^2 e: the probabilities; under cp > 1 ring attention keeps none of them but
        its log-sum-exp, N a / t f, and the dropout scales of its rows against the whole
        sequence, N (a / t) s f; its output is kept in f, and the proj input beside it
        (N h / t e) unless it is a view of that output (one head per rank, 32/64-bit).
      Not kept: dropout scales (residual, embedding and, at cp = 1, attention: drawn again from
      their keys in backward, ``nn.Dropout.drawer``, ``nn.HeadDropout.drawer``), the products of the two row-parallel projections (before and after their
      all-reduce or reduce-scatter, and after the bias add), the dropout outputs, and (32/64-bit)
      the block input and the residual sum: no backward reads them.
    - ``selective``: ``none`` less the scaled q, the b (a/t) s^2 terms and attention's output (the
      recomputed region's output, which the region's op does not keep; with one head per rank
      the proj input is a view of it, so it is kept as that).
    """
    if recompute not in RECOMPUTE:
        raise ValueError(f"recompute must be one of {', '.join(RECOMPUTE)}, got {recompute!r}")
    e, f, low, sigma, _ = _shares(dtype, tp, sequence_parallel)
    t = tp
    n, h = batch * local_length(seq, cp), n_embd
    if recompute == "full":
        return sigma * n * h * e
    kept = 2 * n * h * e + 2 * sigma * n * h * e
    kept += sigma * n * (4 * f if low else 2 * e)
    if recompute == "selective":  # the attention output is kept only as the proj input it is a view of
        return kept + 12 * n * h * e / t
    kept += 11 * n * h * e / t  # qkv's output, attention's, fc's (GELU's input) and GELU's output
    attn_dropout = dropout if attn_dropout is None else attn_dropout
    return kept + attention_kept_bytes(batch, seq, n_embd, n_head, dtype=dtype, tp=tp, cp=cp,
                                       dropout=attn_dropout > 0)


def attention_kept_bytes(batch: int, seq: int, n_embd: int, n_head: int, *, dtype=np.float32, tp: int = 1,
                         cp: int = 1, dropout: bool = False) -> float:
    """What attention keeps for backward (``attention``, or ``ring_attention`` under cp > 1), and the
    proj input made from its output, on one tp (and cp) rank for one micro-batch (``block_kept_bytes``)."""
    e, f, low, _, _ = _shares(dtype, tp, False)
    heads, h = n_head / tp, n_embd / tp
    n = batch * local_length(seq, cp)  # query rows here
    kept = n * h * f  # q scaled: float32 under 16 bits on NumPy (and e otherwise, where f = e)
    if cp == 1:  # its output, and the copy with the heads side by side unless one head per rank (a view)
        kept += n * h * e * (2 if n_head > tp else 1)
        return kept + batch * heads * seq * seq * e  # the probabilities (dropout scales are drawn again in backward)
    view = not low and n_head <= tp  # the proj input is a view of the output the ring keeps (in f = e)
    kept += n * h * (f + (0 if view else e))
    kept += n * heads * f  # the log-sum-exp of each row, (B, H, T / C, 1)
    return kept + (n * heads * seq * f if dropout else 0)  # its rows' dropout scales against every key


def korthikanti_block_bytes(batch: int, seq: int, n_embd: int, n_head: int, *, itemsize: int = 2,
                            recompute: str = "none") -> float:
    """Korthikanti et al. (2022)'s activation bytes per transformer layer without tensor parallelism,
    the yardstick of hpcpar's count: with 16-bit values and 1-byte dropout masks s b h (34 + 5 a s / h)
    without recomputation, 34 s b h selective (the 5 a s / h of the (T, T) arrays recomputed), 2 s b h
    full (the layer's input). Of the 34, 2 are the two residual-branch masks; of the 5, 1 is the
    attention-dropout mask. ``itemsize`` scales the values (4: float32 values, 1-byte masks still).
    (``plan.model.korthikanti_bytes``: the 16-bit formula with tensor and sequence parallelism.)"""
    s, b, h, a = seq, batch, n_embd, n_head
    if recompute == "full":
        return s * b * h * itemsize
    values = itemsize / 2
    per = 32 * values + 2
    if recompute == "none":
        per += (4 * values + 1) * a * s / h
    return s * b * h * per


def local_length(seq: int, cp: int = 1) -> int:
    """The positions of a sequence of ``seq`` tokens that a rank of ``cp`` context-parallel ones
    holds: its two chunks of 2 cp (``autograd.ops.sequence_chunks``)."""
    if cp > 1 and seq % (2 * cp):
        raise ValueError(f"context parallelism cuts each sequence into 2 x cp = {2 * cp} chunks: "
                         f"{seq} tokens do not divide")
    return seq // cp


def keeps_input(dtype=np.float32, recompute: str = "none") -> bool:
    """Whether a block (or, with recompute "none", the head) keeps its own input for backward, so that
    its kept bytes count it: a 16-bit LayerNorm keeps its input, a fully recomputed block keeps it
    to rerun; a 32/64-bit LayerNorm keeps its normalised input instead, and nothing else reads it."""
    return precision.is_low(np.dtype(dtype)) or recompute == "full"


def _shares(dtype, tp: int, sequence_parallel: bool):
    dtype = np.dtype(dtype)
    low = precision.is_low(dtype)
    sp = sequence_parallel and tp > 1
    return dtype.itemsize, precision.accumulation_dtype(dtype).itemsize, low, (1 / tp if sp else 1), sp


def embedding_kept_bytes(batch: int, seq: int, n_embd: int, *, dtype=np.float32, tp: int = 1,
                         sequence_parallel: bool = False, cp: int = 1) -> float:
    """Bytes the embedding stage keeps for backward per micro-batch and tp (and cp) rank (int64 ids, one array).

    Its integer ids (and under tensor parallelism the mask of rows outside this rank's vocabulary);
    its dropout's scales are drawn again in backward, not kept; a cp rank holds seq / cp positions
    of each sequence.
    """
    _, _, _, sigma, _ = _shares(dtype, tp, sequence_parallel)
    seq = local_length(seq, cp)
    n = batch * seq
    kept = n * 8 + sigma * seq * 8  # token ids (tp: their local rows) and position ids
    if tp > 1:
        kept += n  # the mask of rows outside this rank's vocabulary
    return kept


def head_kept_bytes(batch: int, seq: int, n_embd: int, vocab_size: int, *, dtype=np.float32, tp: int = 1,
                    sequence_parallel: bool = False, cp: int = 1) -> float:
    """Bytes the head (final LayerNorm, logits, cross entropy) keeps per micro-batch and tp (and cp) rank, its input included.

    The final LayerNorm's normalised input (16-bit: its input, the last block's output) and
    statistics, its output (gathered under sequence parallelism), which the logits' product saves,
    the loss's float32-or-wider softmax of the logits (N V / t f; the logits themselves are not
    kept), and integer targets (a cp rank's: N = b seq / cp).
    """
    e, f, low, sigma, sp = _shares(dtype, tp, sequence_parallel)
    n, h = batch * local_length(seq, cp), n_embd
    kept = sigma * n * h * e  # LayerNorm's normalised input (16-bit: its input)
    kept += sigma * n * (2 * f if low else e)  # its statistics
    kept += n * h * e  # its output, the logits' input (all-gathered under sequence parallelism)
    kept += n * vocab_size / tp * f  # the loss's softmax of the logits
    kept += (n * (8 + 8 + 1) if tp == 1 else n * (1 + 8 + 1)) + 8  # target rows, masks, the count (0-d int64)
    return kept
