"""Which dropout masks a forward draws: a pure function of where its rows sit in training.

    with dropout_key(DropoutKey(step=7, first_sample=16)):   # rows 16, 17, ... of step 7's global batch
        loss = model.loss(ids, targets)

A mask element is a pure function of (model seed, step, global sample index, dropout site,
attention head, position in the sample): never of the rank that draws it or of how many
masks were drawn before. Every dp x pp x tp layout and every pipeline schedule therefore drops
exactly what one process drops, and a checkpoint needs no random state to resume: the step
and the rows' place in the global batch are the data position it restores anyway. The key in
force is a context variable: the training loop sets it per step, engines that cut a batch into
micro-batches move it on by their offset (``offset_dropout_key``), and a recomputation that
replays a forward later re-enters the key the forward ran under (``replay_dropout_key``, made
at the forward, entered around the replay). The draws themselves: ``keyed_uniform``.
"""
from __future__ import annotations

import contextlib
import contextvars
from dataclasses import dataclass, replace

import numpy as np

from .philox import uniform_runs


@dataclass(frozen=True)
class DropoutKey:
    """Training step ``step``; the forward's rows are samples ``first_sample``, ``first_sample + 1``, ...
    of that step's global batch (a dp replica's offset plus its micro-batch's)."""

    step: int
    first_sample: int = 0

    def shifted(self, rows: int) -> DropoutKey:
        return replace(self, first_sample=self.first_sample + rows)


_ACTIVE: contextvars.ContextVar = contextvars.ContextVar("hpcpar_dropout_key", default=None)


def active_dropout_key() -> DropoutKey | None:
    """The key the dropout layers of a forward run now would use (None: none set)."""
    return _ACTIVE.get()


@contextlib.contextmanager
def dropout_key(key: DropoutKey | None):
    """Forwards inside draw the masks of ``key``."""
    token = _ACTIVE.set(key)
    try:
        yield key
    finally:
        _ACTIVE.reset(token)


def replay_dropout_key():
    """A context that re-enters the key in force now: made when a region runs forward, entered when
    recomputation reruns it in backward (``autograd.recompute``'s ``context``), so the rerun draws
    the first run's masks whatever key (or micro-batch offset) is in force by then."""
    return dropout_key(active_dropout_key())


def offset_dropout_key(rows: int):
    """The active key moved on by ``rows`` samples (a micro-batch ``rows`` into the batch); no key stays none."""
    key = active_dropout_key()
    return dropout_key(None if key is None else key.shifted(rows))


def draw_dtype(dtype) -> np.dtype:
    """What the generators draw for masks of ``dtype``: float64 for float64, float32 otherwise."""
    return np.dtype(np.float64) if np.dtype(dtype) == np.float64 else np.dtype(np.float32)


def keyed_uniform(words: tuple, per_sample: tuple, samples: range, rows: range | None, dtype, xp=np):
    """Uniform [0, 1) draws of shape (len(samples), len(rows), *per_sample[1:]) from the stream keyed by ``words``.

    The stream of (seed, step, site[, head]) holds the samples one after the other, each
    row-major (sample ``s``, element ``e`` of its ``N`` is draw ``s * N + e``); a rank jumps to
    the draws of its samples and of its rows (sequence parallelism) without drawing the others
    (``PCG64.advance`` on the host; on a device, Philox computes any draw from its index).

    ``per_sample``: the whole shape of one sample's mask; ``samples``: global sample indices
    (consecutive); ``rows``: the rows of axis 0 of each sample wanted (None: all). ``dtype``:
    float32 or float64 (``draw_dtype``). On the host (``xp`` NumPy) the stream is PCG64's: a
    float32 draw takes half of the generator's 64-bit output, so a start at an odd float32 draw
    discards one. On a device (CuPy, the transfer guard) it is Philox4x32-10's (``philox``),
    computed there: the same draws in every layout, other values than the host's.
    """
    dtype = np.dtype(dtype)
    size = int(np.prod(per_sample))
    row = size // per_sample[0] if per_sample[0] else 0
    rows = range(per_sample[0]) if rows is None else rows
    shape = (len(samples), len(rows)) + tuple(per_sample[1:])
    whole = len(rows) == per_sample[0]  # whole samples: one run of draws, else one run per sample
    first = samples.start * size + (0 if whole else rows.start * row)
    runs, count = (1, len(samples) * size) if whole else (len(samples), len(rows) * row)
    if not runs * count:
        return xp.empty(shape, dtype=dtype)
    if xp is not np:
        return uniform_runs(words, first, size, runs, count, dtype, xp).reshape(shape)
    per_output = 2 if dtype == np.float32 else 1  # draws per 64-bit output
    bits = np.random.PCG64(np.random.SeedSequence([int(w) for w in words]))
    generator = np.random.Generator(bits)
    out = np.empty(runs * count, dtype=dtype)
    position, filled = 0, 0  # 64-bit outputs consumed; draws written
    for start in range(first, first + runs * size, size):
        begin, skip = divmod(start, per_output)
        bits.advance(begin - position)  # also drops a buffered half of an output
        if skip:
            generator.random(skip, dtype=dtype)
        generator.random(dtype=dtype, out=out[filled:filled + count])
        position, filled = begin + -(-(skip + count) // per_output), filled + count
    return out.reshape(shape)
