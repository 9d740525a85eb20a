"""Communication as differentiable ops (Megatron-LM's ``mappings.py``): tensor and sequence parallelism.

Each op takes the tensor-parallel communicator as an argument and returns its input unchanged
when the group has one rank (or is None):

    copy_to_tp       identity forward, all-reduce (sum) backward   -- entering a parallel region
    reduce_from_tp   all-reduce (sum) forward, identity backward   -- leaving it
    scatter_to_tp    keep this rank's slice of the last axis; all-gather backward
    gather_from_tp   all-gather along the last axis; keep the slice backward

Sequence parallelism (Korthikanti et al., 2022) splits the activations outside the sharded regions
along the sequence: ``gather_sequence`` entering a region and ``reduce_scatter_sequence`` leaving
it replace the all-reduces, the same bytes, while those activations take 1/tp of the memory.
``enter_tp``/``leave_tp`` pick the pair a layer needs (the sharded layers: ``nn.tensor_parallel``);
``sequence_to_replicated``/``replicated_to_sequence`` bracket a region every rank computes alike (MoE).
"""
from __future__ import annotations

from ...backend import get_array_module
from ..function import Function


def tp_size(comm) -> int:
    return 1 if comm is None else comm.size


def tp_rank(comm) -> int:
    return 0 if comm is None else comm.rank


def shard_range(total: int, comm, what: str) -> tuple[int, int]:
    """[start, stop) of this rank's equal share of ``total``; a clear error when it does not divide."""
    size = tp_size(comm)
    if total % size:
        raise ValueError(f"{what} ({total}) is not divisible by the tensor-parallel size {size}")
    share = total // size
    return tp_rank(comm) * share, (tp_rank(comm) + 1) * share


class _CopyToTP(Function):
    op = "tp_communication"

    def forward(self, x, comm):
        self.comm = comm
        return x

    def backward(self, grad):
        return self.comm.allreduce(grad, "sum")


class _ReduceFromTP(Function):
    op = "tp_communication"

    def forward(self, x, comm):
        return comm.allreduce(x, "sum")

    def backward(self, grad):
        return grad


class _ScatterToTP(Function):
    op = "tp_communication"

    def forward(self, x, comm):
        self.comm = comm
        start, stop = shard_range(x.shape[-1], comm, "last dimension")
        return x[..., start:stop].copy()

    def backward(self, grad):
        return _gather_last(grad, self.comm)


class _GatherFromTP(Function):
    op = "tp_communication"

    def forward(self, x, comm):
        self.comm = comm
        self.width = x.shape[-1]
        return _gather_last(x, comm)

    def backward(self, grad):
        r = self.comm.rank
        return grad[..., r * self.width:(r + 1) * self.width].copy()


def _gather_last(x, comm):
    xp = get_array_module(x)
    stacked = comm.allgather(x)  # (tp, ..., w)
    return xp.concatenate(list(stacked), axis=-1)


# Sequence parallelism: outside the sharded regions (norms, dropout, residual adds) each tp
# rank holds a slice of the sequence, (B, T/tp, C), instead of the whole replicated activation.
# Each all-reduce becomes a reduce-scatter leaving a sharded region and an all-gather entering
# the next: the same bytes, while those activations take 1/tp of the memory.
def _sequence_first(x):
    """(B, T, ...) -> (T, B, ...) contiguous: MPI's reduce-scatter and all-gather split the first axis."""
    return get_array_module(x).ascontiguousarray(x.swapaxes(0, 1))


def _gather_sequence(x, comm):
    """(B, T/tp, ...) on each rank -> (B, T, ...): the slices in rank order along the sequence."""
    stacked = comm.allgather(_sequence_first(x))  # (tp, T/tp, B, ...)
    whole = stacked.reshape((-1,) + stacked.shape[2:])  # (T, B, ...)
    return get_array_module(x).ascontiguousarray(whole.swapaxes(0, 1))


def _reduce_scatter_sequence(x, comm):
    """(B, T, ...) partial sums on each rank -> this rank's (B, T/tp, ...) slice of their total."""
    if x.shape[1] % comm.size:
        raise ValueError(f"sequence parallelism splits the sequence over the {comm.size} tp ranks: a sequence "
                         f"of {x.shape[1]} tokens does not divide (use a length that is a multiple of tp)")
    part = comm.reduce_scatter(_sequence_first(x), "sum")  # (T/tp, B, ...)
    return get_array_module(x).ascontiguousarray(part.swapaxes(0, 1))


class _GatherSequence(Function):
    """Entering a sharded region: all-gather the sequence forward, reduce-scatter backward."""

    op = "tp_communication"

    def forward(self, x, comm):
        self.comm = comm
        return _gather_sequence(x, comm)

    def backward(self, grad):
        return _reduce_scatter_sequence(grad, self.comm)


class _ReduceScatterSequence(Function):
    """Leaving a sharded region: reduce-scatter the sequence forward, all-gather backward."""

    op = "tp_communication"

    def forward(self, x, comm):
        self.comm = comm
        return _reduce_scatter_sequence(x, comm)

    def backward(self, grad):
        return _gather_sequence(grad, self.comm)


class _SequenceToReplicated(Function):
    """Into a region every tp rank computes alike (an MoE router's decisions): all-gather the
    sequence forward; backward keeps this rank's slice, since each rank's gradient is already whole."""

    op = "tp_communication"

    def forward(self, x, comm):
        self.comm, self.length = comm, x.shape[1]
        return _gather_sequence(x, comm)

    def backward(self, grad):
        r = self.comm.rank
        return get_array_module(grad).ascontiguousarray(grad[:, r * self.length:(r + 1) * self.length])


class _ReplicatedToSequence(Function):
    """Out of such a region: this rank's slice of the sequence forward; all-gather backward."""

    op = "tp_communication"

    def forward(self, x, comm):
        self.comm = comm
        start, stop = shard_range(x.shape[1], comm, "sequence")
        return get_array_module(x).ascontiguousarray(x[:, start:stop])

    def backward(self, grad):
        return _gather_sequence(grad, self.comm)


def sequence_to_replicated(x, comm):
    return x if tp_size(comm) == 1 else _SequenceToReplicated.apply(x, comm=comm)


def replicated_to_sequence(x, comm):
    return x if tp_size(comm) == 1 else _ReplicatedToSequence.apply(x, comm=comm)


def gather_sequence(x, comm):
    return x if tp_size(comm) == 1 else _GatherSequence.apply(x, comm=comm)


def reduce_scatter_sequence(x, comm):
    return x if tp_size(comm) == 1 else _ReduceScatterSequence.apply(x, comm=comm)


def enter_tp(x, comm, sequence_parallel: bool):
    """Into a column-parallel layer: the whole input on every rank (gathered when sequence-parallel)."""
    return gather_sequence(x, comm) if sequence_parallel else copy_to_tp(x, comm)


def leave_tp(x, comm, sequence_parallel: bool):
    """Out of a row-parallel layer: the summed output, whole or as this rank's slice of the sequence."""
    return reduce_scatter_sequence(x, comm) if sequence_parallel else reduce_from_tp(x, comm)


def copy_to_tp(x, comm):
    return x if tp_size(comm) == 1 else _CopyToTP.apply(x, comm=comm)


def reduce_from_tp(x, comm):
    return x if tp_size(comm) == 1 else _ReduceFromTP.apply(x, comm=comm)


def scatter_to_tp(x, comm):
    return x if tp_size(comm) == 1 else _ScatterToTP.apply(x, comm=comm)


def gather_from_tp(x, comm):
    return x if tp_size(comm) == 1 else _GatherFromTP.apply(x, comm=comm)
