"""Tensor-parallel layers, Megatron style: ordinary layers plus one differentiable communication op.

    ColumnParallelLinear   y_r = copy_to_tp(x) @ W[:, cols_r] + b[cols_r]      (output split)
    RowParallelLinear      y   = reduce_from_tp(x_r @ W[rows_r, :]) + b         (input split)
    VocabParallelEmbedding rows of the table split; ids outside this rank's rows give 0, summed
    vocab_parallel_cross_entropy  on logits split along the vocabulary: never the full logits

A transformer block is then column -> row twice (attention with its heads split, MLP with its
hidden units split): two all-reduces forward (after each row-parallel layer) and two backward
(at each copy_to_tp), as in Megatron-LM; with sequence parallelism (``sequence_parallel``, set
by the model) the layers gather their input or reduce-scatter their output along the sequence
instead (``hpcpar.autograd.ops.mappings``). Sharded parameters carry ``global_shape`` and
``global_start``: initialisation generates the full tensor from the layout-independent stream and
keeps this rank's slice (every layout starts from the same model); checkpoints store slabs of it.
"""
from __future__ import annotations

import numpy as np

from ..autograd import Function, Parameter, Tensor
from ..autograd import ops, precision
from ..autograd.ops._common import check_host_range, integer_array, scatter_add_rows
from ..autograd.ops.mappings import (enter_tp, gather_from_tp, leave_tp, scatter_to_tp, shard_range, tp_size)
from ..backend import get_array_module
from . import init
from .layers import new_parameter
from .module import Module


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
        check_host_range(ids, self.num_embeddings, "embedding", "id", "rows")
        ids = integer_array(ids, self.weight.data, "embedding", "ids")  # to the device, like ops.embedding
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
        self.count = xp.maximum(xp.count_nonzero(valid), 1)  # on the device, like ops.cross_entropy
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
    check_host_range(targets, logits.shape[-1] * tp_size(comm), "cross_entropy", "target", "classes", ignore_index)
    targets = integer_array(targets, getattr(logits, "data", logits), "cross_entropy", "targets")
    return _VocabParallelCrossEntropy.apply(logits, comm=comm, targets=targets, ignore_index=ignore_index)
