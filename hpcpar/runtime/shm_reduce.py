"""The arithmetic of the shared-memory collectives: slices, chunks and the order of the sum.

Pure NumPy on lists of arrays (one per rank of a node), so it is tested without MPI. A sum adds
in MPICH's order (``combine``), so the shared-memory path gives MPI's result bit for bit.
"""
from __future__ import annotations

import numpy as np

CACHE_LINE = 64


def slices(count: int, parts: int, itemsize: int) -> list[tuple[int, int]]:
    """``parts`` ranges covering ``range(count)`` with boundaries on cache lines where possible.

    Each rank writes only its own range of every buffer; aligned boundaries keep two ranks
    from writing one cache line (false sharing).
    """
    step = max(1, CACHE_LINE // itemsize)
    bounds = [min(count, (count * i // parts + step - 1) // step * step) for i in range(parts)] + [count]
    return [(bounds[i], bounds[i + 1]) for i in range(parts)]


def chunks(lo: int, hi: int, chunk: int):
    """``range(lo, hi)`` in pieces of at most ``chunk`` elements (cache-sized work)."""
    for start in range(lo, hi, chunk):
        yield start, min(hi, start + chunk)


def temporaries(n: int, chunk: int, dtype) -> list[np.ndarray]:
    """Scratch for partial sums of one chunk: two per level of the tree over n operands."""
    levels = max(1, n.bit_length())
    return [np.empty(chunk, dtype=dtype) for _ in range(2 * levels)]


def combine(sources: list, out, ufunc, temps: list) -> None:
    """``out`` = ``ufunc`` over ``sources`` in MPICH's order.

    ``out`` may be one of the sources (it is written last, after every source was read);
    partial results go to ``temps`` (from ``temporaries``), never to a source.

    Floating-point addition is not associative, so "equal to MPI" means "adds in MPI's order".
    MPICH reduces commutative operations by recursive doubling (small messages) or by
    Rabenseifner's reduce-scatter + all-gather (large ones); both combine the operands as the
    same tree, measured here to give bitwise MPICH's result at 2, 3 and 4 ranks from 8 B to
    32 MiB in float32 and float64:

    - with n operands and p the largest power of two <= n, the first 2(n - p) are summed in
      pairs, (a0 + a1), (a2 + a3), ..., the rest are taken as they are, which leaves p values;
    - those p values are summed as a balanced binary tree over neighbours: n = 4:
      (a0 + a1) + (a2 + a3); n = 3: (a0 + a1) + a2; n = 8: ((a0+a1)+(a2+a3))+((a4+a5)+(a6+a7)).

    ``a + b == b + a`` exactly in IEEE arithmetic, so only the tree matters, not which operand
    of a pair MPI put first. Node sums taken in this order and then summed across nodes by MPI
    over the node leaders' partial sums give the same tree when nodes are power-of-two blocks
    of consecutive ranks (2 nodes x 2 ranks: (a0 + a1) + (a2 + a3)).
    """
    n = len(sources)
    if n == 1:
        if sources[0] is not out:
            out[...] = sources[0]
        return
    pof2 = 1 << (n.bit_length() - 1)
    rem = n - pof2
    leaves = [tuple(sources[2 * i: 2 * i + 2]) for i in range(rem)] + [(s,) for s in sources[2 * rem:]]
    _tree(leaves, ufunc, temps, 0, out)


def _tree(leaves: list, ufunc, temps: list, depth: int, target):
    """Combine ``leaves`` (pairs or single sources; a power of two of them) into ``target``.

    A single source is returned as it is (no copy). At depth d the left partial goes to
    ``temps[2d]``, the right one to ``temps[2d + 1]``; deeper levels use later slots, so a
    finished left partial is never overwritten while the right side is computed.
    """
    if len(leaves) == 1:
        if len(leaves[0]) == 1:
            return leaves[0][0]
        ufunc(leaves[0][0], leaves[0][1], out=target)
        return target
    half, length = len(leaves) // 2, target.shape[0]
    left = _tree(leaves[:half], ufunc, temps, depth + 1, temps[2 * depth][:length])
    right = _tree(leaves[half:], ufunc, temps, depth + 1, temps[2 * depth + 1][:length])
    ufunc(left, right, out=target)
    return target


def reduce_into(sources: list, targets: list, ufunc, divisor: int, chunk: int) -> None:
    """Every target = ``ufunc`` over ``sources`` in MPICH's order, divided by ``divisor`` unless 0.

    Chunk by chunk (``chunk`` elements, cache-sized): the first target gets the result, the
    others a copy of it while it is still in the cache. A source may be a target: each chunk
    of every source is read before that chunk of any target is written.
    """
    count = sources[0].shape[0]
    temps = temporaries(len(sources), min(chunk, count), sources[0].dtype)
    for lo, hi in chunks(0, count, chunk):
        first = targets[0][lo:hi]
        combine([source[lo:hi] for source in sources], first, ufunc, temps)
        if divisor:
            first /= divisor
        for target in targets[1:]:
            target[lo:hi] = first


def reference(arrays: list, ufunc=np.add):
    """The combination of whole arrays in the documented order (for tests and checks)."""
    out = np.empty_like(arrays[0])
    combine(list(arrays), out, ufunc, temporaries(len(arrays), out.size, out.dtype))
    return out
