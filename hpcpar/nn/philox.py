"""Philox4x32-10, the counter-based generator of Random123 (Salmon et al., SC'11; cuRAND's and
PyTorch's CUDA generator), on the arrays of any array module: the keyed dropout draws of a
device model are made on the device, with no host draw and no copy.

Its output is a pure function of (key, counter): draw ``i`` of a stream is computed from ``i``
alone, so a rank makes the draws of its samples and rows directly, as ``PCG64.advance`` lets the
host path jump to them. The 32-bit words live in uint64 arrays so that a 32 x 32-bit product is
exact (CuPy and NumPy have no multiply-high); the rounds are elementwise integer operations that
NumPy, CuPy and the transfer guard compute alike, bit for bit.
"""
from __future__ import annotations

import numpy as np

MASK32 = 0xFFFFFFFF
MULTIPLIERS = (0xD2511F53, 0xCD9E8D57)
KEY_STEPS = (0x9E3779B9, 0xBB67AE85)  # the golden ratio and sqrt(3) - 1, as 32-bit fractions
ROUNDS = 10


def philox4x32(counter: tuple, key: tuple, rounds: int = ROUNDS) -> tuple:
    """The four 32-bit output words (uint64 arrays, or ints) of Philox4x32 for the four counter
    words ``counter`` (uint64 arrays or ints below 2**32, broadcast together) and the two key words."""
    c0, c1, c2, c3 = counter
    k0, k1 = key
    for _ in range(rounds):
        product0, product1 = c0 * MULTIPLIERS[0], c2 * MULTIPLIERS[1]
        c0, c1, c2, c3 = ((product1 >> 32) ^ c1 ^ k0, product1 & MASK32,
                          (product0 >> 32) ^ c3 ^ k1, product0 & MASK32)
        k0, k1 = (k0 + KEY_STEPS[0]) & MASK32, (k1 + KEY_STEPS[1]) & MASK32
    return c0, c1, c2, c3


def stream_words(words: tuple) -> tuple:
    """(key, the counter's two upper words) of the stream named by ``words`` (any integers):
    four words of NumPy's ``SeedSequence`` of them, as the host path seeds its PCG64."""
    k0, k1, c2, c3 = (int(w) for w in np.random.SeedSequence([int(w) for w in words]).generate_state(4, np.uint32))
    return (k0, k1), (c2, c3)


def uniform_runs(words: tuple, first_draw: int, run_stride: int, runs: int, count: int, dtype, xp):
    """Uniform [0, 1) draws of the stream ``words``, shape (runs, count): run ``j`` is draws
    ``first_draw + j * run_stride`` onwards, computed on ``xp``'s device.

    Block ``n`` of the stream is Philox of counter (n mod 2**32, n div 2**32, the stream's two
    words); its four 32-bit outputs make four float32 draws (24 bits each) or two float64 draws
    (53 bits of two outputs), in order.
    """
    dtype = np.dtype(dtype)
    per_block = 4 if dtype == np.float32 else 2
    key, (c2, c3) = stream_words(words)
    starts = xp.arange(runs, dtype=xp.uint64) * run_stride + first_draw
    skips = starts % per_block  # draws of a run's first block before the run
    width = -(-(per_block - 1 + count) // per_block)  # blocks covering any run
    blocks = (starts // per_block)[:, None] + xp.arange(width, dtype=xp.uint64)[None, :]
    outputs = xp.stack(philox4x32((blocks & MASK32, blocks >> 32, c2, c3), key), axis=-1).reshape(runs, width * 4)
    if per_block == 4:
        values = (outputs >> 8).astype(xp.float32) * np.float32(2.0 ** -24)
    else:
        pairs = outputs.reshape(runs, width * 2, 2)
        values = ((pairs[..., 0] >> 5) * (1 << 26) + (pairs[..., 1] >> 6)).astype(xp.float64) * (2.0 ** -53)
    wanted = skips.astype(xp.int64)[:, None] + xp.arange(count, dtype=xp.int64)[None, :]
    return xp.take_along_axis(values, wanted, axis=1)
