"""Memory per rank: parameters, gradients, optimizer state, activations in flight, buffers.

Per pipeline rank (the largest is reported): parameters, optimizer state and masters, the
communication buffers, and the step's peak, taken when things are alive together rather than as
the sum of each part's maximum (``rank_memory`` says how). ``activation_peak`` is what ``hpcpar
compare`` measures with tracemalloc during one ``train_step`` (gradients + activations +
temporaries at that moment); ``param_state`` what it reports as parameters + optimizer state.
docs/planner.md has the equations.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..parallel.zero_grads import IN_FLIGHT
from ..parallel.zero_params import gathered_at_peak
from .schedule import in_flight, schedule_of
from .traffic import bucket_bytes, builds_ddp, reduce_scatter_buckets, sync_groups


@dataclass
class Memory:
    params: float
    optimizer: float  # state and master weights
    buffers: float  # DDP buckets / ZeRO's flat buffers
    gradients: float  # made by the step's peak
    activations: float  # kept for backward at the peak
    workspace: float  # temporaries at the peak

    @property
    def param_state(self) -> float:
        return self.params + self.optimizer

    @property
    def activation_peak(self) -> float:
        return self.gradients + self.activations + self.workspace

    @property
    def total(self) -> float:
        return self.params + self.optimizer + self.buffers + self.activation_peak


# The graph's own objects per forward op (its Function, GraphNode, output Tensor): tracemalloc
# counts them beside the arrays, about 0.65-0.75 KiB per op in the held-out GPTs.
GRAPH_OP_BYTES = 1024
# The pipeline engine's own objects per micro-batch it holds on a stage (its saved input and output
# Tensors, their graph nodes, the requests): about 1.9 KiB in the digits CNN's pipelines.
PIPELINE_MICRO_BATCH_BYTES = 2048
# The engine's record of each action of the step (its trace entry and the like), kept to the step's
# end: 300-450 bytes an action in the digits CNN's pipelines (tracemalloc, rank 2 of 1x4x1).
PIPELINE_ACTION_BYTES = 512


def kept_bytes(plan, layer) -> float:
    """What ``layer`` keeps per micro-batch under the job's recomputation choice, with its graph."""
    return layer.kept_by_recompute.get(plan.recompute, layer.saved_bytes) + layer.forward.ops * GRAPH_OP_BYTES


def rebuilt_bytes(plan, layer) -> float:
    """What recomputation rebuilds for ``layer`` while its backward runs (0 when it keeps all it saves)."""
    return layer.saved_bytes - layer.kept_by_recompute.get(plan.recompute, layer.saved_bytes)


def stage_kept_bytes(plan, stage: int) -> float:
    """What virtual stage ``stage`` keeps per micro-batch: its layers' kept bytes, and its received
    input (a leaf the engine and the graph hold until its gradient is sent) where the first layer's
    count leaves it out (a 32/64-bit block keeps its normalised input, not its input), and its sent
    output (the engine holds it until its gradient comes back) where the last layer's leaves it out
    (a convolution keeps its columns)."""
    layers = plan.stage_layers[stage]
    kept = sum(kept_bytes(plan, layer) for layer in layers)
    if stage > 0 and not layers[0].keeps_input.get(plan.recompute, True):
        kept += plan.boundary_bytes(stage - 1)
    if stage < len(plan.stage_layers) - 1 and not layers[-1].keeps_output:
        kept += plan.boundary_bytes(stage)
    return kept


def _backward_peak(plan, layers, waiting: float, gradients: float, all_gradients: float,
                   received: float = 0.0) -> tuple:
    """(kept, gradients, temporaries) alive at the fullest moment of one micro-batch's backward
    through ``layers`` (a stage). From the last layer down: what is still ``waiting`` for backward
    (this layer's kept bytes and those below it, from ``stage_kept_bytes``), the gradients made so
    far with this layer's (capped at the rank's: a tied weight has one), and this layer's
    temporaries with what recomputation rebuilds for it. A layer's kept bytes are freed when its
    backward is done; the gradients stay to the step's end. A stage that ``received`` its input
    (bytes) ends with that input, its gradient as the first layer returns it, and the copy the
    input keeps as its ``grad`` (autograd copies a leaf's first gradient), the one sent back."""
    worst = (0.0, 0.0, 0.0)
    for layer in reversed(layers):
        kept = kept_bytes(plan, layer)
        # its forward ran with the layers below it kept and the gradients made before this backward
        worst = max(worst, (waiting, gradients, layer.forward_temporaries), key=sum)
        made = min(all_gradients, gradients + sum(e for _, e, _ in layer.params) * plan.dtype_bytes)
        for freed, temporaries in layer.backward_steps or [(0.0, layer.workspace_bytes)]:
            worst = max(worst, (waiting - freed, made, temporaries + rebuilt_bytes(plan, layer)), key=sum)
        gradients = made
        waiting -= kept
    return max(worst, (received, gradients, 2 * received), key=sum) if received else worst


def rank_memory(plan, rank: int, held: int) -> Memory:
    """Pipeline rank ``rank``'s memory with ``held`` micro-batches in flight: its parameters; Adam's
    moments (SGD's momentum) over the master elements (a ZeRO shard: 1/dp, padded; an MoE's experts
    under expert parallelism 1/(dp/ep) of those this rank holds: ``sync_groups``) and float32
    masters under fp16/bf16; DDP's buckets or ZeRO's flat buffers; and the step's peak. At the peak
    the micro-batches in flight keep what each layer keeps for backward (less what recomputation
    drops), a stage's received input and sent output where its layers do not, and the graph's and
    the engine's objects, while one of them runs its backward from the last layer down, freeing
    each layer's kept bytes as it makes its gradients and temporaries (``_backward_peak``); plus
    the gradients earlier backwards made, a weight gradient before it is summed in and a
    pipeline's gradients on their way."""
    lay, job = plan.layout, plan.job
    d, master = plan.dtype_bytes, plan.master_bytes
    params = plan.rank_parameters(rank)
    elements = sum(e for _, e, _ in params)
    stages = list(range(rank, lay.pp * lay.chunks, lay.pp))
    state_elements = sum(sync.shard for sync in sync_groups(plan, params)) if job.parallel.zero else elements
    moments = {"adamw": 2, "adam": 2, "sgd": 1 if job.optimizer.momentum else 0}[job.optimizer.name]
    optimizer = state_elements * master * moments + (elements * 4 if plan.mixed and job.parallel.zero < 3 else 0)
    parameters = _zero3_parameters(plan, rank, state_elements) if job.parallel.zero == 3 else elements * d
    buffers, all_gradients = _gradient_buffers(plan, params, one_backward=lay.micro_batches == 1 and len(stages) == 1)
    per_stage = [stage_kept_bytes(plan, s) for s in stages]
    # One micro-batch through one stage makes the gradients in its backward; otherwise earlier
    # backwards of the step (accumulating micro-batches, the rank's later stages) made them all.
    before = 0.0 if lay.micro_batches == 1 and len(stages) == 1 else elements * d
    kept, gradients, workspace = max((_backward_peak(plan, plan.stage_layers[s], k, before, all_gradients,
                                                     plan.boundary_bytes(s - 1) if s > 0 else 0.0)
                                      for s, k in zip(stages, per_stage)), key=sum)
    kept += (held - 1) * max(per_stage)  # the other micro-batches in flight, each at most a stage's kept bytes
    if lay.pp > 1:
        actions = schedule_of(lay.schedule, lay.pp, lay.micro_batches, lay.chunks)[rank]
        kept += held * PIPELINE_MICRO_BATCH_BYTES + len(actions) * PIPELINE_ACTION_BYTES
    # a weight gradient before it is summed in, and with several micro-batches the sum beside the old
    # total; under 16 bits NumPy's float32 product beside its cast
    per_element = max(d * (2 if lay.micro_batches > 1 else 1), 4 + d if d < 4 else 0)
    workspace += max((e for _, e, _ in params), default=0) * per_element
    if lay.pp > 1:
        # Gradients on their way: the one a backward consumes (received from the next stage), and
        # the one the last backward sent to the previous stage, freed when that send completes,
        # which may be during the next action. (A received activation is the stage's kept input;
        # a sent one is its kept output: counted above.)
        last = lay.pp * lay.chunks - 1
        workspace += max((plan.boundary_bytes(s) for s in stages if s < last), default=0.0)
        workspace += max((plan.boundary_bytes(s - 1) for s in stages if s > 0), default=0.0)
    copies = _float32_bucket_copies(plan, params)
    if copies:
        # Buckets launch as backward fills them, the last one when it ends: during backward all
        # but one copy may be in flight; after it, every copy beside the gradients, and a bucket's
        # result cast back (half its copy). The larger moment is the peak.
        during = kept + gradients + workspace + sum(copies) - min(copies)
        after = elements * d + sum(copies) + max(copies) / 2
        if after > during:
            return Memory(parameters, optimizer, buffers, elements * d, 0.0, after - elements * d)
        workspace += sum(copies) - min(copies)
    return Memory(parameters, optimizer, buffers, gradients, kept, workspace)


def _zero3_parameters(plan, rank: int, shard: int) -> float:
    """ZeRO-3's parameter bytes at the peak: the shard (the masters, in their dtype) and the units
    gathered at once, in the compute dtype: those kept for the step, and with resharding the one
    running and the one prefetched (``parallel.zero_params``), in each store (experts apart under ep)."""
    units = plan.zero3_units(rank)
    gathered = sum(gathered_at_peak([(e, gathers == 1) for c, e, gathers in units if c == comm])
                   for comm in {c for c, _, _ in units})
    return shard * plan.master_bytes + gathered * plan.dtype_bytes


def _gradient_buffers(plan, params, one_backward: bool) -> tuple[float, float]:
    """(bytes of the gradient sync's buffers, the most bytes of gradients backward holds at once),
    summed over the sync groups (``traffic.sync_groups``: the experts apart under expert parallelism).

    DDP's buckets; ZeRO-1's flat gradient (the flat parameters are the masters, or the
    parameters); ZeRO-2's shard gradient and the buckets alive at once (those in flight and one
    filling), and when one backward makes the step's gradients (no accumulation, one stage)
    each is freed into its bucket, so no more than a bucket of them is held."""
    job, d, master = plan.job, plan.dtype_bytes, plan.master_bytes
    buffers = held = 0  # (integers where the parts are)
    for sync in sync_groups(plan, params):
        elements, shard = sync.elements, sync.shard
        if job.parallel.zero >= 2 and sync.params:
            buckets = reduce_scatter_buckets(plan, sync.params)
            held += min(elements * d, max(buckets) / master * d) if one_backward else elements * d
            buffers += shard * master + sum(sorted(buckets)[-(IN_FLIGHT + 1):])
            continue
        held += elements * d
        buffers += shard * sync.ranks * master if job.parallel.zero else (elements * d if sync.ddp else 0.0)
    return buffers, held


def _float32_bucket_copies(plan, params) -> list:
    """Bytes of the float32 copy of each DDP bucket in flight: MPI has no bfloat16, so
    ``runtime.comm`` all-reduces a bfloat16 bucket as a float32 copy (NCCL takes it as it is)."""
    job, d = plan.job, plan.dtype_bytes
    if not builds_ddp(job, plan.layout) or job.precision.name != "bf16" or job.parallel.backend == "nccl":
        return []
    return [n / d * 4 for sync in sync_groups(plan, params) if sync.ddp
            for n in bucket_bytes([e * d for _, e, _ in sync.params], job.parallel.bucket_mb, str(d))]


def memory_per_rank(plan) -> Memory:
    """The pipeline rank with the largest total."""
    held = in_flight(plan)
    return max((rank_memory(plan, r, held[r] if plan.layout.pp > 1 else 1) for r in range(plan.layout.pp)),
               key=lambda m: m.total)
