"""What the workers and servers of a parameter server agree on: the message tags, the kinds of a
push header (``[kind, step, version read, lr]`` as float64), how the flattened parameters are cut
into the servers' ranges (``shard_ranges``), and the record a server logs per update.
"""
from __future__ import annotations

from dataclasses import dataclass

TAG_PUSH_HEADER, TAG_PUSH_GRAD, TAG_REPLY_HEADER, TAG_REPLY_PARAMS = 7301, 7302, 7303, 7304
KIND_PUSH, KIND_STOP, KIND_SAVE, KIND_PUSH_NONFINITE = 0.0, 1.0, 2.0, 3.0  # the last: a push not to apply
HEADER_LENGTH = 4  # [kind, step, version read, lr] as float64: exact for steps below 2**53


@dataclass(frozen=True)
class UpdateRecord:
    """One gradient applied by one server."""

    worker: int  # world rank of the worker that pushed it
    step: int  # that worker's step (0, 1, ...)
    version_read: int  # this server's version of the parameters the gradient was computed from
    version: int  # this server's version after the update
    staleness: int  # updates this server applied between the read and this update (0 when synchronous)
    lead: int  # steps the worker was ahead of the slowest active worker when it read (<= the bound s)


def shard_ranges(numel: int, parts: int) -> list[tuple[int, int]]:
    """``parts`` contiguous [start, stop) ranges covering ``numel`` elements, sizes at most one apart."""
    return [(i * numel // parts, (i + 1) * numel // parts) for i in range(parts)]
