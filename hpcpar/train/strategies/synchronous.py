"""What the synchronous strategies share: a step is engine x gradient sync x update.

Subclasses (``AllReduce``, ``Pipeline``) build the engine that runs forward and backward; the
gradient sync (``parallel.grad_sync``: none, DDP, ZeRO-1, 2, 3), mixed precision and the update
are built here, the same for both, in the order the engine needs them: gradient sync,
precision, engine, update. The update is sharded (``parallel.zero`` 1 to 3: state sharded over
dp, gradients reduce-scattered in the step or during backward) or a plain one on dp-averaged
gradients, stepping float32 masters under fp16/bf16.
"""
from __future__ import annotations

import time

from ...optim.finite import StepHealth
from ...nn.moe import auxiliary_loss_scale
from ...parallel.compression_state import CompressionState
from ...parallel.experts import ExpertSplitSync, ExpertSplitZero, make_expert_sync, sharded_stores, split_experts
from ...parallel.grad_sync import make_gradient_sync
from ...parallel.hybrid import default_shard_size, dp_ranks_per_node, shard_groups
from ...parallel.zero import ZeroRedundancyOptimizer
from ...parallel.zero_params import ShardedParameters, reshards
from ...state import ParameterList, Together
from .base import Strategy
from .ingredients import make_gradient_compressor, optimizer_class, state_bytes
from .update import ReplicatedUpdate, ShardedUpdate


class SynchronousStrategy(Strategy):
    sharded_parameters = None  # ZeRO-3's parameter store (parallel.zero_params)
    expert_parameters = None  # and, under expert parallelism, the experts' store (parallel.experts)

    def build_gradient_sync(self, holder, precision, overlap: bool, alone=(), layers=()) -> None:
        """The gradient sync of ``holder``'s parameters, by the rule of ``parallel.grad_sync``
        (ZeRO-2 and 3 reduce into ``precision``'s master dtype); ZeRO-3 first shards the
        parameters of ``layers`` (its units) into the store."""
        p = self.job.parallel
        self.shards, self.replicas = self.ctx.dp_cp, None
        if p.zero and self.ctx.expert_group() is None:  # hybrid sharding: ZeRO within groups of shard_size dp x cp ranks (parallel.hybrid)
            size = p.shard_size or default_shard_size(self.ctx.dp_cp.size, dp_ranks_per_node(self.ctx))
            self.shards, self.replicas = shard_groups(self.ctx, size)
        experts = None
        if p.zero == 3:
            names = {id(param): name for name, param in holder.named_parameters()}
            options = dict(reshard_after_forward=reshards(p.reshard_after_forward, self.ctx.pp_size),
                           master_dtype=precision.master_dtype)
            if self.ctx.expert_group() is not None:
                holder, experts = sharded_stores(layers, names, self.ctx, comm=self.shards, **options)
                self.expert_parameters = experts
            else:
                holder = ShardedParameters(layers, names, self.shards, **options)
            self.sharded_parameters = holder
        elif self.ctx.expert_group() is not None:  # experts split over ep: a sync of their own (parallel.experts)
            holder, experts = split_experts(holder)
        self.grad_sync = make_gradient_sync(holder, self.ctx, sharded=p.zero, compression=make_gradient_compressor(p),
                                            bucket_mb=p.bucket_mb, overlap=overlap, alone=alone,
                                            master_dtype=precision.master_dtype, shards=self.shards,
                                            replicas=self.replicas)
        if experts is not None:
            self.grad_sync = ExpertSplitSync(self.grad_sync, make_expert_sync(experts, self.ctx, bucket_mb=p.bucket_mb,
                                                                              overlap=overlap, zero=p.zero,
                                                                              master_dtype=precision.master_dtype))

    def auxiliary_losses(self):
        """Around a step's forwards and backwards: MoE blocks seed their auxiliary losses as the
        engines seed each micro-batch's loss (1/micro-batches, times the loss scale)."""
        return auxiliary_loss_scale(self.precision.scale / self.job.parallel.micro_batches)

    def derived_communicators(self) -> list:
        return [c for c in (self.shards, self.replicas) if c is not None and c is not self.ctx.dp_cp]

    def sharding(self) -> str:
        """How context parallelism and hybrid sharding split the ranks, for ``describe`` (empty without them)."""
        text = ""
        if self.ctx.cp_size > 1:
            text += (f", context parallel: each sequence over {self.ctx.cp_size} ranks (zigzag chunks, ring attention), "
                     f"gradients averaged over dp x cp = {self.ctx.dp_cp.size}")
        group = self.ctx.expert_group()
        if group is not None:
            experts = self.job.moe.experts
            text += (f", expert parallel: {experts} experts per MoE block over ep = {group.size} ranks "
                     f"({experts // group.size} each), their gradients averaged over the {self.ctx.dp_size // group.size} "
                     f"dp ranks that hold the same ones")
        if self.replicas is not None:
            text += f", hybrid: shards over {self.shards.size} dp ranks, averaged over {self.replicas.size} groups"
        return text

    def build_precision(self, precision, named) -> None:
        """The master weights of ``precision`` (an ``optim.Precision``) for this rank's parameters ``named``:
        float32 masters under fp16/bf16, else those parameters themselves (ZeRO-3: none, its shard is the masters)."""
        self.precision = precision.masters([] if self.sharded_parameters is not None else named)

    def build_update(self, owns_for_norm) -> None:
        """Optimizer and update over the precision's masters."""
        stores = [s for s in (self.sharded_parameters, self.expert_parameters) if s is not None]
        masters = ([named for store in stores for named in store.named_parameters()] if stores
                   else self.precision.named_master_parameters())
        cls, options = optimizer_class(self.job)
        if self.job.parallel.zero:
            self._optimizer = self._zero(masters, cls, options)
            reduced_in_backward = self.grad_sync if self.job.parallel.zero >= 2 else None
            if reduced_in_backward is not None:
                reduced_in_backward.check_layout(self._optimizer)
            self.update = ShardedUpdate(self._optimizer, self.precision, self.ctx, owns_for_norm, reduced_in_backward)
        else:
            self._optimizer = cls(masters, **options)
            self.update = ReplicatedUpdate(self._optimizer, self.precision, self.ctx, owns_for_norm)

    def _zero(self, masters, cls, options):
        """ZeRO over the shards; under expert parallelism its experts' part over their edp group."""
        group = self.ctx.expert_group()
        if group is None:
            return ZeroRedundancyOptimizer(masters, self.shards, cls, parameters=self.sharded_parameters,
                                           replicas=self.replicas, **options)
        dense, experts = split_experts(ParameterList(masters))
        return ExpertSplitZero(ZeroRedundancyOptimizer(dense.named, self.shards, cls, parameters=self.sharded_parameters,
                                                       **options),
                               ZeroRedundancyOptimizer(experts.named, self.ctx.expert_groups(group.size)[1], cls,
                                                       parameters=self.expert_parameters, **options), group)

    @property
    def optimizer(self):
        return self._optimizer

    def finish_step(self, max_norm: float, loss: float) -> StepHealth:
        comm_before = self.ctx.comm_seconds()
        start = time.perf_counter()
        norm = self.update.clip(max_norm) if max_norm > 0 else None
        health = self.update.step(loss, norm)
        self._optimizer.zero_grad()
        for _, param in self.named_parameters():  # the model's own grads (distinct from masters under amp)
            param.grad = None
        comm = self.ctx.comm_seconds() - comm_before
        self.stats["comm_s"] = self.stats.get("comm_s", 0.0) + comm
        self.stats["compute_s"] = self.stats.get("compute_s", 0.0) + time.perf_counter() - start - comm
        self.stats.update(self.precision.metrics())
        return health

    def parameter_bytes(self) -> int:
        """ZeRO-3: its shards (the parameters are placeholders between steps)."""
        if self.sharded_parameters is not None:
            return sum(s.shard.data.nbytes for s in (self.sharded_parameters, self.expert_parameters) if s is not None)
        return super().parameter_bytes()

    def optimizer_state_bytes(self) -> int:
        optimizer = self._optimizer.state_bytes() if self.job.parallel.zero else state_bytes(self._optimizer)
        return optimizer + self.precision.master_bytes()

    def weight_decays(self) -> dict:
        return self._optimizer.named_weight_decays()

    def data_parallel(self):
        """The DDP that reduces gradients over dp, with its buckets and compressor (None: ZeRO-1,
        or one replica without compression)."""
        return self.grad_sync.ddp

    def checkpoint_target(self) -> tuple:
        """The float32 masters, the optimizer and, when the compressor carries error feedback
        from step to step, that too unless ``checkpoint.compression_state`` is off
        (``parallel.compression_state``): the resume is then exact."""
        optimizer, ddp = self._optimizer, self.data_parallel()
        if ddp is not None and ddp.compression.carries_state:
            optimizer = Together(optimizer, CompressionState(ddp.compression, self.ctx, ddp.buckets,
                                                             saved=self.job.checkpoint.compression_state))
        weights = self.sharded_parameters or self.precision.named_master_parameters()  # ZeRO-3: from its shard
        if self.expert_parameters is not None:
            weights = Together(weights, self.expert_parameters)
        return weights, optimizer, self.ctx

    def checkpoint_extra(self) -> dict:
        return {} if self.precision.scaler is None else {"scaler": self.precision.scaler}

    def after_load(self) -> None:
        self.precision.copy_to_model()
