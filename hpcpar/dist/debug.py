"""Debug-mode agreement checks: every rank must call the same collective on the same data.

With ``HPCPAR_DEBUG=1`` each array collective first gathers (operation, shape, dtype) from
all ranks of its communicator and raises, on every rank alike, naming the ranks that differ.
A mismatched collective otherwise hangs or silently mixes buffers. The check costs one small
pickled all-gather per call, which is why it is off by default.
"""
from __future__ import annotations

import os


class CollectiveMismatchError(RuntimeError):
    """Ranks of one communicator called different collectives or passed different buffers."""


_enabled = os.environ.get("HPCPAR_DEBUG", "0") not in ("", "0")


def enabled() -> bool:
    return _enabled


def set_enabled(flag: bool) -> None:
    global _enabled
    _enabled = bool(flag)


def check_collective(comm, op: str, array) -> None:
    """Raise CollectiveMismatchError on all ranks if they disagree on ``op``/shape/dtype."""
    if not _enabled or comm.size == 1:
        return
    mine = (op, tuple(array.shape), str(array.dtype))
    everyone = comm.mpi.allgather(mine)  # uncounted: debugging must not change the traffic figures
    if all(call == everyone[0] for call in everyone):
        return
    groups: dict = {}
    for rank, call in enumerate(everyone):
        groups.setdefault(call, []).append(rank)
    described = "; ".join(f"ranks {ranks}: {c[0]} shape {c[1]} dtype {c[2]}" for c, ranks in groups.items())
    raise CollectiveMismatchError(f"collective mismatch on communicator '{comm.name}': {described}")
