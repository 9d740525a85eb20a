"""Sparse upcycling (Komatsuzaki et al. 2022): a dense checkpoint's MLPs become every expert's.

An MoE block's expert tensors are the dense MLP's with a leading axis of experts, under the same
names (``blocks.1.mlp.fc.weight``: (E, C, 4C) against (C, 4C)). ``upcycled`` rewrites a load
plan so that such a read takes the dense tensor's slab and copies it into each of this rank's
experts, and drops the reads of tensors the dense model has no counterpart of (the routers,
which keep their initialisation).
"""
from __future__ import annotations

import numpy as np

from ..state import LoadPlan, Read


def upcycled(plan: LoadPlan, tensors: dict, fresh) -> tuple[LoadPlan, dict]:
    """(the plan against the checkpoint's ``tensors``, {"experts": reads upcycled, "fresh": keys
    left as initialised}); ``fresh(key)`` says whether a tensor the checkpoint lacks may stay so."""
    reads, counts = [], {"experts": 0, "fresh": []}
    for read in plan.reads:
        table = tensors.get(read.key)
        if table is None and fresh(read.key):
            counts["fresh"].append(read.key)
            continue
        if table is not None and list(read.global_shape[1:]) == table["shape"] and len(read.global_shape) > 1:
            reads.append(Read(read.key, tuple(read.global_shape[1:]), tuple(read.slab[1:]),
                              copied_per_expert(read), read.dtype))
            counts["experts"] += 1
            continue
        reads.append(read)
    return LoadPlan(reads, plan.finish, plan.copies), counts


def copied_per_expert(read: Read):
    """``read``'s assign, given the dense slab: one copy per expert of the read's slab."""
    experts = read.slab[0][1] - read.slab[0][0]

    def assign(values):
        read.assign(np.ascontiguousarray(np.broadcast_to(values, (experts,) + values.shape)))
    return assign
