"""Predicted step time, memory per rank and traffic of one job in one layout on one machine.

    plan = StepPlan(job, machine)      # job: validated for its world (its parallel section is the layout)
    prediction = plan.predict()        # .step_s, .memory, .traffic, .breakdown()

Work becomes time with the machine file's measured rates (``work_seconds``), a collective costs
latency + wire bytes / bandwidth (``collective_seconds``); a step adds them up as the engines run
them: with pp = 1 micro-batches, then the exposed part of the gradient all-reduce, then the
optimizer; with pp > 1 hpcpar's own schedule simulator (``parallel.pipeline.schedules.simulate``)
runs the schedule with each virtual stage's predicted times, giving the makespan and the bubble
of every schedule alike. docs/planner.md has the equations.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from ..runtime.grid import GRID
from ..parallel.pipeline.partition import blocks_bounds, counts_to_bounds, min_max_bounds, uniform_bounds
from ..parallel.pipeline.schedules import simulate
from ..parallel.hybrid import default_shard_size
from ..parallel.zero_params import group_layers, reshards
from .machine import Machine
from .memory import Memory, memory_per_rank
from .inventory import layers
from .model import Layer, Work, shape_of
from .schedule import schedule_of
from .traffic import (Traffic, bucket_bytes, reduce_scatter_buckets, shard_sequence_parallel_elements, stage_parameters,
                      step_traffic, sync_groups, wire_bytes)

ELEMENTWISE_RATE = {"gemm": "gemm_flops", "attention": "attention_flops", "conv": "conv_flops"}
# Families computed in float32 under 16 bits whatever the step's precision: an MoE router's product
WIDE = {"router": "gemm_flops"}


class NotModelled(ValueError):
    """A valid job whose step the planner does not model (``unmodelled`` says why)."""


def unmodelled(job) -> str | None:
    """Why the planner cannot predict ``job``, or None. It models synchronous training, mode =
    "allreduce" in every dp x pp x tp x cp with DDP or ZeRO, without gradient compression: the
    parameter server, local SGD and the compressors move other bytes and do other work, and
    predicting them as an all-reduce would be wrong without saying so."""
    p = job.parallel
    if p.mode != "allreduce":
        return (f'parallel.mode = "{p.mode}" is not modelled (the planner predicts mode = "allreduce": every '
                f'dp x pp x tp x cp, DDP or ZeRO); measure it with hpcpar compare')
    if p.compression != "none":
        return (f'parallel.compression = "{p.compression}" is not modelled (its bytes and its compressor\'s work); '
                f'plan the job without it (--set parallel.compression=\'"none"\') and measure the compressed one '
                f'with hpcpar compare')
    return None


@dataclass(frozen=True)
class Layout:
    dp: int
    pp: int
    tp: int
    schedule: str = "1f1b"
    micro_batches: int = 1
    chunks: int = 1
    sequence_parallel: bool = False
    zero: int = 0  # the ZeRO stage over dp x cp
    cp: int = 1  # context parallelism: ranks splitting each sequence (ring attention)
    ep: int = 1  # expert parallelism: consecutive dp ranks splitting each MoE block's experts
    cut: str = "uniform"  # a pipeline's partition method ("counts": per-stage counts given)

    @classmethod
    def of(cls, job) -> "Layout":
        p = job.parallel
        cut = (p.partition if isinstance(p.partition, str) else "counts") if p.pp > 1 else "uniform"
        return cls(p.dp, p.pp, p.tp, p.schedule if p.pp > 1 else "-", p.micro_batches, p.chunks if p.pp > 1 else 1,
                   bool(p.sequence_parallel and p.tp > 1), int(p.zero), p.cp, p.ep, cut)

    @property
    def world(self) -> int:
        return self.dp * self.pp * self.tp * self.cp

    @property
    def dp_cp(self) -> int:
        """The ranks gradients are averaged over (and ZeRO shards over): dp x cp (``ctx.dp_cp``)."""
        return self.dp * self.cp

    @property
    def grad_comm(self) -> str:
        """The name of that communicator, as the counters know it: "dp", or "dp*cp" when cp > 1."""
        return "dp*cp" if self.cp > 1 else "dp"

    def label(self) -> str:
        text = GRID.mesh(dp=self.dp, pp=self.pp, tp=self.tp, cp=self.cp).label()  # "2x1x2", "2x1x2-cp2"
        text += f"-ep{self.ep}" if self.ep > 1 else ""
        if self.pp > 1:
            text += f" {self.schedule} m{self.micro_batches}" + (f" v{self.chunks}" if self.chunks > 1 else "")
            text += f" cut={self.cut}" if self.cut != "uniform" else ""
        elif self.micro_batches > 1:
            text += f" m{self.micro_batches}"
        return text + (" sp" if self.sequence_parallel else "") + (f" z{self.zero}" if self.zero else "")


@dataclass
class Prediction:
    layout: Layout
    step_s: float
    parts: dict  # compute_s, comm_s (exposed), idle_s, optimizer_s, ...
    memory: Memory
    traffic: Traffic
    stage_times: list = field(default_factory=list)  # per virtual stage (F, B, W) seconds per micro-batch
    label: str = ""
    job: object = None

    @property
    def comm_share(self) -> float:
        return self.parts["comm_s"] / self.step_s if self.step_s else 0.0

    @property
    def bubble_share(self) -> float:
        return self.parts["idle_s"] / self.step_s if self.step_s else 0.0


def work_seconds(work: Work, machine: Machine, precision: str) -> float:
    """Seconds of ``work``: per op family units / the machine's rate, plus ops x the fixed cost of an
    op; the machine's ``model_factor`` scales it (its measured ``concurrency[k]`` slows it down where
    k ranks compute at once on a node: ``StepPlan.slowdown``)."""
    c = machine.compute_for(precision)
    seconds = work.ops * c.op_overhead_s
    for family, units in work.units.items():
        if family in WIDE:
            rate = getattr(machine.compute_for("fp32" if precision in ("bf16", "fp16") else precision), WIDE[family])
        elif family in ELEMENTWISE_RATE:
            rate = getattr(c, ELEMENTWISE_RATE[family]) or c.gemm_flops
        else:
            rate = c.rate_of(family)
        seconds += units / rate
    return seconds * c.model_factor


class StepPlan:
    """A job in its layout on a machine: the stages, their times, the messages, the memory."""

    def __init__(self, job, machine: Machine, recompute: str | None = None):
        why = unmodelled(job)
        if why:
            raise NotModelled(why)
        self.job, self.machine, self.layout = job, machine, Layout.of(job)
        lay = self.layout
        self.precision = job.precision.name
        self.mixed = job.precision.mixed
        self.dtype_bytes = job.precision.itemsize
        self.master_bytes = job.precision.master_itemsize
        self.recompute = recompute or getattr(job.model, "recompute", "none")
        # ZeRO's shard groups over dp x cp (parallel.hybrid): its ranks in a node are consecutive, tp
        # fastest; no hybrid sharding under expert parallelism (ZeRO then shards the dense part over dp)
        hybrid = job.parallel.zero and lay.ep == 1
        self.shards = (job.parallel.shard_size or default_shard_size(lay.dp_cp, machine.ranks_per_node // lay.tp)
                       if hybrid else lay.dp_cp)
        self.zero_comm = lay.grad_comm if self.shards == lay.dp_cp else "dp-shard"  # where ZeRO's collectives run
        self.reshards = job.parallel.zero == 3 and reshards(job.parallel.reshard_after_forward, lay.pp)
        if self.reshards and job.train.device != "cpu":
            # ZeRO-3 frees a resharded unit's pages on CPUs; device arrays (train.device = auto: a
            # GPU is assumed) rerun each resharded block as a recomputed region instead
            self.recompute = "full"
        self.rows = job.data.batch_size // (lay.dp * lay.micro_batches)
        self.layers = layers(shape_of(job, self.rows, lay.tp))
        self.node_ranks = min(lay.world, machine.ranks_per_node)
        self.slowdown = machine.slowdown(self.node_ranks)  # before the cut: "balanced" cuts by predicted times
        self._collective_cache: dict = {}
        self._holders, self._parameters, self._unit_cache, self._memory = None, {}, {}, None
        self.bounds = self._bounds(job.parallel.partition)
        self.stage_layers = [self.layers[self.bounds[s]: self.bounds[s + 1]] for s in range(lay.pp * lay.chunks)]
        self.expert_names = frozenset().union(*(layer.expert_params for layer in self.layers))  # MoE blocks' experts

    def _bounds(self, method) -> list[int]:
        stages = self.layout.pp * self.layout.chunks
        if not isinstance(method, str):
            return counts_to_bounds(method, len(self.layers))
        if method == "parameters":
            return min_max_bounds([sum(e for _, e, _ in layer.params) for layer in self.layers], stages)
        if method == "balanced":  # the engine measures; its best cut is the one of the predicted times
            return min_max_bounds([sum(self.layer_seconds(layer)) for layer in self.layers], stages)
        if method == "blocks":
            return blocks_bounds(len(self.layers), stages)
        return uniform_bounds(len(self.layers), stages)

    # ----- pieces -------------------------------------------------------------------------
    def crosses_nodes(self, comm: str) -> bool:
        lay, per_node = self.layout, self.machine.ranks_per_node
        grads = lay.tp * lay.dp_cp  # rank order pp, dp, cp, tp: a cp group spans tp x cp ranks, dp x cp tp x cp x dp
        span = {"tp": lay.tp, "cp": lay.tp * lay.cp, "dp": grads, "dp*cp": grads, "dp-shard": lay.tp * self.shards,
                "dp-replica": grads, "ep": lay.tp * lay.ep, "edp": grads, "pp": lay.world, "pp-tied": lay.world,
                "world": lay.world}[comm]  # ep: consecutive dp ranks (cp = 1); edp: every ep-th
        return span > per_node

    def collective_seconds(self, comm: str, op: str, nbytes: float) -> float:
        """latency + wire bytes / bandwidth of ``op`` over ``comm``: the machine file's line for that op
        and group size when it has one, else the intra- or inter-node link by where the group's ranks
        sit (rank order: tp fastest, then cp, dp, pp; ``ranks_per_node`` ranks per node)."""
        key = (comm, op, nbytes)
        if key not in self._collective_cache:
            self._collective_cache[key] = self._collective_seconds(comm, op, nbytes)
        return self._collective_cache[key]

    def _collective_seconds(self, comm: str, op: str, nbytes: float) -> float:
        lay = self.layout
        ranks = {"tp": lay.tp, "cp": lay.cp, "dp": lay.dp, "dp*cp": lay.dp_cp, "dp-shard": self.shards,
                 "dp-replica": lay.dp_cp // self.shards, "ep": lay.ep, "edp": lay.dp // lay.ep, "pp": lay.pp,
                 "pp-tied": 2, "world": lay.world}[comm]
        if ranks == 1:
            return 0.0
        link = self.machine.link(op, ranks, self.crosses_nodes(comm))
        wire = int(nbytes) if op == "send" else wire_bytes(op, int(nbytes), ranks)
        return link.seconds(wire)

    def layer_seconds(self, layer: Layer) -> tuple[float, float, float]:
        """(F, B, W) of one micro-batch through ``layer``, its communication (``layer_comm_seconds``) included."""
        p = self.precision
        forward = work_seconds(layer.forward, self.machine, p) * self.slowdown
        backward = work_seconds(layer.backward_input, self.machine, p) * self.slowdown
        weight = work_seconds(layer.backward_weight, self.machine, p) * self.slowdown
        if self._reruns(layer, ("full",)):
            backward += forward  # the block's forward (and its communication, below) runs again before its backward
        elif self._reruns(layer, ("selective",)):
            attention = Counter({f: u for f, u in layer.forward.units.items() if f in ("attention", "softmax")})
            backward += work_seconds(Work(attention), self.machine, p) * self.slowdown  # the softmax again
        comm_forward, comm_backward = self.layer_comm_seconds(layer)
        return forward + comm_forward, backward + comm_backward, weight

    def _reruns(self, layer: Layer, modes) -> bool:
        """Whether ``layer`` is a block whose forward (or attention core) reruns in backward under ``modes``."""
        return self.recompute in modes and bool(layer.kept_by_recompute)

    def layer_comm_seconds(self, layer: Layer) -> tuple[float, float]:
        """(forward, backward) seconds of communication inside ``layer`` per micro-batch: tp's blocking
        collectives, an MoE block's all-to-alls on ep (blocking too) and what cp's ring transfers
        show beyond the compute they overlap (``ring_seconds``); backward with a recomputed
        forward's (full: tp's, ep's and the ring's; selective reruns attention's core, the ring's forward)."""
        forward = backward = 0.0
        for comm, calls_forward, calls_backward in (("tp", layer.tp_forward, layer.tp_backward),
                                                    ("ep", layer.ep_forward, layer.ep_backward)):
            later = self._with_rerun(layer, calls_forward, calls_backward)[len(calls_forward):]
            forward += sum(self.collective_seconds(comm, op, n) for op, n in calls_forward)
            backward += sum(self.collective_seconds(comm, op, n) for op, n in later)
        ring_forward, ring_backward = self.ring_seconds(layer)
        again = ring_forward if self._reruns(layer, ("selective", "full")) else 0.0
        return forward + ring_forward, backward + ring_backward + again

    def ring_seconds(self, layer: Layer) -> tuple[float, float]:
        """(forward, backward) seconds of ``layer``'s ring transfers not hidden behind its chunk pairs.

        A transfer posted at a ring step is waited for after that step's pairs are computed, so
        each step shows max(0, transfer - its pairs' attention compute): forward the next K/V
        block (steps 0 .. C-2); backward the next block and the dK/dV accumulator of the step
        before, in flight together, and the last accumulator whole (nothing is left to compute)."""
        ring = layer.ring
        if ring is None:
            return 0.0, 0.0
        kv, grad = (self.collective_seconds("cp", "send", n) for n in (ring.kv_bytes, ring.grad_bytes))
        pair_forward, pair_backward = (work_seconds(w, self.machine, self.precision) * self.slowdown
                                       for w in (ring.pair_forward, ring.pair_backward))
        last = ring.ranks - 1
        forward = sum(max(0.0, kv - ring.pairs(s) * pair_forward) for s in range(last))
        backward = grad + sum(max(0.0, (kv if s < last else 0.0) + (grad if s else 0.0) - ring.pairs(s) * pair_backward)
                              for s in range(ring.ranks))
        return forward, backward

    def tp_calls(self, layer: Layer) -> list:
        """[(op, bytes)] of ``layer`` on tp per micro-batch: forward, backward, and forward again under full recompute."""
        return self._with_rerun(layer, layer.tp_forward, layer.tp_backward)

    def ep_calls(self, layer: Layer) -> list:
        """[(op, bytes)] of ``layer`` on ep per micro-batch (an MoE block's all-to-alls), as ``tp_calls``."""
        return self._with_rerun(layer, layer.ep_forward, layer.ep_backward)

    def _with_rerun(self, layer: Layer, forward: list, backward: list) -> list:
        return forward + backward + (forward if self._reruns(layer, ("full",)) else [])

    def cp_calls(self, layer: Layer) -> list:
        """[(op, bytes)] of ``layer`` on cp per micro-batch: the ring's forward, its backward, and its
        forward again under either recomputation (selective reruns attention's core, the ring)."""
        if layer.ring is None:
            return []
        rerun = layer.ring.calls() if self._reruns(layer, ("selective", "full")) else []
        return layer.ring.calls() + layer.ring.calls(backward=True) + rerun

    def stage_seconds(self, stage: int) -> tuple[float, float, float]:
        """(F, B, W) of one micro-batch through virtual stage ``stage``: its layers, the machine's
        fixed cost of a micro-batch (half to forward, half to backward), gradient accumulation."""
        times = [self.layer_seconds(layer) for layer in self.stage_layers[stage]]
        forward, backward, weight = (sum(t[k] for t in times) for k in range(3))
        fixed = self.machine.compute_for(self.precision).micro_batch_overhead_s * self.slowdown / 2
        return forward + fixed, backward + fixed, weight + self._accumulation_seconds(stage)

    def _accumulation_seconds(self, stage: int) -> float:
        """Per micro-batch, the average cost of adding its gradients into the parameters' ``grad``:
        every micro-batch after the first adds (ops per tensor, three passes over its elements)."""
        m = self.layout.micro_batches
        if m == 1:
            return 0.0
        tensors = {name: elements for layer in self.stage_layers[stage] for name, elements, _ in layer.params}
        work = Work(ops=len(tensors)).add("copy", 3 * sum(tensors.values()) * self.dtype_bytes)
        return work_seconds(work, self.machine, self.precision) * self.slowdown * (m - 1) / m

    def boundary_bytes(self, stage: int) -> float:
        """Bytes of one micro-batch's activation leaving virtual stage ``stage`` (per tp rank)."""
        return self.stage_layers[stage][-1].output_elements * self.dtype_bytes

    def tied_across_stages(self, rank: int) -> bool:
        """Whether pipeline rank ``rank`` holds the tied embedding with another rank."""
        if self._holders is None:
            self._holders = {s % self.layout.pp for s, stage in enumerate(self.stage_layers)
                             for layer in stage[:1] + stage[-1:] if any(n == "embed.wte.weight" for n, _, _ in layer.params)}
        return len(self._holders) > 1 and rank in self._holders

    def rank_parameters(self, rank: int) -> list:
        """This pipeline rank's parameters in the engine's order (ZeRO-3: its units'; computed once per rank)."""
        if rank not in self._parameters:
            lay = self.layout
            if lay.zero == 3:
                self._parameters[rank] = [p for _, params, _ in self._units(rank) for p in params]
            else:
                self._parameters[rank] = stage_parameters([self.stage_layers[s]
                                                           for s in range(rank, lay.pp * lay.chunks, lay.pp)])
        return self._parameters[rank]

    def _units(self, rank: int) -> list:
        """[(layers, params, the communicator gathering them)]: under expert parallelism the dense
        units over dp, then each MoE block's experts, a unit of their own over edp (``parallel.experts``)."""
        if rank not in self._unit_cache:
            lay = self.layout
            layers = [layer for s in range(rank, lay.pp * lay.chunks, lay.pp) for layer in self.stage_layers[s]]
            experts = self.expert_names if lay.ep > 1 else frozenset()
            units = []
            for comm, in_store in ((self.zero_comm, False), ("edp", True)):
                def held(layer, in_store=in_store):
                    return [p for p in layer.params if (p[0] in experts) == in_store]
                units += [(unit_layers, params, comm)
                          for unit_layers, params in group_layers(layers, params_of=held, key=lambda param: param[0])]
            self._unit_cache[rank] = units
        return self._unit_cache[rank]

    def zero3_units(self, rank: int) -> list[tuple[str, int, int]]:
        """ZeRO-3's units on pipeline rank ``rank`` (``parallel.zero_params``): (communicator,
        elements, gathers a step); kept once a step: layers sharing a weight, the embedding (its
        input is token ids) and every unit without resharding; else twice each micro-batch."""
        units = []
        for unit_layers, params, comm in self._units(rank):
            kept = not self.reshards or len(unit_layers) > 1 or unit_layers[0] is self.layers[0]
            units.append((comm, sum(e for _, e, _ in params), 1 if kept else 2 * self.layout.micro_batches))
        return units

    def memory(self) -> Memory:
        if self._memory is None:  # asked for by the layout search first, then by the prediction
            self._memory = memory_per_rank(self)
        return self._memory

    # ----- the prediction -------------------------------------------------------------------
    def predict(self) -> Prediction:
        lay = self.layout
        stage_times = [self.stage_seconds(s) for s in range(lay.pp * lay.chunks)]
        if lay.pp == 1:
            parts = self._data_parallel_step(stage_times[0])
        else:
            parts = self._pipeline_step(stage_times)
        optimizer = max(self._optimizer_seconds(rank) for rank in range(lay.pp))
        parts["optimizer_s"] = optimizer
        parts["compute_s"] += optimizer
        parts["comm_s"] += self._optimizer_comm_seconds()
        step = parts["compute_s"] + parts["comm_s"] + parts["idle_s"]
        return Prediction(lay, step, parts, self.memory(), step_traffic(self), stage_times, lay.label(), self.job)

    def _data_parallel_step(self, times) -> dict:
        forward, backward, weight = times
        m = self.layout.micro_batches
        compute = m * (forward + backward + weight)
        layer_comm = m * sum(sum(self.layer_comm_seconds(layer)) for layer in self.layers)
        sync = self._gradient_sync_seconds(0)
        buckets = sync["buckets"]
        hidden = min(sum(buckets[:-1]), self.machine.overlap * (backward + weight)) if buckets else 0.0
        exposed = sync["total"] - hidden
        return {"compute_s": compute - layer_comm, "comm_s": layer_comm + exposed, "idle_s": 0.0}

    def _pipeline_step(self, stage_times) -> dict:
        lay = self.layout
        times = {}
        for s, (f, b, w) in enumerate(stage_times):
            times[("F", s)] = f
            times[("B", s)] = b if lay.schedule == "zb1" else b + w
            times[("W", s)] = w
        p2p = max(self.collective_seconds("pp", "send", self.boundary_bytes(s)) for s in range(len(stage_times) - 1))
        result = simulate([list(a) for a in schedule_of(lay.schedule, lay.pp, lay.micro_batches, lay.chunks)], comm_time=p2p,
                          stage_times=times)
        busy = max(result.busy)
        layer_comm = lay.micro_batches * max(sum(sum(self.layer_comm_seconds(layer))
                                                 for s in range(r, len(stage_times), lay.pp) for layer in self.stage_layers[s])
                                             for r in range(lay.pp))
        sync = max(self._gradient_sync_seconds(r)["total"] for r in range(lay.pp))
        return {"compute_s": busy - layer_comm, "comm_s": layer_comm + sync,
                "idle_s": result.makespan - busy, "bubble": result.bubble}

    def _gradient_sync_seconds(self, rank: int) -> dict:
        """After backward: the tied embedding's sum, DDP's buckets (the dense ones', then the experts'
        over edp), sequence-parallel gradients, the loss."""
        lay, job, d = self.layout, self.job, self.dtype_bytes
        params = self.rank_parameters(rank)
        syncs = sync_groups(self, params)
        buckets = [seconds for sync in syncs for seconds in self._bucket_seconds(sync)]
        params = syncs[0].params  # the dense ones: sequence-parallel parameters are among them
        total = sum(buckets) + self._unit_gather_seconds(rank)
        if lay.pp > 1:
            if self.tied_across_stages(rank):
                total += sum(self.collective_seconds("pp-tied", "allreduce", e * d)
                             for n, e, _ in params if n == "embed.wte.weight")
            total += self.collective_seconds("pp", "allreduce", 8)
        sp = sum(e for _, e, on in params if on)
        if lay.sequence_parallel and sp and job.parallel.zero >= 2:  # the slowest dp rank's part of its shard
            total += self.collective_seconds("tp", "allreduce",
                                             max(shard_sequence_parallel_elements(params, self.shards)) * self.master_bytes)
        elif lay.sequence_parallel and sp:
            total += self.collective_seconds("tp", "allreduce", sp * d)
        return {"buckets": buckets, "total": total}

    def _bucket_seconds(self, sync) -> list:
        """Each bucket's all-reduce (DDP) or reduce-scatter (ZeRO-2, 3) of one sync group, in backward."""
        job, d = self.job, self.dtype_bytes
        if sync.ddp:
            return [self.collective_seconds(sync.comm, "iallreduce", n)
                    for n in bucket_bytes([e * d for _, e, _ in sync.params], job.parallel.bucket_mb, str(d))]
        if job.parallel.zero >= 2 and self.layout.dp_cp > 1:
            return [self.collective_seconds(sync.comm, "reduce_scatter", n)
                    for n in reduce_scatter_buckets(self, sync.params)]
        return []

    def _unit_gather_seconds(self, rank: int) -> float:
        """ZeRO-3's all-gathers not hidden behind compute: a kept unit's once a step, whole (the
        first is what the step starts with); a resharded unit's twice a micro-batch, each
        prefetched during a neighbour's pass, so only what outlasts a block's forward (and its
        backward) shows."""
        if self.layout.zero != 3 or self.layout.dp_cp == 1:
            return 0.0
        block = next((layer for layer in self.layers if layer.kept_by_recompute), None)
        forward, backward, _ = self.layer_seconds(block) if block is not None else (0.0, 0.0, 0.0)
        seconds = 0.0
        for comm, elements, gathers in self.zero3_units(rank):
            gather = self.collective_seconds(comm, "iallgather", elements * self.dtype_bytes)
            if gathers == 1:
                seconds += gather
            else:
                seconds += gathers / 2 * (max(0.0, gather - forward) + max(0.0, gather - backward))
        return seconds

    def _optimizer_seconds(self, rank: int) -> float:
        """The optimizer's elementwise passes over this rank's (shard of the) parameters, and clipping."""
        params = self.rank_parameters(rank)
        elements = sum(e for _, e, _ in params)
        # The optimizer steps tensor by tensor (ZeRO: one flat shard per sync group); each tensor pays
        # the ops of one update (8, as calibration counts them) and clipping's two (norm, scale).
        tensors = len(params)
        if self.job.parallel.zero:
            syncs = sync_groups(self, params)
            tensors, elements = len(syncs), sum(sync.shard for sync in syncs)
        passes = {"adamw": 14, "adam": 14, "sgd": 4 if self.job.optimizer.momentum else 3}[self.job.optimizer.name]
        ops_per_tensor = 8
        if self.job.optimizer.grad_clip > 0:
            passes, ops_per_tensor = passes + 3, ops_per_tensor + 2
        passes += 4 if self.mixed else 0
        work = Work(ops=ops_per_tensor * tensors).add("optimizer", passes * elements * self.master_bytes)
        return work_seconds(work, self.machine, "fp32") * self.slowdown

    def _optimizer_comm_seconds(self) -> float:
        """ZeRO's collectives after backward (on the pipeline rank with the most parameters, per sync
        group) and the clipping norm's scalar sums."""
        lay, job = self.layout, self.job
        seconds = 0.0
        largest = max(range(lay.pp), key=lambda r: sum(e for _, e, _ in self.rank_parameters(r)))
        syncs = sync_groups(self, self.rank_parameters(largest))
        for sync in syncs if job.parallel.zero and lay.dp_cp > 1 else []:
            shard = sync.shard * self.master_bytes
            if job.parallel.zero == 1:  # ZeRO-2 and 3 reduce-scattered their buckets after (or during) backward
                seconds += self.collective_seconds(sync.comm, "reduce_scatter", shard * sync.ranks)
            if job.parallel.zero < 3:  # ZeRO-3's units gather themselves as they run
                seconds += self.collective_seconds(sync.comm, "allgather", shard)
            if sync.replicas > 1:  # hybrid sharding: the shard gradient averaged over the groups
                seconds += self.collective_seconds("dp-replica", "allreduce", shard)
        if job.optimizer.grad_clip > 0:
            seconds += sum(self.collective_seconds(c, "allreduce", 8) for c in ("tp", "pp", "ep")) + (
                sum(self.collective_seconds(sync.comm, "allreduce", 8) for sync in syncs) if job.parallel.zero else 0.0)
        return seconds
