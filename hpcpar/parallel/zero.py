"""ZeRO stages 1 to 3: optimizer state (and, with stage 2, gradients; 3, parameters) sharded across dp.

    opt = ZeroRedundancyOptimizer(model.named_parameters(), ctx.dp, AdamW, lr=3e-4)
    loss.backward()          # no DDP wrapper: the gradient reduction happens in step()
    opt.step()               # ZeRO-2: opt.shard.grad = sync.take_shard_gradient(); opt.step(reduce=False)

The parameters become views into one flat buffer (``flat_layout``); each dp rank keeps the
optimizer state of its contiguous 1/dp shard only. A step reduce-scatters the flat gradient
(ZeRO-2's sync, ``parallel.zero_grads``, already did, and the flat gradient is never made),
steps the shard and all-gathers the shards back in place (ZeRO-3 keeps no flat buffer:
``zero_params`` gathers each unit from the shard before it runs). Weight decay stays per
parameter, as ``DecayRuns`` along the shard. A checkpoint holds the shard's state as slabs of
the per-parameter tensors ``optim/<name>/<key>`` (``hpcpar.state``): it loads into any layout.
"""
from __future__ import annotations

import itertools
import math

import numpy as np

from ..autograd import Parameter, precision
from ..backend import get_array_module, to_host
from ..runtime.shm import shared_zeros
from .hybrid import average_over
from ..optim.clip import scale_to_norm
from ..optim.groups import flat_range_decays, flatten_groups, set_flat_range_decay
from ..optim.optimizer import named_parameter_list
from ..state import (Checkpointable, LoadPlan, Saved, flat_state_load_plan, flat_state_pieces, range_param_slabs,
                     weight_decay_scalars)


def flat_layout(sizes, ranks: int) -> tuple[list[int], int]:
    """(where each of ``sizes`` starts when laid end to end, the elements of each of ``ranks``
    contiguous shards): rank r owns [r * shard, (r + 1) * shard), the last one padded."""
    offsets = [0, *itertools.accumulate(sizes)][:len(sizes)]
    return offsets, math.ceil(sum(sizes) / ranks)


def range_pieces(begin: int, end: int, shard: int, ranks: int) -> list[int]:
    """The elements of the layout's range [begin, end) inside each of ``ranks`` shards of
    ``shard`` elements: the uneven counts in which a bucket is reduce-scattered (ZeRO-2) and a
    unit all-gathered (ZeRO-3)."""
    return [max(0, min(end, (r + 1) * shard) - max(begin, r * shard)) for r in range(ranks)]


class ZeroRedundancyOptimizer(Checkpointable):
    def __init__(self, params, comm, optimizer_class, broadcast_parameters: bool = True, no_decay=(),
                 parameters=None, replicas=None, **optimizer_options):
        """``parameters``: ZeRO-3's ``zero_params.ShardedParameters`` over the same (name, parameter)
        pairs; its shard is then the parameters' only copy, stepped in place and never all-gathered
        here (each unit gathers itself before it runs). ``replicas``: hybrid sharding's
        communicator across the groups ``comm`` shards within (``parallel.hybrid``)."""
        items, given = flatten_groups(params)
        named = named_parameter_list(items)
        self.names = [name for name, _ in named]
        self.params = [p for _, p in named]
        dtypes = {p.dtype for p in self.params}
        if len(dtypes) > 1:
            raise ValueError(f"ZeroRedundancyOptimizer needs one parameter dtype, got {sorted(map(str, dtypes))}")
        self.comm, self.replicas = comm, replicas
        self.offsets, self.shard_size = flat_layout([p.size for p in self.params], comm.size)
        self.numel = sum(p.size for p in self.params)
        if parameters is not None:
            self.flat, self.shard = None, parameters.shard
        else:
            self.flat = self._flat_parameters(broadcast_parameters)
            start = comm.rank * self.shard_size
            self.shard = Parameter(self.flat[start: start + self.shard_size].copy(), name=f"zero_shard_{comm.rank}")
        self.optimizer = optimizer_class([("shard", self.shard)], **optimizer_options)
        # Weight decay by parameter name (groups, no_decay), as runs along this rank's shard.
        self.weight_decays = flat_range_decays(self.names, self.optimizer, given, no_decay)
        self._set_shard_decay()
        self._flat_grad = None  # made by the first reduce_gradients (never under ZeRO-2)

    def _flat_parameters(self, broadcast: bool):
        """The parameters as views into one flat buffer (rank 0's values when ``broadcast``)."""
        # A pipeline stage may hold no parameters (a CNN's activation and pooling layers): its
        # buffers are then empty, and every collective still runs, on nothing, with its dp group.
        dtype = self.params[0].dtype if self.params else np.dtype(np.float32)
        xp = get_array_module(self.params[0].data) if self.params else np
        # Both flat buffers in the node's shared window when the shared-memory path is on
        # (hpcpar.runtime.shm): reduce-scatter and all-gather then read and write them in place.
        flat = shared_zeros(self.comm, self.shard_size * self.comm.size, dtype, xp)
        for p, offset in zip(self.params, self.offsets):
            view = flat[offset: offset + p.size].reshape(p.shape)
            view[...] = p.data
            p.data = view
        if broadcast and self.comm.size > 1:
            self.comm.broadcast(flat, root=0)
        return flat

    # The wrapped optimizer's hyperparameters (lr for schedules) read and write through.
    @property
    def lr(self) -> float:
        return self.optimizer.lr

    @lr.setter
    def lr(self, value: float) -> None:
        self.optimizer.lr = value

    def _set_shard_decay(self) -> None:
        begin = self.comm.rank * self.shard_size
        set_flat_range_decay(self.optimizer, self.names, [p.size for p in self.params], self.weight_decays,
                             begin, begin + self.shard_size)

    def named_weight_decays(self) -> dict:
        """{parameter name: weight decay} of every parameter (not only this rank's shard)."""
        return dict(self.weight_decays)

    def load_weight_decays(self, decays: dict) -> None:
        """Set the weight decay of the named parameters (a checkpoint's groups); the shard's runs follow."""
        self.weight_decays.update({name: float(v) for name, v in decays.items() if name in self.weight_decays})
        self._set_shard_decay()

    def reduce_gradients(self):
        """Reduce-scatter the flat gradient; the shard's ``grad`` holds the dp mean of this rank's part."""
        if self._flat_grad is None:
            self._flat_grad = shared_zeros(self.comm, self.flat.size, self.flat.dtype, get_array_module(self.flat))
        for p, offset in zip(self.params, self.offsets):
            target = self._flat_grad[offset: offset + p.size]
            if p.grad is None:
                target[...] = 0  # an unused parameter contributes zeros, so no rank waits
            else:
                target[...] = p.grad.reshape(-1)
        self.shard.grad = self.comm.reduce_scatter(self._flat_grad, "mean")
        average_over(self.replicas, self.shard.grad)
        return self.shard.grad

    def take_shard_gradient(self, sync, scale: float = 1.0) -> None:
        """ZeRO-2: the shard gradient ``sync`` reduced during backward, unscaled by the loss ``scale``."""
        grad = sync.take_shard_gradient()
        if scale != 1.0:
            grad *= 1.0 / scale
        self.shard.grad = grad

    def named_shard_grads(self):
        """(name, the part of the shard's gradient that is that parameter's) for each parameter the
        shard overlaps: what a finiteness check reads when the shard is the only gradient."""
        start, grad = self.comm.rank * self.shard_size, self.shard.grad
        for name, p, offset in zip(self.names, self.params, self.offsets):
            lo, hi = max(offset, start), min(offset + p.size, start + self.shard_size)
            if lo < hi and grad is not None:
                yield name, grad[lo - start: hi - start]

    def clip_grad_norm(self, max_norm: float, counts=None, model_parallel_sum=None) -> float:
        """Clip the reduced shard by the global norm; returns the norm.

        The sum of squares is completed over dp (each rank holds one shard), then, when the
        model itself is split, over its other pieces by ``model_parallel_sum`` (tp and pp:
        ``parallel.grad_norm.sum_over_model_parallel``). ``counts(param)`` says whether this rank
        counts a parameter's elements, so that a tp-replicated or tied weight counts once
        (``parallel.grad_norm.counts_toward_norm``).
        """
        total = self.squares(counts)
        if model_parallel_sum is not None:
            total = model_parallel_sum(total)
        norm = math.sqrt(total)
        scale_to_norm([self.shard.grad], norm, max_norm)
        return norm

    def squares(self, counts=None) -> float:
        """The sum of squares of the reduced gradient over every shard (``counts`` as for
        ``clip_grad_norm``): a sum over ``comm`` (collective)."""
        local = self._counted_squares(counts or (lambda param: True))
        return float(self.comm.allreduce(np.array([local], dtype=np.float64), "sum")[0])

    def _counted_squares(self, counts) -> float:
        """Sum of squares of the shard's gradient over the parameters ``counts`` accepts."""
        start, grad = self.comm.rank * self.shard_size, self.shard.grad
        xp = get_array_module(grad)
        pieces = []
        for p, offset in zip(self.params, self.offsets):
            lo, hi = max(offset, start), min(offset + p.size, start + self.shard_size)
            if lo < hi and counts(p):
                piece = grad[lo - start: hi - start].astype(precision.accumulation_dtype(grad.dtype), copy=False)
                pieces.append(xp.dot(piece, piece))
        return float(to_host(sum(pieces))) if pieces else 0.0  # one device-to-host transfer

    def step(self, reduce: bool = True) -> None:
        if reduce:
            self.reduce_gradients()
        self.optimizer.step()
        if self.flat is not None:
            self.comm.allgather(self.shard.data, out=self.flat)  # every rank's shard into its place
        # Every rank now has the same parameters; the gradients are spent.
        for p in self.params:
            p.grad = None
        self.shard.grad = None

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None
        self.shard.grad = None

    def state_bytes(self) -> int:
        """Bytes of optimizer state on this rank."""
        return sum(v.nbytes for v in self.optimizer.state["shard"].values() if hasattr(v, "nbytes"))

    def unsharded_state_bytes(self) -> int:
        """What the same optimizer would hold on every rank without ZeRO."""
        per_element = self.state_bytes() / self.shard_size if self.shard_size else 0
        return int(per_element * self.numel)

    # ----- the checkpoint protocol (hpcpar.state) -------------------------------------
    def param_slabs(self) -> list:
        """This rank's shard of the flat parameters as slabs of the global tensors (``range_param_slabs``)."""
        begin = self.comm.rank * self.shard_size
        return list(range_param_slabs(self.names, self.params, self.offsets, begin, begin + self.shard_size))

    def checkpoint_pieces(self) -> tuple[list, dict]:
        pieces, scalars = flat_state_pieces(self.param_slabs(), self.optimizer.state["shard"])
        return pieces, scalars | weight_decay_scalars(self.weight_decays)  # every parameter's, on every rank

    def load_plan(self, saved: Saved) -> LoadPlan:
        """The shard's state from the per-parameter tensors and the saved weight decays; then the shard
        is copied from this rank's part of the flat parameters (loaded by the model's own plan; ZeRO-3:
        the shard is what the model's plan filled)."""
        plan = flat_state_load_plan(saved, self.param_slabs(), self.shard,
                                    lambda state: self.optimizer.state.__setitem__("shard", state),
                                    current=self.optimizer.state.get("shard"))
        decays = saved.weight_decays()
        plan.finish.append(lambda: self.load_weight_decays(decays))
        if self.flat is not None:
            start = self.comm.rank * self.shard_size
            plan.copies.append((self.shard.data, self.flat[start: start + self.shard_size]))
        return plan

    def state_dict(self) -> dict:
        return {"shard_range": [self.comm.rank * self.shard_size, (self.comm.rank + 1) * self.shard_size],
                "numel": self.numel, "optimizer": self.optimizer.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
