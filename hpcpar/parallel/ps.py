"""Parameter server: server ranks hold the parameters in shards and run the optimizer on them;
worker ranks compute gradients, push them to the servers and pull fresh parameters.

    mpiexec -n 4 python train.py               # 3 workers (ranks 0, 1, 2) + 1 server (rank 3)

    ctx = hpcpar.init()                         # the whole world
    ps = ParameterServer(model.named_parameters(), ctx, AdamW, servers=1, staleness=0, lr=3e-4)
    ps.serve()                                  # server ranks: serve until every worker stopped
    if ps.is_worker:
        for step in range(steps):
            ids, targets = batch(step, ps.ctx.dp_rank, ps.ctx.dp_size)   # ps.ctx: the workers only
            model.loss(ids, targets).backward()
            ps.push_pull()                      # gradient slices out, fresh parameter slices in
    ps.shutdown()                               # workers: stop message, receive the final parameters

Layout. Of a world of N ranks the **last S are servers** and ranks 0 .. W-1 (W = N - S) are
workers, so the worker ranks are exactly the first W ranks of an ordinary data-parallel run.
The parameters, flattened end to end in named order, are cut into S contiguous ranges whose
sizes differ by at most one element (``shard_ranges``): every server receives, updates and
sends the same number of bytes, so no single server is the bottleneck. Each server keeps its
range as one flat Parameter and runs its own instance of the optimizer on it (Adam's moments
exist only there). All ranks start from world rank 0's parameters (one broadcast).

Messages (point-to-point on a private duplicate of the world communicator, every one counted
in ``ps.comm.stats``): a push is a header ``[kind, step, version read, lr]`` (float64) and the
gradient slice; a reply is ``[version]`` (int64) and the parameter slice (in the parameters'
dtype). The learning rate
travels with each push, so a schedule on the workers drives ``ps.lr`` (``WarmupCosine(ps, ...)``
works on a worker: it only reads and sets ``lr``).

Consistency, per server (``version`` counts the updates a server has applied):

- ``staleness=0`` — **synchronous**: a server waits for every worker's gradient of version v,
  averages them (worker order, so the sum is deterministic), takes one optimizer step with the
  lr of the lowest-ranked worker (all workers run the same schedule), and answers every pull
  with version v+1. This is data parallelism with an all-reduce mean and
  the same optimizer (equal in float64 to ~1e-16; tests check 1e-10). With
  ``max_grad_norm`` the averaged gradient is clipped by its global norm (the servers complete
  the norm among themselves), as DDP + ``clip_grad_norm`` does.
- ``staleness=s >= 1`` — **asynchronous, bounded staleness**: a server applies each worker's
  gradient as it arrives, **scaled by 1/W** (so with plain SGD a round of W pushes moves the
  parameters as one synchronous step would; with Adam each push is a full Adam step, nearly
  scale-free, so W pushes take W steps of size ~lr), and increments its version. The bound is
  enforced on the server: a worker's pull for its step k is answered only when the slowest
  active worker has completed at least k - s steps (a worker that stopped no longer counts).
  So no worker computes on parameters more than s steps ahead of the slowest one. In versions,
  the updates slipped in between a worker's read and its push are then at most
  (W - 1)(2s + 1). ``max_grad_norm`` clips each worker's own gradient before it is pushed.

Every update is logged on its server (``update_log``: worker, step, version read, version,
staleness in versions, lead in steps over the slowest worker at read time).

Shutdown. ``shutdown()`` on a worker sends every server a stop header and receives the final
parameters (sent once *all* workers have stopped), so every worker ends with the same, final
model, also after asynchronous training. A server's loop ends when every worker has stopped.
A worker that raises ends the job through hpcpar's fail-fast (``hpcpar.dist.failfast``): the
abort kills the servers too, wherever they are waiting. Servers wait by polling with the
communicator's wait policy (``yield`` sleeps between polls), so an oversubscribed node keeps
its cores for the workers.

Mixed precision (``master_dtype``, e.g. float32 for a bfloat16 or float16 model): the servers
keep their range as float32 masters (the model's values upcast) and step those; a worker runs
backward seeded with its loss scale (``backward``; ``scaler``: a ``DynamicLossScaler`` for
float16, None for bfloat16), unscales its gradients into a float32 buffer and pushes that; the
servers reply with their masters cast to the model's dtype. A push whose loss or gradient is not
finite is marked in its header's kind (``KIND_PUSH_NONFINITE``, the gradient still travels, so
the message pattern is the same): a synchronous server then skips the whole round (no step, no
new version; every server sees the same marks, so all skip), an asynchronous one drops that push
alone. Synchronous workers agree on the mark first (a max over the workers), so their loss
scalers stay in step; an asynchronous worker's scaler follows its own pushes. ``push_pull``
returns whether the step counts as taken, and ``skipped_steps`` counts the others.

Checkpoints. A worker's ``save_checkpoint(step, write)`` sends every server a save request,
then runs ``write`` (a collective ``checkpoint.save`` over the world, with this object as the
optimizer). A server joins once every active worker has asked, by calling ``on_save(step)``:
the servers write their ranges of the parameters (the masters, under mixed precision) and their
optimizer state as slabs of the global tensors (``checkpoint_pieces``), so the checkpoint loads
into any layout or mode; at a load servers read their ranges straight into their shards and
workers the whole model into theirs.

Limits: pure data parallelism (pp = tp = 1), one parameter dtype.
"""
from __future__ import annotations

import itertools
import math
import time
from dataclasses import dataclass

import numpy as np

from ..autograd import Parameter
from ..backend import get_array_module, to_device
from ..dist.comm import Communicator, wait_all
from ..dist.context import init
from ..dist.trace import NO_TRACE
from ..dist.waiting import YIELD_SLEEP_S
from ..optim.amp import all_finite, scaled_backward
from ..optim.clip import clip_arrays
from ..optim.groups import flat_range_decays, flatten_groups, set_flat_range_decay
from ..optim.optimizer import named_parameter_list
from ..state import (Checkpointable, LoadPlan, Piece, Read, Saved, flat_state_load_plan, flat_state_pieces,
                     parameter_load_plan, range_param_slabs, weight_decay_scalars)

TAG_PUSH_HEADER, TAG_PUSH_GRAD, TAG_REPLY_HEADER, TAG_REPLY_PARAMS = 7301, 7302, 7303, 7304
KIND_PUSH, KIND_STOP, KIND_SAVE, KIND_PUSH_NONFINITE = 0.0, 1.0, 2.0, 3.0  # the last: a push not to apply
HEADER_LENGTH = 4  # [kind, step, version read, lr] as float64: exact for steps below 2**53


@dataclass(frozen=True)
class UpdateRecord:
    """One gradient applied by one server."""

    worker: int  # world rank of the worker that pushed it
    step: int  # that worker's step (0, 1, ...)
    version_read: int  # this server's version of the parameters the gradient was computed from
    version: int  # this server's version after the update
    staleness: int  # updates this server applied between the read and this update (0 when synchronous)
    lead: int  # steps the worker was ahead of the slowest active worker when it read (<= the bound s)


def shard_ranges(numel: int, parts: int) -> list[tuple[int, int]]:
    """``parts`` contiguous [start, stop) ranges covering ``numel`` elements, sizes at most one apart."""
    return [(i * numel // parts, (i + 1) * numel // parts) for i in range(parts)]


def _check_arguments(named, ctx, servers, staleness) -> None:
    world = ctx.world
    if ctx.pp_size > 1 or ctx.tp_size > 1:
        raise ValueError(f"ParameterServer runs data parallel only; the context has pp = {ctx.pp_size}, "
                         f"tp = {ctx.tp_size}: build it with init(pp=1, tp=1)")
    if not isinstance(servers, int) or not 1 <= servers < world.size:
        raise ValueError(f"ParameterServer: servers must be an integer in 1..{world.size - 1} (the world has "
                         f"{world.size} ranks and needs at least one worker), got {servers!r}; "
                         f"launch more ranks or lower servers")
    if not isinstance(staleness, int) or staleness < 0:
        raise ValueError(f"ParameterServer: staleness must be an integer >= 0, got {staleness!r}")
    dtypes = {p.dtype for _, p in named}
    if len(dtypes) != 1:
        raise ValueError(f"ParameterServer needs one parameter dtype, got {sorted(map(str, dtypes))}")


class ParameterServer(Checkpointable):
    """Split the world into workers and servers and run the parameter-server protocol between them.

    ``params``: ``model.named_parameters()`` on every rank (servers use only the shapes and
    rank 0's values); ``ctx``: the world's ParallelContext; ``optimizer_class`` and
    ``optimizer_options``: any hpcpar optimizer, instantiated on each server for its shard.
    ``master_dtype`` (None: the parameters' own) and ``scaler``: mixed precision (module docstring).
    """

    def __init__(self, params, ctx, optimizer_class, servers: int = 1, staleness: int = 0,
                 max_grad_norm: float = 0.0, no_decay=(), master_dtype=None, scaler=None, **optimizer_options):
        if scaler is not None and master_dtype is None:
            raise ValueError("ParameterServer: a loss scaler needs master_dtype (the dtype gradients are unscaled into)")
        items, given = flatten_groups(params)
        named = named_parameter_list(items)
        _check_arguments(named, ctx, servers, staleness)
        world = ctx.world
        self.names = [name for name, _ in named]
        self.params = [p for _, p in named]
        self.world_ctx = ctx  # checkpoints are collective over the whole world, servers included
        self.on_save = None  # on servers: on_save(step) writes this rank's part when the workers ask
        self.trace = NO_TRACE  # a Tracer records a server's rounds (and a worker's calls, through its communicators)
        self.numel = sum(p.size for p in self.params)
        if self.numel < servers:
            raise ValueError(f"ParameterServer: {self.numel} parameters cannot be split over {servers} servers")
        self.num_servers, self.num_workers = servers, world.size - servers
        self.staleness = staleness
        self.synchronous = staleness == 0
        self.max_grad_norm = float(max_grad_norm)
        self.ranges = shard_ranges(self.numel, servers)
        self.rank = world.rank
        self.is_worker = self.rank < self.num_workers
        self.server_index = None if self.is_worker else self.rank - self.num_workers
        xp = get_array_module(self.params[0].data)
        dtype = self.params[0].dtype
        self.mixed = master_dtype is not None  # masters on the servers, non-finite pushes not applied
        self.master_dtype = np.dtype(master_dtype) if self.mixed else dtype
        # Instantiated on every rank (on one element here): bad options fail everywhere, before any message.
        probe = optimizer_class([("probe", Parameter(xp.zeros(1, dtype=self.master_dtype)))], **optimizer_options)
        self.weight_decays = flat_range_decays(self.names, probe, given, no_decay)  # by name: groups, no_decay
        starts = list(itertools.accumulate((p.size for p in self.params), initial=0))
        self.spans = list(zip(starts[:-1], starts[1:]))  # each parameter's [start, stop) in the flat vector
        # A private communicator: these tags can never match someone else's messages on the world.
        # It, the group and the workers' context are ctx's to free (ParallelContext.adopt).
        self.comm = ctx.adopt(world.dup("ps"))
        flat = xp.empty(self.numel, dtype=dtype)
        self._pack_parameters(flat)
        self.comm.broadcast(flat, root=0)  # everyone starts from world rank 0's parameters
        group = ctx.adopt(world.split(0 if self.is_worker else 1, self.rank, "ps_group")).mpi
        self._stopped = False
        if self.is_worker:
            self._become_worker(ctx, group, flat, float(probe.lr), scaler)
            ctx.adopt(self.ctx)  # closed before the group it is made on
        else:
            self._become_server(world, group, flat, optimizer_class, optimizer_options)

    def _become_worker(self, ctx, group, flat, lr: float, scaler) -> None:
        self.ctx = init(dp=self.num_workers, comm=group, device=ctx.device, wait_policy=ctx.wait_policy,
                        backend=ctx.backend, runtime=ctx.runtime)  # the workers' dp: the job's backend
        self.server_comm = None
        self.lr = lr
        self.step_count = 0
        self.versions = [0] * self.num_servers  # per server: the version of the parameters this worker holds
        self.scaler, self.skipped_steps = scaler, 0
        self._flat = flat
        self._flat_grad = get_array_module(flat).zeros(self.numel, dtype=self.master_dtype)  # pushed: unscaled
        self._unpack_parameters()

    def _become_server(self, world, group, flat, optimizer_class, optimizer_options) -> None:
        self.ctx = None
        self.server_comm = Communicator(group, "ps_servers", cuda_aware=world.cuda_aware,
                                        wait_policy=world.wait_policy)
        start, stop = self.ranges[self.server_index]
        self.shard = Parameter(flat[start:stop].astype(self.master_dtype), name=f"ps_shard_{self.server_index}")
        self.optimizer = optimizer_class([("shard", self.shard)], **optimizer_options)
        self._set_shard_decay()
        self.version = 0
        self.update_log: list[UpdateRecord] = []

    # ----- what a training loop sees -----------------------------------------------------
    @property
    def max_staleness(self) -> int:
        """Largest staleness (in versions) in this server's log; 0 on workers and before any update."""
        return 0 if self.is_worker else max((r.staleness for r in self.update_log), default=0)

    @property
    def max_lead(self) -> int:
        """Largest lead (in steps) in this server's log: never above ``staleness``."""
        return 0 if self.is_worker else max((r.lead for r in self.update_log), default=0)

    def describe(self) -> str:
        mode = "synchronous" if self.synchronous else f"asynchronous, staleness bound {self.staleness} steps"
        sizes = sorted({stop - start for start, stop in self.ranges})
        masters = f", {self.master_dtype} masters and pushes" if self.mixed else ""
        return (f"parameter server: {self.num_workers} workers (ranks 0..{self.num_workers - 1}), "
                f"{self.num_servers} server(s) (ranks {self.num_workers}..{self.num_workers + self.num_servers - 1}) "
                f"holding {'/'.join(map(str, sizes))} of {self.numel} parameters each{masters}; {mode}")

    # ----- worker side -------------------------------------------------------------------
    def backward(self, loss) -> None:
        """``loss.backward()``, seeded with the loss scale when there is a scaler."""
        if self.scaler is None:
            loss.backward()
        else:
            scaled_backward(loss, self.scaler.scale)

    def push_pull(self, loss=None) -> bool:
        """Push this step's gradients (a missing one counts as zeros), pull fresh parameters, clear grads.

        Under mixed precision the gradients are pushed unscaled in ``master_dtype``, and a
        non-finite ``loss`` (this worker's, when given) or gradient marks the push not to be
        applied; returns whether the step counts as taken (always, without mixed precision).
        """
        self._require_worker("push_pull")
        self._pack_gradients()
        finite = self._agree_finite(loss) if self.mixed else True
        if self.max_grad_norm and not self.synchronous and finite:  # asynchronous: each worker's own gradient
            clip_arrays([self._flat_grad[start:stop] for start, stop in self.spans], self.max_grad_norm)
        kind = KIND_PUSH if finite else KIND_PUSH_NONFINITE
        sends = []
        for s, (start, stop) in enumerate(self.ranges):
            header = np.array([kind, self.step_count, self.versions[s], self.lr], dtype=np.float64)
            sends.append(self.comm.isend(header, self.num_workers + s, TAG_PUSH_HEADER))
            sends.append(self.comm.isend(self._flat_grad[start:stop], self.num_workers + s, TAG_PUSH_GRAD))
        self._receive_parameters(sends)
        self.step_count += 1
        for p in self.params:
            p.grad = None
        if self.scaler is not None:
            self.scaler.update(not finite)
        self.skipped_steps += not finite
        return finite

    step = push_pull  # ``ps.step()`` after backward reads like an optimizer

    def metrics(self) -> dict:
        """What a training log reports: under mixed precision the steps skipped so far."""
        return {"skipped_steps": self.skipped_steps} if self.mixed and self.is_worker else {}

    def _pack_gradients(self) -> None:
        """The gradients into the flat push buffer (``master_dtype``), divided by the loss scale."""
        for p, (start, stop) in zip(self.params, self.spans):
            self._flat_grad[start:stop] = 0 if p.grad is None else p.grad.reshape(-1)
        if self.scaler is not None:
            self._flat_grad *= 1.0 / self.scaler.scale

    def _agree_finite(self, loss) -> bool:
        """Whether this push may be applied: the loss and gradient are finite here and, when the
        servers step synchronously, on every worker (their scalers then take the same steps)."""
        bad = 0.0 if all_finite([self._flat_grad], loss) else 1.0
        if self.synchronous:
            bad = float(self.ctx.dp.allreduce(np.array([bad]), "max")[0])
        return bad == 0.0

    def _receive_parameters(self, sends) -> None:
        versions = [np.empty(1, dtype=np.int64) for _ in self.ranges]
        receives = []
        for s, (start, stop) in enumerate(self.ranges):
            receives.append(self.comm.irecv(versions[s], self.num_workers + s, TAG_REPLY_HEADER))
            receives.append(self.comm.irecv(self._flat[start:stop], self.num_workers + s, TAG_REPLY_PARAMS))
        wait_all(sends + receives)
        self.versions = [int(v[0]) for v in versions]
        self._unpack_parameters()

    # ----- server side -------------------------------------------------------------------
    def serve(self) -> None:
        """On a server: answer pushes and pulls until every worker has stopped. On a worker: return."""
        if self.is_worker or self._stopped:
            return
        loop = _ServerLoop(self)
        rounds = itertools.count(1)  # a round: answer every worker whose message is there
        while loop.active:
            ready = loop.ready_workers()
            if not ready:
                loop.idle()
                continue
            with self.trace.step(next(rounds), "round"):
                for w in ready:
                    loop.take_message(w)
                loop.apply_synchronous_round()
                loop.answer_pulls()
                loop.save_when_everyone_asked()
        loop.send_final_parameters()
        self._stopped = True

    def _apply(self, grad, lr: float, contributions: list[tuple]) -> None:
        """One optimizer step on the shard with ``grad``; log one record per contributing push."""
        with self.trace.span("optimizer", "optimizer", pushes=len(contributions)):
            self._step_shard(grad, lr)
        for worker, step, version_read, lead in contributions:
            self.update_log.append(UpdateRecord(worker, step, version_read, self.version + 1,
                                                self.version - version_read, lead))
        self.version += 1

    def _step_shard(self, grad, lr: float) -> None:
        self.shard.grad = grad
        if self.max_grad_norm and self.synchronous:  # the norm of the averaged gradient over all servers
            clip_arrays([self.shard.grad], self.max_grad_norm, allreduce_sum=self._sum_over_servers)
        self.optimizer.lr = lr
        self.optimizer.step()
        self.shard.grad = None

    def _sum_over_servers(self, value: float) -> float:
        if self.server_comm.size == 1:
            return value
        return float(self.server_comm.allreduce(np.array([value]), "sum")[0])

    def _send_parameters(self, worker: int) -> list:
        version = np.array([self.version], dtype=np.int64)
        # A copy in the model's dtype: the shard changes with the next update while the send may be in flight.
        return [self.comm.isend(version, worker, TAG_REPLY_HEADER),
                self.comm.isend(self.shard.data.astype(self.params[0].dtype), worker, TAG_REPLY_PARAMS)]

    # ----- both ----------------------------------------------------------------------------
    def shutdown(self) -> None:
        """Worker: tell every server it stopped and receive the final parameters. Server: ``serve()``."""
        if self._stopped:
            return
        if not self.is_worker:
            self.serve()
            return
        sends = []
        for s in range(self.num_servers):
            header = np.array([KIND_STOP, self.step_count, self.versions[s], self.lr], dtype=np.float64)
            sends.append(self.comm.isend(header, self.num_workers + s, TAG_PUSH_HEADER))
        self._receive_parameters(sends)
        self._stopped = True

    def _require_worker(self, what: str) -> None:
        if not self.is_worker:
            raise RuntimeError(f"ParameterServer.{what}: world rank {self.rank} is a server (the last "
                               f"{self.num_servers} ranks are); call it on workers only (ps.is_worker)")
        if self._stopped:
            raise RuntimeError(f"ParameterServer.{what}: this worker has already shut down")

    # ----- checkpoints ----------------------------------------------------------------------
    def save_checkpoint(self, step: int, write) -> None:
        """Worker: ask every server to join a checkpoint of ``step``, then ``write()`` (collective
        over the world). A server joins when every active worker has asked, between updates, by
        calling its ``on_save(step)``; the parameters and optimizer state it saves are then those
        after every push up to this step."""
        self._require_worker("save_checkpoint")
        sends = [self.comm.isend(np.array([KIND_SAVE, step, self.versions[s], self.lr], dtype=np.float64),
                                 self.num_workers + s, TAG_PUSH_HEADER) for s in range(self.num_servers)]
        write()
        wait_all(sends)

    def flat_range_slabs(self) -> list | None:
        """On a server: its range of the flattened parameters cut into slabs of the global tensors."""
        if self.is_worker:
            return None
        start, stop = self.ranges[self.server_index]
        return list(range_param_slabs(self.names, self.params, [a for a, _ in self.spans], start, stop))

    def checkpoint_pieces(self) -> tuple[list, dict]:
        """What this rank saves: a server its range of the parameters and its optimizer state (the
        authoritative copies: workers may hold older parameters), a worker nothing."""
        slabs = self.flat_range_slabs()
        if slabs is None:
            return [], {}
        model = [Piece(f"model/{name}", shape, glob, self.shard.data[offset: offset + math.prod(local)].reshape(local))
                 for name, _, shape, glob, local, offset in slabs]
        state, scalars = flat_state_pieces(slabs, self.optimizer.state.get("shard", {}))
        return model + state, scalars | weight_decay_scalars(self.weight_decays)

    def _set_shard_decay(self) -> None:
        start, stop = self.ranges[self.server_index]
        set_flat_range_decay(self.optimizer, self.names, [p.size for p in self.params], self.weight_decays,
                             start, stop)

    def named_weight_decays(self) -> dict:
        """{parameter name: weight decay} of every parameter (the same on workers and servers)."""
        return dict(self.weight_decays)

    def load_weight_decays(self, decays: dict) -> None:
        """Set the weight decay of the named parameters (a checkpoint's groups); servers' runs follow."""
        self.weight_decays.update({name: float(v) for name, v in decays.items() if name in self.weight_decays})
        if not self.is_worker:
            self._set_shard_decay()

    def load_plan(self, saved: Saved) -> LoadPlan:
        """A worker reads the whole model into its parameters (then its flat copy); a server its range
        of the parameters straight into its shard (the masters keep the saved precision) and its
        optimizer state; every rank takes the saved weight decays."""
        if self.is_worker:
            plan = parameter_load_plan(zip(self.names, self.params))
            plan.finish.append(lambda: self._pack_parameters(self._flat))
        else:
            slabs = self.flat_range_slabs()
            plan = LoadPlan([Read(f"model/{name}", shape, glob, self._into_shard(offset))
                             for name, _, shape, glob, _, offset in slabs])
            plan.extend(flat_state_load_plan(saved, slabs, self.shard,
                                             lambda state: self.optimizer.state.__setitem__("shard", state)))
        decays = saved.weight_decays()
        plan.finish.append(lambda: self.load_weight_decays(decays))
        return plan

    def _into_shard(self, offset: int):
        def assign(values):  # run only once every rank has read every slab (hpcpar.state)
            self.shard.data[offset: offset + values.size] = to_device(values.reshape(-1), self.shard.xp)
        return assign

    def _save_when_asked(self, saving: dict) -> None:
        steps = sorted(set(saving.values()))
        if len(steps) != 1:
            raise RuntimeError(f"parameter server {self.server_index}: workers asked to save different steps {steps}")
        if self.on_save is None:
            raise RuntimeError(f"parameter server {self.server_index}: the workers asked for a checkpoint, but "
                               f"no on_save(step) is set on the servers")
        self.on_save(steps[0])
        saving.clear()

    def _pack_parameters(self, flat) -> None:
        for p, (start, stop) in zip(self.params, self.spans):
            flat[start:stop] = p.data.reshape(-1)

    def _unpack_parameters(self) -> None:
        for p, (start, stop) in zip(self.params, self.spans):
            p.data[...] = self._flat[start:stop].reshape(p.shape)


class _ServerLoop:
    """One server's state while it serves: the messages in flight and what each worker has done.

    Each worker's next push header is always posted (``headers_in``); a push's gradient is
    received right after its header. Synchronous servers collect one gradient per active worker
    (``arrived``) before they step; asynchronous ones step on each. A pull (the worker waiting
    for parameters of its next step) is answered when the staleness bound allows.
    """

    def __init__(self, server: ParameterServer):
        self.server, self.comm = server, server.comm
        workers = server.num_workers
        xp = get_array_module(server.shard.data)
        self.headers = np.zeros((workers, HEADER_LENGTH), dtype=np.float64)
        self.grads = xp.zeros((workers if server.synchronous else 1, server.shard.size), dtype=server.shard.dtype)
        self.headers_in = {w: self.comm.irecv(self.headers[w], w, TAG_PUSH_HEADER) for w in range(workers)}
        self.done = [0] * workers  # steps whose gradient this server has received, per worker
        self.lead = [0] * workers  # per worker: its lead over the slowest when it read its current parameters
        self.active = set(range(workers))
        self.waiting: dict[int, int] = {}  # worker -> the step it waits for parameters for
        self.arrived: dict[int, tuple] = {}  # synchronous: this round's pushes, worker -> (step, version read, lr)
        self.saving: dict[int, int] = {}  # workers that asked for a checkpoint -> its step
        self.sends: list = []

    def ready_workers(self) -> list[int]:
        return sorted(w for w, handle in self.headers_in.items() if handle.test())

    def idle(self) -> None:
        """Nothing arrived: free finished sends and, oversubscribed, give the core away."""
        self.sends = [h for h in self.sends if not h.test()]
        if self.comm.wait_policy == "yield":
            time.sleep(YIELD_SLEEP_S)

    def take_message(self, w: int) -> None:
        del self.headers_in[w]
        kind, step, version_read, lr = self.headers[w]
        if kind == KIND_STOP:
            self.active.discard(w)
            return
        if kind == KIND_SAVE:  # the worker now waits in the checkpoint; its next push follows it
            self.saving[w] = int(step)
        else:
            self._take_push(w, int(step), int(version_read), float(lr), applies=kind == KIND_PUSH)
        self.headers_in[w] = self.comm.irecv(self.headers[w], w, TAG_PUSH_HEADER)

    def _take_push(self, w: int, step: int, version_read: int, lr: float, applies: bool) -> None:
        server = self.server
        if step != self.done[w]:
            raise RuntimeError(f"parameter server {server.server_index}: worker {w} pushed step {step}, "
                               f"expected step {self.done[w]}")
        grad = self.grads[w] if server.synchronous else self.grads[0]
        self.comm.recv(grad, w, TAG_PUSH_GRAD)
        self.done[w] = self.waiting[w] = step + 1
        if server.synchronous:
            self.arrived[w] = (step, version_read, lr, applies)
        elif applies:  # asynchronous: a push marked non-finite is dropped alone
            grad /= server.num_workers
            server._apply(grad, lr, [(w, step, version_read, self.lead[w])])

    def apply_synchronous_round(self) -> None:
        """Once every active worker's gradient is in: their mean (in worker order), one step; no step
        when any push is marked non-finite (every server sees the same marks and skips the round)."""
        if not self.arrived or not self.active <= set(self.arrived):
            return
        if not all(applies for *_, applies in self.arrived.values()):
            self.arrived.clear()
            return
        order = sorted(self.arrived)
        mean = self.grads[order[0]].copy()
        for w in order[1:]:
            mean += self.grads[w]
        mean /= len(order)
        lr = self.arrived[order[0]][2]
        self.server._apply(mean, lr, [(w, *self.arrived[w][:2], self.lead[w]) for w in order])
        self.arrived.clear()

    def answer_pulls(self) -> None:
        """The pulls the staleness bound allows: the slowest active worker at most s steps behind."""
        slowest = min((self.done[w] for w in self.active), default=math.inf)
        for w, step in list(self.waiting.items()):
            if slowest >= step - self.server.staleness:
                self.lead[w] = step - slowest
                self.sends += self.server._send_parameters(w)
                del self.waiting[w]

    def save_when_everyone_asked(self) -> None:
        if self.saving and self.active <= set(self.saving) and not self.arrived and not self.waiting:
            self.server._save_when_asked(self.saving)

    def send_final_parameters(self) -> None:
        """Every worker stopped: all receive the final parameters."""
        for w in range(self.server.num_workers):
            self.sends += self.server._send_parameters(w)
        wait_all(self.sends)
