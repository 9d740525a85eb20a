"""Tensor (model) parallelism, Megatron style: communication as differentiable ops.

Four ops move tensors across the tp group; each is an ordinary autograd Function and returns
its input unchanged when the group has one rank:

    copy_to_tp       identity forward, all-reduce (sum) backward   -- entering a parallel region
    reduce_from_tp   all-reduce (sum) forward, identity backward   -- leaving it
    scatter_to_tp    keep this rank's slice of the last axis; all-gather backward
    gather_from_tp   all-gather along the last axis; keep the slice backward

With them the sharded layers are ordinary layers plus one call:

    ColumnParallelLinear   y_r = copy_to_tp(x) @ W[:, cols_r] + b[cols_r]      (output split)
    RowParallelLinear      y   = reduce_from_tp(x_r @ W[rows_r, :]) + b         (input split)
    VocabParallelEmbedding rows of the table split; ids outside this rank's rows give 0, summed
    vocab_parallel_cross_entropy  on logits split along the vocabulary: never the full logits

A transformer block is then column -> row twice (attention with its heads split, MLP with its
hidden units split): two all-reduces forward (after each row-parallel layer) and two backward
(at each copy_to_tp), as in Megatron-LM.

Sequence parallelism (Korthikanti et al., 2022) splits the rest of the block, the norms,
dropout and residual adds, along the sequence: each all-reduce becomes a reduce-scatter
leaving a sharded region and an all-gather entering the next (``gather_sequence``,
``reduce_scatter_sequence``), the same bytes, while those activations take 1/tp of the
memory. Replicated parameters used on slices then need their gradients summed over tp
(``sync_sequence_parallel_grads``).

Sharded parameters carry ``global_shape`` and ``global_start``: initialisation generates the
full tensor from the layout-independent stream and keeps this rank's slice (so every layout
starts from the same model), and checkpoints store them as slabs of the global tensor.
"""
from __future__ import annotations

import numpy as np

from ..autograd import Function, Parameter, Tensor
from ..autograd import ops
from ..autograd import precision
from ..autograd.ops._common import scatter_add_rows
from ..backend import get_array_module
from ..nn import init
from ..nn.layers import new_parameter
from ..nn.module import Module


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


def sharded_parameter(global_shape, axis: int, comm, rule, dtype, xp, what: str) -> Parameter:
    """A parameter holding this rank's block of ``global_shape`` along ``axis``."""
    start, stop = shard_range(global_shape[axis], comm, what)
    shape = list(global_shape)
    shape[axis] = stop - start
    param = new_parameter(tuple(shape), rule, dtype, xp)
    if tp_size(comm) > 1:
        param.global_shape = tuple(global_shape)
        param.global_start = tuple(start if a == axis else 0 for a in range(len(global_shape)))
    return param


# ----------------------------------------------------------------------------------------
# Differentiable communication
# ----------------------------------------------------------------------------------------
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


def gather_sequence(x, comm):
    return x if tp_size(comm) == 1 else _GatherSequence.apply(x, comm=comm)


def reduce_scatter_sequence(x, comm):
    return x if tp_size(comm) == 1 else _ReduceScatterSequence.apply(x, comm=comm)


def sequence_range(length: int, comm) -> tuple[int, int]:
    """[start, stop) of the sequence positions this rank holds when each holds ``length`` of them."""
    return tp_rank(comm) * length, (tp_rank(comm) + 1) * length


def enter_tp(x, comm, sequence_parallel: bool):
    """Into a column-parallel layer: the whole input on every rank (gathered when sequence-parallel)."""
    return gather_sequence(x, comm) if sequence_parallel else copy_to_tp(x, comm)


def leave_tp(x, comm, sequence_parallel: bool):
    """Out of a row-parallel layer: the summed output, whole or as this rank's slice of the sequence."""
    return reduce_scatter_sequence(x, comm) if sequence_parallel else reduce_from_tp(x, comm)


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


def copy_to_tp(x, comm):
    return x if tp_size(comm) == 1 else _CopyToTP.apply(x, comm=comm)


def reduce_from_tp(x, comm):
    return x if tp_size(comm) == 1 else _ReduceFromTP.apply(x, comm=comm)


def scatter_to_tp(x, comm):
    return x if tp_size(comm) == 1 else _ScatterToTP.apply(x, comm=comm)


def gather_from_tp(x, comm):
    return x if tp_size(comm) == 1 else _GatherFromTP.apply(x, comm=comm)


# ----------------------------------------------------------------------------------------
# Sharded layers
# ----------------------------------------------------------------------------------------
class _TensorParallelLayer(Module):
    """A layer that communicates over the tp group ``comm``. With ``sequence_parallel`` (set by the
    model) the activations outside it are slices of the sequence: it gathers its input or
    reduce-scatters its output along the sequence instead of all-reducing."""

    def __init__(self, comm):
        super().__init__()
        object.__setattr__(self, "comm", comm)
        self.sequence_parallel = False


class ColumnParallelLinear(_TensorParallelLayer):
    """``x @ W + b`` with W's columns (and b) split: each rank computes its slice of the output."""

    def __init__(self, in_features: int, out_features: int, comm=None, bias: bool = True, gather_output=False,
                 dtype=np.float32, xp=np):
        super().__init__(comm)
        self.gather_output = gather_output
        rule = init.fan_in_uniform(in_features)
        self.weight = sharded_parameter((in_features, out_features), 1, comm, rule, dtype, xp, "output features")
        self.bias = sharded_parameter((out_features,), 0, comm, rule, dtype, xp, "output features") if bias else None

    def forward(self, x):
        y = ops.linear(enter_tp(x, self.comm, self.sequence_parallel), self.weight, self.bias)
        return gather_from_tp(y, self.comm) if self.gather_output else y


class RowParallelLinear(_TensorParallelLayer):
    """``x @ W + b`` with W's rows split: the input arrives split, partial sums are all-reduced."""

    def __init__(self, in_features: int, out_features: int, comm=None, bias: bool = True, input_is_parallel=True,
                 dtype=np.float32, xp=np):
        super().__init__(comm)
        self.input_is_parallel = input_is_parallel
        rule = init.fan_in_uniform(in_features)
        self.weight = sharded_parameter((in_features, out_features), 0, comm, rule, dtype, xp, "input features")
        self.bias = new_parameter((out_features,), rule, dtype, xp) if bias else None  # replicated

    def forward(self, x):
        if not self.input_is_parallel:
            x = scatter_to_tp(x, self.comm)
        y = leave_tp(ops.linear(x, self.weight), self.comm, self.sequence_parallel)
        return y if self.bias is None else y + self.bias


class _MaskedEmbedding(Function):
    """Rows of ``weight`` for the ids in [start, start + rows); zeros for the others."""

    op = "embedding"

    def forward(self, weight, ids, start):
        xp = get_array_module(weight)
        local = ids - start
        self.outside = (local < 0) | (local >= weight.shape[0])
        self.local = xp.where(self.outside, 0, local)
        self.rows = weight.shape[0]
        out = weight[self.local]
        out[self.outside] = 0
        return out

    def backward(self, grad):
        grad = grad.copy()
        grad[self.outside] = 0
        return scatter_add_rows(self.local.reshape(-1), grad.reshape(-1, grad.shape[-1]),
                                (self.rows, grad.shape[-1]))


class VocabParallelEmbedding(_TensorParallelLayer):
    """An embedding table split by rows (vocabulary) across the tp group."""

    def __init__(self, num_embeddings: int, embedding_dim: int, comm=None, dtype=np.float32, xp=np):
        super().__init__(comm)
        self.num_embeddings = num_embeddings
        self.start, _ = shard_range(num_embeddings, comm, "vocabulary size (pad it to a multiple of tp)")
        self.weight = sharded_parameter((num_embeddings, embedding_dim), 0, comm, init.normal(1.0), dtype, xp,
                                        "vocabulary size (pad it to a multiple of tp)")

    def forward(self, ids):
        ids = ids.data if isinstance(ids, Tensor) else ids
        if tp_size(self.comm) == 1:
            return ops.embedding(self.weight, ids)
        rows = _MaskedEmbedding.apply(self.weight, ids=ids, start=self.start)
        return leave_tp(rows, self.comm, self.sequence_parallel)


class _VocabParallelCrossEntropy(Function):
    """Mean cross entropy of logits split along the vocabulary, with ``ignore_index``.

    Two all-reduces, both forward: the max (for stability) and, stacked into one buffer, the
    sum of exponentials and the target's logit (held by exactly one rank). Backward is local:
    softmax minus the one-hot of the target, on this rank's columns.
    """

    op = "vocab_parallel_cross_entropy"

    def forward(self, logits, targets, comm, ignore_index):
        xp = get_array_module(logits)
        logits = precision.upcast(logits)  # 16 bits: computed and all-reduced in float32
        n, width = logits.shape
        start = comm.rank * width
        peak = comm.allreduce(logits.max(axis=1), "max")
        shifted = logits - peak[:, None]
        local = targets - start
        mine = (local >= 0) & (local < width)
        rows = xp.arange(n)
        picked = xp.where(mine, shifted[rows, xp.where(mine, local, 0)], 0)
        exp = xp.exp(shifted)
        sums = comm.allreduce(xp.stack([exp.sum(axis=1), picked]), "sum")
        valid = targets != ignore_index
        self.count = max(int(valid.sum()), 1)
        self.softmax = exp / sums[0][:, None]
        self.mine, self.local, self.valid = mine & valid, local, valid
        losses = (xp.log(sums[0]) - sums[1]) * valid
        return xp.asarray(losses.sum() / self.count, dtype=logits.dtype)

    def backward(self, grad):
        xp = get_array_module(grad)
        dlogits = self.softmax
        rows = xp.nonzero(self.mine)[0]
        dlogits[rows, self.local[rows]] -= 1
        dlogits *= (self.valid[:, None] * (grad.astype(dlogits.dtype) / self.count)).astype(dlogits.dtype)
        return dlogits


def vocab_parallel_cross_entropy(logits, targets, comm, ignore_index: int = -100):
    """Mean cross entropy of (N, V/tp) logits split by vocabulary against (N,) targets."""
    targets = targets.data if isinstance(targets, Tensor) else targets
    if tp_size(comm) == 1:
        return ops.cross_entropy(logits, targets, ignore_index=ignore_index)
    return _VocabParallelCrossEntropy.apply(logits, comm=comm, targets=targets, ignore_index=ignore_index)


def counts_toward_norm(param, ctx, owns=None) -> bool:
    """Whether this rank counts ``param`` in a global norm, so that each element counts once.

    A tp-sharded parameter by every tp rank (each has its own slice), a tp-replicated one
    (LayerNorm, row-parallel bias) by tp rank 0 only, a weight tied across pipeline stages by
    its lowest holder (``owns(param)``).
    """
    sharded = hasattr(param, "global_shape") and tuple(param.global_shape) != param.shape
    return (sharded or ctx.tp_rank == 0) and (owns is None or owns(param))


def sum_over_model_parallel(ctx):
    """``local sum -> sum over the tp and pp groups``: completes a sum of squares over the model's pieces."""
    def total(local: float) -> float:
        value = ctx.tp.allreduce(np.array([local], dtype=np.float64), "sum")
        return float(ctx.pp.allreduce(value, "sum")[0])
    return total


def clip_grad_norm_parallel(named_parameters, max_norm: float, ctx, owns=None) -> float:
    """Clip by the global norm over the whole model however it is split.

    Each element is counted once (``counts_toward_norm``); the sum of squares is then completed
    over tp and pp; dp replicas hold the same averaged gradients and are not summed.
    """
    from ..optim.clip import clip_grad_norm, scale_to_norm

    counted = [p for _, p in named_parameters if counts_toward_norm(p, ctx, owns)]
    norm = clip_grad_norm(counted, float("inf"), allreduce_sum=sum_over_model_parallel(ctx))  # the norm only
    scale_to_norm([p.grad for _, p in named_parameters if p.grad is not None], norm, max_norm)
    return norm
