"""Sequence parallelism's gradient sync: replicated parameters used on slices of the sequence."""
from __future__ import annotations

from ..backend import get_array_module
from ..autograd.ops.mappings import tp_size


def sync_sequence_parallel_grads(named_parameters, comm) -> None:
    """Sum over tp the gradients of replicated parameters used on sequence slices (one all-reduce).

    With sequence parallelism LayerNorms, row-parallel biases and the position embedding see
    only this rank's part of the sequence, so their gradients are partial sums; engines call
    this after backward (as Megatron-LM all-reduces its layernorm gradients before the step).
    """
    params = [p for _, p in named_parameters if getattr(p, "sequence_parallel", False) and p.grad is not None]
    if tp_size(comm) == 1 or not params:
        return
    xp = get_array_module(params[0].grad)
    flat = comm.allreduce(xp.concatenate([p.grad.reshape(-1) for p in params]), "sum")
    offset = 0
    for p in params:
        p.grad[...] = flat[offset: offset + p.grad.size].reshape(p.grad.shape)
        offset += p.grad.size
