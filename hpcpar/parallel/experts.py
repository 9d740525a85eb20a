"""Expert parallelism's gradient sync and ZeRO-1/2: experts averaged over edp, the rest over dp.

An MoE block's experts split over the ep group (``ParallelContext.expert_groups``) are
``expert_parallel`` parameters: each rank of the group holds other experts, so DDP and ZeRO over
dp cannot hold them. They get a sync (and a ZeRO-1 or 2) of their own over edp, the dp / ep ranks
that hold the same experts (DeepSpeed's expert-data-parallel group); their gradients arrive
already divided by ep (``nn.moe``), so the mean over edp is the mean over dp of every rank's loss.

    dense, experts = split_experts(model)
    sync = ExpertSplitSync(dense_sync, make_expert_sync(experts, ctx, bucket_mb, overlap, zero=0))

ZeRO-3 shards the two apart as well (``sharded_stores``): the dense parameters of each layer over
dp, each MoE MLP's experts over edp as a unit of their own, gathered around the MoE MLP's call
inside its block's (whose dense unit, the router with it, is gathered around the block's).
"""
from __future__ import annotations

import contextlib
import math

import numpy as np

from ..nn.moe import MoE
from ..state import Checkpointable, LoadPlan, ParameterList, Saved
from ..optim.clip import scale_to_norm
from .data import DistributedDataParallel
from .grad_sync import BucketedAllReduce, GradientSync, LocalGradients, OptimizerReduces
from .zero_grads import BucketedReduceScatter
from .zero_params import ShardedParameters, ShardedParameterSync


def split_experts(holder) -> tuple[ParameterList, ParameterList]:
    """(the dense parameters, the experts) of ``holder``'s named parameters, in its order."""
    named = list(holder.named_parameters())
    return (ParameterList([(n, p) for n, p in named if not p.expert_parallel]),
            ParameterList([(n, p) for n, p in named if p.expert_parallel]))


def sharded_stores(layers, names: dict, ctx, comm, **options) -> tuple[ShardedParameters, ShardedParameters]:
    """ZeRO-3's (dense store over ``comm``, dp's shards, and the experts' store over edp) for
    ``layers``; ``options`` as ``ShardedParameters``'s."""
    _, replicas = ctx.expert_groups(ctx.expert_group().size)
    moes = [module for layer in layers for _, module in layer.named_modules() if isinstance(module, MoE)]
    dense = ShardedParameters(layers, names, comm, **options,
                              params_of=lambda layer: [p for p in layer.parameters() if not p.expert_parallel])
    experts = ShardedParameters(moes, names, replicas, **options,
                                params_of=lambda layer: [p for p in layer.parameters() if p.expert_parallel])
    return dense, experts


def make_expert_sync(experts, ctx, *, bucket_mb: float, overlap: bool, zero: int, master_dtype) -> GradientSync:
    """The experts' sync (``experts``: a ParameterList; ZeRO-3: their store of ``sharded_stores``):
    ZeRO-1 reduces in its optimizer, ZeRO-2 and 3 reduce-scatter buckets over edp into
    ``master_dtype`` (the store's); else DDP over edp (several ranks hold them)."""
    _, replicas = ctx.expert_groups(ctx.expert_group().size)
    if zero == 3:
        return ShardedParameterSync(experts, ctx, bucket_mb=bucket_mb, overlap=overlap)
    if zero == 2:
        return BucketedReduceScatter(experts, ctx, bucket_mb=bucket_mb, overlap=overlap,
                                     dtype=master_dtype or experts.named[0][1].dtype, comm=replicas)
    if zero:
        return OptimizerReduces(experts, ctx)
    if replicas.size > 1:
        return BucketedAllReduce(DistributedDataParallel(experts, ctx, bucket_mb=bucket_mb, overlap=overlap,
                                                         comm=replicas), ctx)
    return LocalGradients(experts, ctx)


class ExpertSplitSync(GradientSync):
    """The dense parameters' sync and the experts' side by side: both wait for the step's end."""

    def __init__(self, dense: GradientSync, experts: GradientSync):
        super().__init__(dense.holder, dense.ctx)
        self.dense, self.experts = dense, experts
        self.ddp = dense.ddp

    @contextlib.contextmanager
    def no_sync(self):
        with self.dense.no_sync(), self.experts.no_sync():
            yield

    def finish(self) -> None:
        self.dense.finish()
        self.experts.finish()

    @property
    def seconds(self) -> float:
        return self.dense.seconds + self.experts.seconds

    def describe(self) -> str:
        return f"{self.dense.describe()}, experts: {self.experts.describe()} over edp"

    def check_layout(self, zero: "ExpertSplitZero") -> None:
        """ZeRO-2: each part's buckets lay out what its optimizer steps."""
        self.dense.check_layout(zero.dense)
        self.experts.check_layout(zero.experts)


class ExpertSplitZero(Checkpointable):
    """ZeRO-1/2/3 of the dense parameters over dp and of the experts over edp, one optimizer to the update."""

    def __init__(self, dense, experts, group):
        self.dense, self.experts, self.group = dense, experts, group  # ZeroRedundancyOptimizers, the ep group
        self.parts = (dense, experts)

    @property
    def lr(self) -> float:
        return self.dense.lr

    @lr.setter
    def lr(self, value: float) -> None:
        for part in self.parts:
            part.lr = value

    def reduce_gradients(self) -> None:
        for part in self.parts:
            part.reduce_gradients()

    def take_shard_gradient(self, sync: ExpertSplitSync, scale: float = 1.0) -> None:
        self.dense.take_shard_gradient(sync.dense, scale)
        self.experts.take_shard_gradient(sync.experts, scale)

    def named_shard_grads(self):
        for part in self.parts:
            yield from part.named_shard_grads()

    def clip_grad_norm(self, max_norm: float, counts=None, model_parallel_sum=None) -> float:
        """As ZeRO-1's: the dense squares summed over dp, the experts' over edp and then ep."""
        experts = self.experts.squares(counts)
        total = self.dense.squares(counts) + float(self.group.allreduce(np.array([experts], dtype=np.float64), "sum")[0])
        if model_parallel_sum is not None:
            total = model_parallel_sum(total)
        norm = math.sqrt(total)
        scale_to_norm([part.shard.grad for part in self.parts], norm, max_norm)
        return norm

    def step(self, reduce: bool = True) -> None:
        for part in self.parts:
            part.step(reduce=reduce)

    def zero_grad(self) -> None:
        for part in self.parts:
            part.zero_grad()

    def state_bytes(self) -> int:
        return sum(part.state_bytes() for part in self.parts)

    def unsharded_state_bytes(self) -> int:
        return sum(part.unsharded_state_bytes() for part in self.parts)

    def named_weight_decays(self) -> dict:
        return {**self.dense.named_weight_decays(), **self.experts.named_weight_decays()}

    def load_weight_decays(self, decays: dict) -> None:
        for part in self.parts:
            part.load_weight_decays(decays)

    def checkpoint_pieces(self) -> tuple[list, dict]:
        pieces, scalars = self.dense.checkpoint_pieces()
        more, extra = self.experts.checkpoint_pieces()
        return pieces + more, {**scalars, **extra}

    def load_plan(self, saved: Saved) -> LoadPlan:
        return self.dense.load_plan(saved).extend(self.experts.load_plan(saved))

    def state_dict(self) -> dict:
        return {"dense": self.dense.state_dict(), "experts": self.experts.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.dense.load_state_dict(state["dense"])
        self.experts.load_state_dict(state["experts"])
