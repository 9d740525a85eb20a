"""Bytes per step on each communicator, exactly as ``CommStats`` counts them.

For a job and a layout, every call one training step makes (``train_step`` and ``finish_step``,
what ``hpcpar compare`` times), summed over the ranks of the world: per communicator (``dp``,
or ``dp*cp`` under context parallelism, ``cp``: ring attention's sends and receives, ``pp``,
``tp``, ``world``, ``pp-tied``: the pair of pipeline ranks holding the tied embedding, and
under expert parallelism ``ep``, its all-to-alls, and ``edp``, the experts' gradients) and
operation, the calls, the bytes the calls were given and the wire bytes (``wire_bytes``,
integer per call as the counters round). ``tests/test_plan_traffic.py`` checks them against the
counters of real runs (the all-to-alls' rows assume uniform routing).
"""
from __future__ import annotations

import functools
from collections import defaultdict
from dataclasses import dataclass, field, replace
from types import SimpleNamespace

import numpy as np

from ..runtime.stats import ring_wire_bytes
from ..parallel.data import plan_buckets
from .model import Layer

SCALAR = 8  # one float64: losses, norms, overflow flags


@dataclass
class Traffic:
    """(communicator, op) -> [calls, bytes given, wire bytes], summed over the world's ranks."""

    counts: dict = field(default_factory=lambda: defaultdict(lambda: [0, 0, 0]))
    sizes: dict = field(default_factory=dict)  # communicator -> ranks in one of its groups

    def add(self, comm: str, op: str, nbytes: float, ranks: int = 1, calls: int = 1) -> None:
        """``calls`` calls of ``op`` given ``nbytes`` each, on each of ``ranks`` world ranks."""
        nbytes = int(round(nbytes))
        entry = self.counts[(comm, op)]
        entry[0] += calls * ranks
        entry[1] += calls * ranks * nbytes
        entry[2] += calls * ranks * wire_bytes(op, nbytes, self.sizes.get(comm, 1))

    def wire(self, comm: str | None = None) -> int:
        return sum(c[2] for (name, _), c in self.counts.items() if comm in (None, name))

    def by_comm(self) -> dict:
        """communicator -> {op: (calls, bytes, wire)}."""
        out: dict = {}
        for (comm, op), (calls, nbytes, wire) in sorted(self.counts.items()):
            out.setdefault(comm, {})[op] = (calls, nbytes, wire)
        return out


def wire_bytes(op: str, nbytes: int, size: int) -> int:
    """Bytes one rank sends for ``op`` given ``nbytes`` on ``size`` ranks: ``runtime.stats.ring_wire_bytes``;
    an all-to-all's are what leave the rank, (n-1)/n of them (exact for the counts'; the rows' under
    uniform routing), as the counters count them."""
    if op in ("alltoall", "alltoallv"):
        return nbytes // size * (size - 1)
    return ring_wire_bytes(op, nbytes, size)


def bucket_bytes(param_bytes: list[int], bucket_mb: float, dtype: str) -> list[int]:
    """DDP's buckets (``parallel.data.plan_buckets``) over parameters of these sizes, in bytes each."""
    return list(_bucket_bytes(tuple(param_bytes), bucket_mb, dtype))


@functools.lru_cache(maxsize=4096)  # a planner run asks for the same cut of a stage's parameters again and again
def _bucket_bytes(param_bytes: tuple, bucket_mb: float, dtype: str) -> tuple:
    params = [SimpleNamespace(dtype=dtype, data=SimpleNamespace(nbytes=n)) for n in param_bytes]
    limit = np.inf if bucket_mb is None or bucket_mb == np.inf else bucket_mb * (1 << 20)
    return tuple(sum(param_bytes[i] for i in indices) for indices in plan_buckets(params, limit))


def reduce_scatter_buckets(plan, params) -> list[int]:
    """ZeRO-2's (and 3's) buckets (``parallel.zero_grads``): DDP's cut of the parameters, each bucket's
    bytes in the master dtype the shard gradient is reduced in."""
    d = plan.dtype_bytes
    return [n // d * plan.master_bytes for n in bucket_bytes([e * d for _, e, _ in params], plan.job.parallel.bucket_mb, str(d))]


def shard_sequence_parallel_elements(params, dp: int) -> list[int]:
    """Per dp rank, the elements of sequence-parallel parameters inside its ZeRO-2 shard (the
    parameters laid end to end, ``zero.flat_layout``): what its tp sum of the shard moves."""
    shard = -(-sum(e for _, e, _ in params) // dp)
    out, offset = [0] * dp, 0
    for _, elements, sp in params:
        if sp:
            for r in range(dp):
                out[r] += max(0, min(offset + elements, (r + 1) * shard) - max(offset, r * shard))
        offset += elements
    return out


def stage_parameters(stage_layers: list[list[Layer]]) -> list[tuple[str, int, bool]]:
    """A pipeline rank's parameters in ``PipelineParallel.named_parameters`` order (tied ones once)."""
    seen, out = set(), []
    for layers in stage_layers:
        for layer in layers:
            for name, elements, sp in layer.params:
                if name not in seen:
                    seen.add(name)
                    out.append((name, elements, sp))
    return out


@dataclass(frozen=True)
class SyncGroup:
    """Parameters whose gradients are averaged together: over ``comm`` (DDP's, ZeRO's) of ``ranks``
    ranks, which ZeRO shards them over; ``replicas`` hybrid sharding's groups of those shards."""

    comm: str
    ranks: int
    params: list  # [(name, elements, sp)], in the engine's order
    ddp: bool  # whether DDP all-reduces them in buckets (else ZeRO, or one replica's gradients stay)
    replicas: int = 1

    @property
    def elements(self) -> int:
        return sum(e for _, e, _ in self.params)

    @property
    def shard(self) -> int:
        """The elements of one rank's ZeRO shard (padded to ``ranks`` equal ones)."""
        return -(-self.elements // self.ranks)


def sync_groups(plan, params) -> list[SyncGroup]:
    """The gradient syncs of a pipeline rank's ``params``: the dense ones over dp x cp (ZeRO's shard
    groups); under expert parallelism (ep > 1) the experts apart, over edp, the dp / ep ranks that
    hold the same experts (``parallel.experts``: DDP over edp where it has several ranks, else none)."""
    lay, job = plan.layout, plan.job
    zero = job.parallel.zero
    dense = SyncGroup(plan.zero_comm if zero else lay.grad_comm, plan.shards, params, builds_ddp(job, lay),
                      lay.dp_cp // plan.shards)
    if lay.ep == 1:
        return [dense]
    edp, experts = lay.dp // lay.ep, plan.expert_names
    return [replace(dense, params=[p for p in params if p[0] not in experts]),
            SyncGroup("edp", edp, [p for p in params if p[0] in experts], not zero and edp > 1)]


def builds_ddp(job, lay) -> bool:
    """Whether a rank of this layout all-reduces its gradients in DDP's buckets: not under ZeRO
    (it reduce-scatters), and not for one replica (its gradients stay where backward left them;
    a compressor would run even there, but the planner refuses compressed jobs: ``unmodelled``).
    Replicas here are the dp x cp ranks gradients are averaged over."""
    return not job.parallel.zero and lay.dp_cp > 1


def step_traffic(plan) -> Traffic:
    """Every counted call of one step of ``plan`` (a ``predict.StepPlan``)."""
    lay = plan.layout
    dp, pp, tp = lay.dp_cp, lay.pp, lay.tp  # gradients are averaged over dp x cp
    traffic = Traffic(sizes={lay.grad_comm: dp, "cp": lay.cp, "pp": pp, "tp": tp, "world": lay.world, "pp-tied": 2,
                             "dp-shard": plan.shards, "dp-replica": dp // plan.shards, "ep": lay.ep,
                             "edp": lay.dp // lay.ep})
    d = plan.dtype_bytes
    for rank in range(pp):
        mine = [plan.stage_layers[s] for s in range(rank, pp * lay.chunks, pp)]
        group = dp * tp  # world ranks with this pipeline rank
        for layers in mine:
            for layer in layers:
                for comm, calls in (("tp", plan.tp_calls(layer)), ("cp", plan.cp_calls(layer)),
                                    ("ep", plan.ep_calls(layer))):  # with recomputed forwards
                    for op, nbytes in calls:
                        traffic.add(comm, op, nbytes, group, calls=lay.micro_batches)
        params = stage_parameters(mine)
        if pp > 1:
            _pipeline_messages(traffic, plan, rank, group)
            tied = [e for name, e, _ in params if name == "embed.wte.weight"] if plan.tied_across_stages(rank) else []
            for elements in tied:
                traffic.add("pp-tied", "allreduce", elements * d, group)
        syncs = sync_groups(plan, params)
        for sync in syncs:
            _backward_sync_messages(traffic, plan, sync, group)
        if plan.job.parallel.zero == 3:  # each unit's all-gathers, in the compute dtype
            for comm, elements, gathers in plan.zero3_units(rank):
                traffic.add(comm, "iallgather", elements * d, group, calls=gathers)
        _sequence_parallel_messages(traffic, plan, syncs[0].params, group)  # sp parameters are all dense
        if pp > 1:
            traffic.add("pp", "allreduce", SCALAR, group)  # the last stage's loss, to every stage
        _optimizer_messages(traffic, plan, syncs, group)
    return traffic


def _backward_sync_messages(traffic: Traffic, plan, sync: SyncGroup, group: int) -> None:
    """During backward: DDP's bucket all-reduces of ``sync``'s gradients, or ZeRO-2's (and 3's) reduce-scatters."""
    job, d = plan.job, plan.dtype_bytes
    if sync.ddp:
        for nbytes in bucket_bytes([e * d for _, e, _ in sync.params], job.parallel.bucket_mb, str(d)):
            traffic.add(sync.comm, "iallreduce", nbytes, group)
    if job.parallel.zero >= 2:
        for nbytes in reduce_scatter_buckets(plan, sync.params):
            traffic.add(sync.comm, "ireduce_scatter", nbytes, group)


def _sequence_parallel_messages(traffic: Traffic, plan, params, group: int) -> None:
    """The tp sum of the gradients of parameters used on sequence slices (ZeRO-2, 3: each shard's
    part, on its holders)."""
    lay, tp = plan.layout, plan.layout.tp
    sp = [e for _, e, on in params if on]
    if not (lay.sequence_parallel and tp > 1 and sp):
        return
    if plan.job.parallel.zero >= 2:
        for elements in shard_sequence_parallel_elements(params, plan.shards):
            if elements:
                traffic.add("tp", "allreduce", elements * plan.master_bytes, tp * (lay.dp_cp // plan.shards))
    else:
        traffic.add("tp", "allreduce", sum(sp) * plan.dtype_bytes, group)


def _pipeline_messages(traffic: Traffic, plan, rank: int, group: int) -> None:
    """Activations forward and gradients backward between this rank's virtual stages and their neighbours.

    Per channel and step: a header (8 int64) before micro-batch 0's activation, then one message
    per micro-batch each way; both sides count (a receive counts the bytes it was given, wire 0)."""
    lay = plan.layout
    stages = lay.pp * lay.chunks
    m = lay.micro_batches
    for s in range(rank, stages, lay.pp):
        if s + 1 < stages:  # sends to s + 1, receives its gradients
            nbytes = plan.boundary_bytes(s)
            traffic.add("pp", "isend", 64, group)
            traffic.add("pp", "isend", nbytes, group, calls=m)
            traffic.add("pp", "irecv", nbytes, group, calls=m)
        if s > 0:  # receives from s - 1, sends gradients back
            nbytes = plan.boundary_bytes(s - 1)
            traffic.add("pp", "recv", 64, group)
            traffic.add("pp", "irecv", nbytes, group, calls=m)
            traffic.add("pp", "isend", nbytes, group, calls=m)


def _optimizer_messages(traffic: Traffic, plan, syncs: list, group: int) -> None:
    """finish_step: for each sync group's shard ZeRO's reduce-scatter (ZeRO-1; ZeRO-2's and 3's ran in
    backward) and all-gather, and its share of the clipping norm; the norm's sums over ep (the
    experts'), tp and pp; the finiteness check."""
    job, lay = plan.job, plan.layout
    clip = job.optimizer.grad_clip > 0
    for sync in syncs if job.parallel.zero else []:
        shard = sync.shard * plan.master_bytes
        if job.parallel.zero == 1:
            traffic.add(sync.comm, "reduce_scatter", shard * sync.ranks, group)
        if sync.replicas > 1:  # hybrid sharding: the shard gradient averaged over the groups
            traffic.add("dp-replica", "allreduce", shard, group)
        if job.parallel.zero < 3:  # ZeRO-3's units gather themselves as they run
            traffic.add(sync.comm, "allgather", shard, group)
        if clip:
            traffic.add(sync.comm, "allreduce", SCALAR, group)
    if clip:
        if lay.ep > 1:
            traffic.add("ep", "allreduce", SCALAR, group)
        traffic.add("tp", "allreduce", SCALAR, group)
        traffic.add("pp", "allreduce", SCALAR, group)
    traffic.add("world", "allreduce", SCALAR, group)  # every precision agrees whether the step is finite
