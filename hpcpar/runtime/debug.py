"""Debug-mode agreement checks: every rank must call the same collective on the same data.

With ``HPCPAR_DEBUG=1`` each array collective first gathers (operation, shape, dtype) from
all ranks of its communicator and raises, on every rank alike, naming the ranks that differ.
A mismatched collective otherwise hangs or silently mixes buffers. The check costs one small
pickled all-gather per call, which is why it is off by default.
"""
from __future__ import annotations

import os


class CollectiveMismatchError(RuntimeError):
    """Ranks of one communicator called different collectives or passed different buffers.

    Every rank of the communicator raises it; ``report_elsewhere`` is True on all but the lowest,
    so that fail-fast prints the report once (``failfast``) instead of once per rank."""

    report_elsewhere = False


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
    from mpi4py import MPI

    mine = (op, tuple(array.shape), str(array.dtype))
    # uncounted: debugging must not change the traffic figures
    everyone = comm.mpi.allgather((mine, MPI.COMM_WORLD.Get_rank()))
    if all(call == everyone[0][0] for call, _ in everyone):
        return
    groups: dict = {}
    for rank, (call, world_rank) in enumerate(everyone):
        groups.setdefault(call, []).append((rank, world_rank))
    described = "; ".join(f"ranks {[r for r, _ in ranks]}: {c[0]} shape {c[1]} dtype {c[2]} "
                          f"(world ranks {[w for _, w in ranks]})" for c, ranks in groups.items())
    error = CollectiveMismatchError(f"collective mismatch on communicator '{comm.name}' (ranks of the communicator, "
                                    f"world ranks in parentheses): {described}")
    error.report_elsewhere = comm.rank != 0  # its rank 0 is the lowest rank that found it
    raise error
