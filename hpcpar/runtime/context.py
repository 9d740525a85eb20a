"""ParallelContext: the grid of ranks (``grid.py``'s axes) and its communicators, as a value.

``init`` sets the process up (``process.setup``) and then builds the grid on it (``build``).
For 8 ranks as dp=2, pp=2, tp=2 (tp fastest, then dp, then pp)::

    world rank   0  1  2  3  4  5  6  7
    pp (stage)   0  0  0  0  1  1  1  1
    dp (replica) 0  0  1  1  0  0  1  1
    tp (shard)   0  1  0  1  0  1  0  1

    tp groups: {0,1} {2,3} {4,5} {6,7}      dp groups: {0,2} {1,3} {4,6} {5,7}
    pp groups: {0,4} {1,5} {2,6} {3,7}      (ranks 0 and 4 hold stages 0 and 1 of replica 0, shard 0)

Nothing here is global: ``init`` returns a context that is passed to whatever needs it.
"""
from __future__ import annotations

import itertools
import weakref
from dataclasses import dataclass, field

from mpi4py import MPI

from .. import backend as arrays
from . import topology as _topology
from .comm import Communicator
from .grid import GRID, LayoutError, Mesh, coordinates, format_grid, resolve_layout
from .process import Process, agreed, agreed_backend, agreed_device, process_settings, setup
from .shm import MIN_BYTES, ShmCollectives

__all__ = ["LayoutError", "ParallelContext", "agreed", "agreed_backend", "agreed_device", "build", "coordinates",
           "format_grid", "init", "open_contexts", "process_settings", "resolve_layout", "single_process"]

# The contexts init made and nobody closed (weakly: a dropped context is simply forgotten).
_open: "weakref.WeakSet[ParallelContext]" = weakref.WeakSet()
_serials = itertools.count()


class _FromProcess:
    """An attribute of the context that is its process's (``Process``)."""

    def __set_name__(self, owner, name):
        self.name = name

    def __get__(self, ctx, owner=None):
        return self if ctx is None else getattr(ctx.process, self.name)


@dataclass(eq=False)  # identity: contexts are kept in a weak set
class ParallelContext:
    """This rank's place in the grid and the communicators along each axis.

    Per axis of the mesh (dp, pp, tp), ``ctx.<axis>`` is its communicator, ``ctx.<axis>_size``
    its size and ``ctx.<axis>_rank`` this rank's coordinate along it; ``across`` gives the
    communicator of a product of axes."""

    world: Communicator
    mesh: Mesh  # the axes, their sizes and the rank order
    axes: dict  # {axis name: Communicator}, in table order
    node: Communicator  # the ranks of this node (MPI_COMM_TYPE_SHARED): the shared-memory domain
    process: Process  # what the process setup found (device, backend, node, placement)
    grid: MPI.Comm | None = None  # the cartesian communicator the axes are slices of
    pp_prev: int | None = None  # rank in ``pp`` of the previous stage (None on the first stage)
    pp_next: int | None = None  # rank in ``pp`` of the next stage (None on the last stage)
    shm: bool = False  # the shared-memory collectives are attached (hpcpar.runtime.shm)
    closed: bool = False
    serial: int = 0  # order of creation in this process
    adopted: list = field(default_factory=list, repr=False)  # what ``close`` closes first, newest first (``adopt``)
    products: dict = field(default_factory=dict, repr=False)  # {axis names: Communicator} made by ``across``
    experts: dict = field(default_factory=dict, repr=False)  # {ep: (ep, edp) Communicators} made by ``expert_groups``

    device = _FromProcess()  # "cpu" or "cuda"
    cuda_aware = _FromProcess()
    wait_policy = _FromProcess()
    node_rank = _FromProcess()  # node-local rank: picks the GPU
    node_size = _FromProcess()
    node_cpus = _FromProcess()  # CPUs the node's ranks may run on (affinity and cgroup quota)
    topology = _FromProcess()  # the node of every world rank
    host = _FromProcess()  # what init changed in the process (hpcpar.host.apply)
    shm_node_size = _FromProcess()  # pretend nodes of this many ranks for the shared-memory collectives
    backend = _FromProcess()  # what moves device buffers on the axes: "mpi" or "nccl" (hpcpar.runtime.nccl)
    runtime = _FromProcess()  # the NCCL runtime when backend is "nccl" (contexts made from this one reuse it)

    def __getattr__(self, name: str):
        """``dp``, ``dp_size``, ``dp_rank`` and so on for every axis of the mesh."""
        mesh = self.__dict__.get("mesh")
        axis, _, what = name.rpartition("_") if name.endswith(("_size", "_rank")) else (name, "", "")
        if mesh is None or axis not in mesh.names:
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        if what == "size":
            return mesh.size(axis)
        return mesh.coordinate(self.world.rank, axis) if what == "rank" else self.axes[axis]

    def across(self, *names: str) -> Communicator:
        """The communicator of the product of the axes ``names`` (``across("dp", "tp")``: the ranks
        that differ only in dp and tp), one axis's own for one name. Made on first use and freed
        by ``close``: the first call for a product is collective over the world."""
        key = tuple(name for name in self.mesh.names if name in names)
        if len(key) != len(set(names)) or not key:
            raise ValueError(f"across: the axes must be among {self.mesh.names}, got {names}")
        if len(key) == 1:
            return self.axes[key[0]]
        if key not in self.products:
            remain = [name in key for name in self.mesh.table.rank_order]
            self.products[key] = self.process.axis_communicator(self.grid.Sub(remain), "*".join(key))
        return self.products[key]

    @property
    def dp_cp(self) -> Communicator:
        """The ranks whose gradients are averaged: dp, times cp when cp splits the sequence (each cp
        rank's gradient is its chunks' share of the replica's); ``dp`` itself at cp = 1. ZeRO shards
        over it, and losses are averaged over it (Megatron's data-parallel group with context parallelism)."""
        return self.across("dp", "cp") if self.mesh.size("cp") > 1 else self.axes["dp"]

    @property
    def crossing_axes(self) -> list[str]:
        """The axes (fastest first) some of whose communicators span more than one node."""
        return _topology.crossing_axes(self.topology, self.mesh)

    def placement_report(self) -> str:
        """The nodes and, per communicator, whether it crosses nodes (every rank can print it)."""
        return _topology.report(self.topology, self.mesh)

    @property
    def xp(self):
        return arrays.array_module(self.device)

    @property
    def rank(self) -> int:
        return self.world.rank

    @property
    def world_size(self) -> int:
        return self.world.size

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    @property
    def layout(self) -> dict:
        """{axis: size, "world": n}, a suffix axis (cp) only above 1: what a checkpoint records."""
        return {**{k: v for k, v in self.mesh.by_name().items() if self.mesh.shown(k)}, "world": self.world_size}

    def communicators(self) -> dict:
        experts = {comm.name: comm for pair in self.experts.values() for comm in pair}
        return {"world": self.world, **self.axes, **{comm.name: comm for comm in self.products.values()}, **experts}

    def expert_group(self) -> Communicator | None:
        """The ep group of ``expert_groups`` with ep > 1 made for this context (None: no expert parallelism)."""
        return next((group for ep, (group, _) in self.experts.items() if ep > 1), None)

    def expert_groups(self, ep: int) -> tuple[Communicator, Communicator]:
        """(ep, edp): expert parallelism's groups, carved out of dp. dp rank d is rank d % ep of the
        ep group d // ep (consecutive dp ranks, the closest ones: tokens cross it in every MoE
        block); edp holds the dp ranks with the same d % ep, which hold the same experts and
        average their gradients (DeepSpeed's expert-data-parallel group). Made on first use
        (collective over dp) and freed by ``close``."""
        if ep not in self.experts:
            dp = self.axes["dp"]
            if ep < 1 or dp.size % ep:
                raise LayoutError(f"ep = {ep} does not divide dp = {dp.size}: expert groups are carved out of dp")
            group = dp.split(dp.rank // ep, dp.rank % ep, "ep" if ep > 1 else "ep1")
            replicas = dp.split(dp.rank % ep, dp.rank // ep, "edp")
            self.experts[ep] = (group, replicas)
        return self.experts[ep]

    def comm_seconds(self) -> float:
        """Seconds spent in communication so far, on all of this rank's communicators."""
        return sum(comm.stats.total_seconds for comm in self.communicators().values())

    def layer_comm_seconds(self) -> float:
        """Seconds spent in the communication inside layers so far: tp's collectives, cp's ring, ep's all-to-alls."""
        return (self.axes["tp"].stats.total_seconds + self.axes["cp"].stats.total_seconds
                + sum(group.stats.total_seconds for group, _ in self.experts.values()))

    def reset_stats(self) -> None:
        for comm in self.communicators().values():
            comm.stats.reset()

    def shm_description(self) -> str:
        """Whether the shared-memory collectives are on, and with which nodes (hpcpar.runtime.shm)."""
        if not self.shm:
            return f"off (HPCPAR_SHM=0, parallel.shm = false or init(shm=False); CPUs only, device {self.device})"
        nodes = f"pretend nodes of {self.shm_node_size} ranks" if self.shm_node_size else "real nodes"
        return f"on ({nodes}; collectives under {MIN_BYTES >> 10} KiB use MPI)"

    def adopt(self, owned):
        """Own ``owned`` and close it in ``close``; returns it. ``owned``: a Communicator derived
        from this context's (``split``, ``dup``), a context made on one of them, or None (a rank
        outside a split: nothing to own). Strategies hand over what they derive, so it lives as
        long as the context and no longer, whether or not the strategy object is still around
        (it is never freed on garbage collection: freeing is collective). Adopt in the same order
        on every rank of a derived communicator, as you made it; ``close`` goes newest first, so
        a context closes before the communicator it was made on."""
        if self.closed:
            raise RuntimeError(f"adopt: context {self.serial} is closed; {owned!r} would never be freed")
        if owned is not None:
            self.adopted.append(owned)
        return owned

    def close(self) -> None:
        """Free what ``init`` made and what the context adopted: the adopted communicators and
        contexts (newest first), then the shared-memory windows and the communicators of the axes,
        their products, the node and the grid (collective over the world: every rank closes its contexts in the same
        order). MPI has a few thousand communicator ids per process; a program that builds
        many contexts (``hpcpar compare``'s layouts, a test suite) closes the ones it is done
        with. The context, what it adopted, and every buffer in its windows must no longer be
        used; the world communicator is the caller's and stays. A second call does nothing."""
        if self.closed:
            return
        self.closed = True
        while self.adopted:
            self.adopted.pop().close()
        for pair in reversed(list(self.experts.values())):
            for communicator in reversed(pair):
                communicator.close()
        if self.world.shm is not None:
            self.world.shm.close()
        for communicator in [*self.axes.values(), *self.products.values(), self.node]:
            communicator.close()
        if self.grid is not None and self.grid != MPI.COMM_NULL:
            self.grid.Free()
        _open.discard(self)

    def grid_table(self) -> str:
        """The whole grid as text (every rank can print it without communicating)."""
        return self.mesh.format()


def build(process: Process, mesh: Mesh) -> ParallelContext:
    """The context of ``mesh`` on the ranks of ``process.world`` (collective): a communicator per
    axis, sliced from one cartesian communicator whose dimensions are the rank order, so MPI's
    row-major numbering puts the ranks exactly where ``mesh.coordinates`` says."""
    world = process.world
    if world.Get_rank() == 0:
        _topology.warn_about_placement(process.topology, mesh)
    order = mesh.table.rank_order
    cart = world.Create_cart([mesh.size(name) for name in order], periods=[False] * len(order), reorder=False)
    placed = dict(zip(order, cart.Get_coords(cart.Get_rank())))
    assert tuple(placed[name] for name in mesh.table.spelt_order) == mesh.coordinates(world.Get_rank())
    slices = {name: cart.Sub([other == name for other in order]) for name in mesh.names}
    prev_stage, next_stage = slices["pp"].Shift(0, 1) if "pp" in slices else (MPI.PROC_NULL, MPI.PROC_NULL)
    ctx = ParallelContext(world=process.communicator(world, "world"), mesh=mesh,
                          axes={name: process.axis_communicator(mpi, name) for name, mpi in slices.items()},
                          node=process.communicator(process.node, "node"), process=process, grid=cart,
                          pp_prev=None if prev_stage == MPI.PROC_NULL else prev_stage,
                          pp_next=None if next_stage == MPI.PROC_NULL else next_stage, serial=next(_serials))
    _open.add(ctx)
    ctx.dp_cp  # made now, collectively, so that later first uses on some ranks only cannot hang
    if process.shm_color is not None:
        ctx.shm = True
        for communicator in ctx.communicators().values():
            if communicator.size > 1:
                communicator.shm = ShmCollectives(communicator, process.shm_color)
    return ctx


def init(*sizes, device: str = "auto", comm: MPI.Comm | None = None, **options) -> ParallelContext:
    """Factor the world (``comm``, default COMM_WORLD) into the grid and build its communicators.

    ``sizes``: the axes' sizes (``GRID``: dp, pp, tp) in table order or by name, as
    ``AxisTable.resolve`` takes them (dp, unset, fills the world). Raises LayoutError on every
    rank, before any communication, when the layout does not fit. Then ``process.setup`` (the
    other ``options``: ``wait_policy``, ``tune_allocator``, ``shm``, ``node_size``, ``backend``,
    ``device_nonblocking``, ``runtime``, ``fail_fast``, described there) and ``build`` (rank 0
    warns, PlacementWarning, when tensor parallelism crosses nodes but would fit inside them).
    """
    world = comm if comm is not None else MPI.COMM_WORLD
    mesh = GRID.resolve(world.Get_size(), *sizes, **{name: options.pop(name) for name in GRID.names if name in options})
    return build(setup(world, device, **options), mesh)


def open_contexts() -> list:
    """The contexts ``init`` made that are not closed yet, oldest first (tests close theirs)."""
    return sorted(_open, key=lambda ctx: ctx.serial)


def single_process(device: str = "cpu") -> ParallelContext:
    """A 1 x 1 x 1 context on COMM_SELF, for serial runs and reference answers."""
    return init(1, 1, 1, device=device, comm=MPI.COMM_SELF)
