"""Parameter server: the last S ranks of the world hold the parameters in shards and run the
optimizer on them; the first W = N - S (the workers) compute gradients, push them and pull fresh
parameters. Here: its construction and the worker side (``server``: the server's loop; ``protocol``:
the messages; docs/architecture.md, "The parameter server": the design). Data parallel, one dtype.

    ctx = hpcpar.init()                         # mpiexec -n 4: workers 0, 1, 2 and server 3
    ps = ParameterServer(model.named_parameters(), ctx, AdamW, servers=1, staleness=0, lr=3e-4)
    ps.serve()                                  # server ranks: serve until every worker stopped
    if ps.is_worker:
        for step in range(steps):
            ids, targets = batch(step, ps.ctx.dp_rank, ps.ctx.dp_size)   # ps.ctx: the workers only
            model.loss(ids, targets).backward()
            ps.push_pull()                      # gradient slices out, fresh parameter slices in
    ps.shutdown()                               # workers: stop message, receive the final parameters
"""
from __future__ import annotations

import itertools
import math

import numpy as np

from ...autograd import Parameter
from ...backend import get_array_module, to_device
from ...runtime.comm import Communicator, wait_all
from ...runtime.context import init
from ...runtime.trace import NO_TRACE
from ...optim.amp import scaled_backward
from ...optim.finite import GRADIENTS, StepHealth, check_step
from ...optim.clip import clip_arrays
from ...optim.groups import flat_range_decays, flatten_groups, set_flat_range_decay
from ...optim.optimizer import named_parameter_list
from ...state import (Checkpointable, LoadPlan, Piece, Read, Saved, flat_state_load_plan, flat_state_pieces,
                     parameter_load_plan, range_param_slabs, weight_decay_scalars)
from .protocol import (KIND_PUSH, KIND_PUSH_NONFINITE, KIND_SAVE, KIND_STOP, TAG_PUSH_GRAD, TAG_PUSH_HEADER,
                          TAG_REPLY_HEADER, TAG_REPLY_PARAMS, UpdateRecord, shard_ranges)
from .server import ServerSide


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


class ParameterServer(ServerSide, Checkpointable):
    """Split the world into workers and servers and run the parameter-server protocol between them.

    ``params``: ``model.named_parameters()`` on every rank (servers use only the shapes and
    rank 0's values); ``ctx``: the world's ParallelContext; ``optimizer_class`` and
    ``optimizer_options``: any hpcpar optimizer, instantiated on each server for its shard.
    ``master_dtype`` (None: the parameters' own) and ``scaler``: mixed precision
    (docs/architecture.md, "The parameter server").
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
        # The workers' dp communicates as the world's context does: backend, shared memory, device buffers.
        self.ctx = init(dp=self.num_workers, comm=group, device=ctx.device, wait_policy=ctx.wait_policy,
                        backend=ctx.backend, runtime=ctx.runtime, shm=ctx.shm, node_size=ctx.shm_node_size,
                        device_nonblocking=ctx.world.device_nonblocking)
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

    def push_pull(self, loss=None) -> StepHealth:
        """Push this step's gradients (a missing one counts as zeros), pull fresh parameters, clear grads.

        Under mixed precision the gradients are pushed unscaled in ``master_dtype``. A non-finite
        ``loss`` (this worker's, when given) or gradient marks the push not to be applied;
        returns the step's health (``optim.finite``).
        """
        self._require_worker("push_pull")
        self._pack_gradients()
        health = self._agree_health(loss)
        finite = health.taken
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
        return health

    step = push_pull  # ``ps.step()`` after backward reads like an optimizer

    def metrics(self) -> dict:
        """What a training log reports: under mixed precision a worker's steps skipped so far (the
        loss scaler's count, saved with it; the run's own count of non-finite steps is the loop's)."""
        return {"skipped_steps": self.skipped_steps} if self.mixed and self.is_worker else {}

    def _pack_gradients(self) -> None:
        """The gradients into the flat push buffer (``master_dtype``), divided by the loss scale."""
        for p, (start, stop) in zip(self.params, self.spans):
            self._flat_grad[start:stop] = 0 if p.grad is None else p.grad.reshape(-1)
        if self.scaler is not None:
            self._flat_grad *= 1.0 / self.scaler.scale

    def _agree_health(self, loss) -> StepHealth:
        """Whether this push may be applied: the loss and gradient are finite here and, when the
        servers step synchronously, on every worker (their scalers then take the same steps).
        A non-finite gradient with a finite loss under a loss scaler is its overflow."""
        agree = (lambda bad: float(self.ctx.dp.allreduce(np.array([bad]), "max")[0])) if self.synchronous else None
        health = check_step(loss, [("flat gradient", self._flat_grad)], agree=agree)
        if self.scaler is not None and health.nonfinite == GRADIENTS:
            return StepHealth(GRADIENTS, overflow=True)
        return health

    def _receive_parameters(self, sends) -> None:
        versions = [np.empty(1, dtype=np.int64) for _ in self.ranges]
        receives = []
        for s, (start, stop) in enumerate(self.ranges):
            receives.append(self.comm.irecv(versions[s], self.num_workers + s, TAG_REPLY_HEADER))
            receives.append(self.comm.irecv(self._flat[start:stop], self.num_workers + s, TAG_REPLY_PARAMS))
        wait_all(sends + receives)
        self.versions = [int(v[0]) for v in versions]
        self._unpack_parameters()

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
                                             lambda state: self.optimizer.state.__setitem__("shard", state),
                                             current=self.optimizer.state.get("shard")))
        decays = saved.weight_decays()
        plan.finish.append(lambda: self.load_weight_decays(decays))
        return plan

    def _into_shard(self, offset: int):
        def assign(values):  # run only once every rank has read every slab (hpcpar.state)
            self.shard.data[offset: offset + values.size] = to_device(values.reshape(-1), self.shard.xp)
        return assign

    def _pack_parameters(self, flat) -> None:
        for p, (start, stop) in zip(self.params, self.spans):
            flat[start:stop] = p.data.reshape(-1)

    def _unpack_parameters(self) -> None:
        for p, (start, stop) in zip(self.params, self.spans):
            p.data[...] = self._flat[start:stop].reshape(p.shape)
