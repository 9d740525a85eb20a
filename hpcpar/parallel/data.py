"""Data parallelism: bucketed gradient all-reduce over the dp group, overlapped with backward.

    model = GPT(config)
    ddp = DistributedDataParallel(model, ctx, bucket_mb=25, overlap=True)
    loss = model.loss(x, y)        # each dp rank on its own slice of the global batch
    loss.backward()                # buckets start their all-reduce as their gradients become final
    ddp.finish_grad_sync()         # wait for every bucket; grads now hold the dp mean
    optimizer.step()

As PyTorch DDP: gradients are copied into flat buckets in reverse registration order, and the
buckets are launched strictly in index order, so every rank issues the same collectives
(docs/architecture.md, the ``parallel`` package). Strategies reach it through
``parallel.grad_sync``; gradients are averaged over ``ctx.dp_cp`` only, so it composes with
pipeline and tensor parallelism.
"""
from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass, field

from .. import defaults
from ..autograd import Parameter
from ..backend import get_array_module
from ..runtime.shm import shared_zeros
from ..state import ParameterHolder
from .compression import NoCompression


@dataclass
class Bucket:
    """A flat gradient buffer for a run of parameters of one dtype."""

    index: int
    params: list
    offsets: list  # start of each parameter's gradient inside ``flat``
    flat: object
    ready: set = field(default_factory=set)
    pending: object = None  # the compressor's in-flight handle

    @property
    def nbytes(self) -> int:
        return self.flat.nbytes

    def view(self, i: int):
        p = self.params[i]
        return self.flat[self.offsets[i]: self.offsets[i] + p.size].reshape(p.shape)


def plan_buckets(params: list, bucket_bytes: float, alone=frozenset(), apart=frozenset()) -> list[list[int]]:
    """Indices of ``params`` per bucket: reverse order, split by dtype and by ``bucket_bytes``;
    a parameter whose id is in ``alone`` gets a bucket of its own, and those in ``apart`` share
    buckets only with each other.

    ``bucket_bytes=0`` gives one parameter per bucket, ``math.inf`` one bucket per dtype.
    """
    plan, current, current_bytes = [], [], 0
    for i in reversed(range(len(params))):
        p = params[i]
        previous = id(params[current[-1]]) if current else None
        if current and (current_bytes >= bucket_bytes or params[current[-1]].dtype != p.dtype or id(p) in alone
                        or previous in alone or (id(p) in apart) != (previous in apart)):
            plan.append(current)
            current, current_bytes = [], 0
        current.append(i)
        current_bytes += p.data.nbytes
    if current:
        plan.append(current)
    return plan


class DistributedDataParallel(ParameterHolder):
    """Wraps a Module: broadcasts its parameters and averages its gradients over ``ctx.dp_cp`` (dp,
    times cp when context parallelism splits the sequence)."""

    def __init__(self, module, ctx, bucket_mb: float = defaults.BUCKET_MB, overlap: bool = True, compression=None,
                 broadcast_parameters: bool = True, alone=(), comm=None):
        """``comm``: the ranks to average over (None: ``ctx.dp_cp``; an MoE's experts: their edp group)."""
        self.module = module
        self.ctx = ctx
        self.comm = ctx.dp_cp if comm is None else comm
        self.overlap = overlap
        self.compression = compression or NoCompression()
        self.params: list[Parameter] = [p for _, p in module.named_parameters() if p.requires_grad]
        if broadcast_parameters and self.comm.size > 1:
            for p in self.params:
                self.comm.broadcast(p.data, root=0)

        bucket_bytes = math.inf if bucket_mb is None or bucket_mb == math.inf else bucket_mb * (1 << 20)
        self.buckets: list[Bucket] = []
        self._where: dict[int, tuple[int, int]] = {}  # id(param) -> (bucket, slot)
        # ``alone``: parameters another rank holds too (a pipeline's tied embedding), whose
        # gradient a compressor must treat the same there: in a bucket of their own. Likewise
        # the parameters every tensor-parallel rank holds whole (LayerNorms, row-parallel biases)
        # under a compressor that ranks a whole bucket: in buckets without the shards, which
        # differ from rank to rank, or each tp rank sends other entries of them and they drift apart.
        whole = (frozenset(id(p) for p in self.params if p.global_shape is None)
                 if self.compression.whole_bucket and ctx.tp_size > 1 else frozenset())
        for b, indices in enumerate(plan_buckets(self.params, bucket_bytes, frozenset(map(id, alone)), whole)):
            members = [self.params[i] for i in indices]
            offsets, total = [], 0
            for p in members:
                offsets.append(total)
                total += p.size
            # In the node's shared window when the shared-memory path is on (hpcpar.runtime.shm): the
            # bucket is then all-reduced where it lies, with no copy in or out.
            flat = shared_zeros(self.comm, total, members[0].dtype, get_array_module(members[0].data))
            self.buckets.append(Bucket(b, members, offsets, flat))
            for slot, p in enumerate(members):
                self._where[id(p)] = (b, slot)

        self._sync_enabled = True
        self._next_launch = 0
        self.sync_seconds = 0.0  # time spent inside finish_grad_sync, waiting for communication
        for p in self.params:
            p.register_grad_hook(self._on_grad_ready)

    # ----- the user-facing protocol --------------------------------------------------
    def __call__(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def __getattr__(self, name):  # model.loss(...), model.generate(...) through the wrapper
        return getattr(self.module, name)

    def named_parameters(self):
        return self.module.named_parameters()

    @contextlib.contextmanager
    def no_sync(self):
        """Backward passes inside this block only accumulate gradients locally."""
        previous, self._sync_enabled = self._sync_enabled, False
        try:
            yield
        finally:
            self._sync_enabled = previous

    def finish_grad_sync(self) -> None:
        """Complete this step's all-reduces (zero-filling unused parameters); grads hold the dp mean."""
        if not self._sync_enabled:
            return
        start = time.perf_counter()
        for bucket in self.buckets:
            for slot, p in enumerate(bucket.params):
                if slot not in bucket.ready:  # no gradient this step: contribute zeros, never hang
                    self._copy_in(bucket, slot, p.grad)
        self._launch_ready_buckets()
        for bucket in self.buckets:
            averaged = bucket.pending.wait()
            for slot, p in enumerate(bucket.params):
                p.grad = averaged[bucket.offsets[slot]: bucket.offsets[slot] + p.size].reshape(p.shape)
            bucket.pending = None
            bucket.ready.clear()
        self._next_launch = 0
        self.sync_seconds += time.perf_counter() - start

    # ----- hooks ----------------------------------------------------------------------
    def _on_grad_ready(self, param) -> None:
        if not self._sync_enabled:
            return
        b, slot = self._where[id(param)]
        bucket = self.buckets[b]
        self._copy_in(bucket, slot, param.grad)
        param.grad = None  # its copy is in the bucket, and finish hands back a view of it: not two of each gradient
        if self.overlap:
            self._launch_ready_buckets()
            # MPI libraries without a progress thread move a non-blocking collective forward
            # only inside MPI calls: poll the buckets in flight while backward goes on.
            for launched in self.buckets[:self._next_launch]:
                launched.pending.test()

    def _copy_in(self, bucket, slot: int, grad) -> None:
        """Put a final gradient (None: zeros) into its bucket, divided by the ranks if the compressor sums."""
        view = bucket.view(slot)
        if grad is None:
            view[...] = 0
        elif self.compression.sums_prescaled:
            get_array_module(view).multiply(grad, 1.0 / self.comm.size, out=view)
        else:
            view[...] = grad
        bucket.ready.add(slot)

    def _launch_ready_buckets(self) -> None:
        """Launch full buckets in index order only: the same collective sequence on every rank."""
        while self._next_launch < len(self.buckets):
            bucket = self.buckets[self._next_launch]
            if len(bucket.ready) < len(bucket.params):
                return
            bucket.pending = self.compression.start(self.comm, bucket)
            self._next_launch += 1

    # ----- facts for tests and reports ------------------------------------------------
    def bucket_plan(self) -> list[dict]:
        return [{"index": b.index, "params": len(b.params), "bytes": b.nbytes, "dtype": str(b.flat.dtype)}
                for b in self.buckets]

    def state_dict(self) -> dict:
        return self.module.state_dict()

    def load_state_dict(self, state, strict: bool = True):
        return self.module.load_state_dict(state, strict)
