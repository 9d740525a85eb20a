"""ParallelContext: the dp x pp x tp grid of ranks and its communicators, as a value.

Rank order is tp fastest, then dp, then pp, so tensor-parallel peers (which talk inside
every layer) are neighbours and share a node, and a pipeline stage is a contiguous block::

    world rank = pp_rank * (dp * tp) + dp_rank * tp + tp_rank

For 8 ranks as dp=2, pp=2, tp=2::

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

from .. import backend as arrays, host, log
from . import failfast, nccl, nodes
from . import topology as _topology
from .shm import MIN_BYTES, ShmCollectives, shm_setting
from .comm import Communicator, default_wait_policy
from .device_transport import query_cuda_aware
from .watchdog import answer_at_exit


logger = log.get_logger(__name__)


# The contexts init made and nobody closed (weakly: a dropped context is simply forgotten).
_open: "weakref.WeakSet[ParallelContext]" = weakref.WeakSet()
_serials = itertools.count()


class LayoutError(ValueError):
    """The requested dp x pp x tp layout does not fit the world."""


def resolve_layout(world_size: int, dp: int | None = None, pp: int = 1, tp: int = 1) -> tuple[int, int, int]:
    """Return (dp, pp, tp) whose product is ``world_size``, or raise LayoutError naming the numbers.

    Pure arithmetic on the world size, so every rank reaches the same verdict without waiting.
    """
    for name, value in (("pp", pp), ("tp", tp)) + ((("dp", dp),) if dp is not None else ()):
        if not isinstance(value, int) or value < 1:
            raise LayoutError(f"{name} must be a positive integer, got {value!r}")
    if dp is None:
        if world_size % (pp * tp):
            raise LayoutError(
                f"world size {world_size} is not divisible by pp x tp = {pp} x {tp} = {pp * tp}; "
                f"launch a multiple of {pp * tp} ranks or change pp/tp")
        dp = world_size // (pp * tp)
    if dp * pp * tp != world_size:
        raise LayoutError(
            f"dp x pp x tp = {dp} x {pp} x {tp} = {dp * pp * tp} does not equal the world size {world_size}; "
            f"launch {dp * pp * tp} ranks or leave dp unset to fill the world")
    return dp, pp, tp


@dataclass(eq=False)  # identity: contexts are kept in a weak set
class ParallelContext:
    """This rank's place in the grid and the communicators along each axis."""

    world: Communicator
    dp: Communicator
    pp: Communicator
    tp: Communicator
    dp_size: int
    pp_size: int
    tp_size: int
    dp_rank: int
    pp_rank: int
    tp_rank: int
    pp_prev: int | None  # rank in ``pp`` of the previous stage (None on the first stage)
    pp_next: int | None  # rank in ``pp`` of the next stage (None on the last stage)
    node_rank: int  # node-local rank: picks the GPU
    node_size: int
    device: str  # "cpu" or "cuda"
    cuda_aware: bool
    wait_policy: str
    node: Communicator  # the ranks of this node (MPI_COMM_TYPE_SHARED): the shared-memory domain
    topology: _topology.Topology  # the node of every world rank
    node_cpus: int = 1  # CPUs the node's ranks may run on (affinity and cgroup quota)
    host: dict = field(default_factory=dict)  # what init changed in the process (hpcpar.host.apply)
    shm: bool = False  # the shared-memory collectives are attached (hpcpar.runtime.shm)
    shm_node_size: int | None = None  # pretend nodes of this many ranks for them (None: real nodes)
    backend: str = "mpi"  # what moves device buffers on dp, pp and tp: "mpi" or "nccl" (hpcpar.runtime.nccl)
    runtime: object = None  # the NCCL runtime when backend is "nccl" (contexts made from this one reuse it)
    grid: MPI.Comm | None = None  # the cartesian communicator dp, pp and tp are slices of
    closed: bool = False
    serial: int = 0  # order of creation in this process
    adopted: list = field(default_factory=list, repr=False)  # what ``close`` closes first, newest first (``adopt``)

    @property
    def crossing_axes(self) -> list[str]:
        """The axes (tp, dp, pp) some of whose communicators span more than one node."""
        return _topology.crossing_axes(self.topology, self.dp_size, self.pp_size, self.tp_size)

    def placement_report(self) -> str:
        """The nodes and, per communicator, whether it crosses nodes (every rank can print it)."""
        return _topology.report(self.topology, self.dp_size, self.pp_size, self.tp_size)

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
        return {"dp": self.dp_size, "pp": self.pp_size, "tp": self.tp_size, "world": self.world_size}

    def communicators(self) -> dict:
        return {"world": self.world, "dp": self.dp, "pp": self.pp, "tp": self.tp}

    def comm_seconds(self) -> float:
        """Seconds spent in communication so far, on all of this rank's communicators."""
        return sum(comm.stats.total_seconds for comm in self.communicators().values())

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
        contexts (newest first), then the shared-memory windows and the dp, pp, tp, node and grid
        communicators (collective over the world: every rank closes its contexts in the same
        order). MPI has a few thousand communicator ids per process; a program that builds
        many contexts (``hpcpar compare``'s layouts, a test suite) closes the ones it is done
        with. The context, what it adopted, and every buffer in its windows must no longer be
        used; the world communicator is the caller's and stays. A second call does nothing."""
        if self.closed:
            return
        self.closed = True
        while self.adopted:
            self.adopted.pop().close()
        if self.world.shm is not None:
            self.world.shm.close()
        for communicator in (self.dp, self.pp, self.tp, self.node):
            communicator.close()
        if self.grid is not None and self.grid != MPI.COMM_NULL:
            self.grid.Free()
        _open.discard(self)

    def grid_table(self) -> str:
        """The whole grid as text (every rank can print it without communicating)."""
        return format_grid(self.dp_size, self.pp_size, self.tp_size)


def coordinates(world_rank: int, dp: int, pp: int, tp: int) -> tuple[int, int, int]:
    """(pp_rank, dp_rank, tp_rank) of a world rank: tp fastest, then dp, then pp."""
    return world_rank // (dp * tp), (world_rank // tp) % dp, world_rank % tp


def format_grid(dp: int, pp: int, tp: int) -> str:
    size = dp * pp * tp
    ranks = range(size)
    width = max(2, len(str(size - 1)))
    rows = [("world rank", list(ranks))]
    coords = [coordinates(r, dp, pp, tp) for r in ranks]
    rows += [("pp (stage)", [c[0] for c in coords]), ("dp (replica)", [c[1] for c in coords]),
             ("tp (shard)", [c[2] for c in coords])]
    return "\n".join(f"{label:<13}" + " ".join(f"{v:>{width}}" for v in values) for label, values in rows)


def agreed(comm: MPI.Comm, setting: str, find, advice: str) -> str:
    """``find()`` (what ``setting`` means here: the device, the backend) as every rank of ``comm``
    found it (one small all-gather). Each rank answers on its own node (its GPUs, CuPy, NCCL,
    ``HPCPAR_DEVICE``): when any rank raised DeviceError, or the ranks found different answers,
    every rank raises the same DeviceError naming the ranks. A rank that raised alone left the
    others waiting in init's first collective forever, and ranks that went on with different
    devices or backends would call different communication (collective)."""
    try:
        mine = (find(), None, MPI.Get_processor_name())
    except arrays.DeviceError as error:
        mine = (None, str(error), MPI.Get_processor_name())
    everyone = comm.allgather(mine) if comm.Get_size() > 1 else [mine]
    hosts = [host for _, _, host in everyone]
    failed = [rank for rank, (_, error, _) in enumerate(everyone) if error is not None]
    if failed:
        alone = len(failed) < len(everyone)
        where = f" (on {failfast.ranks_on_hosts(failed, hosts)}; the other ranks can use it)" if alone else ""
        raise arrays.DeviceError(everyone[failed[0]][1] + where)
    found = {}
    for rank, (answer, _, _) in enumerate(everyone):
        found.setdefault(answer, []).append(rank)
    if len(found) > 1:
        where = "; ".join(f"{answer} on {failfast.ranks_on_hosts(r, hosts)}" for answer, r in found.items())
        raise arrays.DeviceError(f"{setting} means different things on different ranks: {where}; {advice}")
    return everyone[0][0]


def agreed_device(comm: MPI.Comm, requested: str) -> str:
    """``backend.resolve_device(requested)``, the same on every rank of ``comm`` (``agreed``)."""
    return agreed(comm, f"device={requested!r}", lambda: arrays.resolve_device(requested),
                  "every rank must compute on the same kind of device: set the device (train.device, HPCPAR_DEVICE) "
                  "alike on every node")


def agreed_backend(comm: MPI.Comm, requested: str, device: str, cuda_aware: bool, runtime) -> str:
    """``nccl.choose_backend``'s answer, the same on every rank of ``comm`` (``agreed``)."""
    have_nccl = True if runtime is not None else None  # a runtime given (a test's double) stands for NCCL
    return agreed(comm, f"parallel.backend = {requested!r}",
                  lambda: nccl.choose_backend(requested, device, cuda_aware, have_nccl=have_nccl),
                  "every rank must move device buffers the same way: give every node NCCL or none, or set the "
                  "backend (parallel.backend)")


def process_settings(world_mpi: MPI.Comm, node_size: int, tune_allocator: bool, device: str, fail_fast: bool) -> dict:
    """What init changes in the process (hpcpar.host.apply, fail-fast), as ``ctx.host`` reports it.
    With fail-fast wanted and ``world_mpi`` the world, a rank that ends its program also answers
    the others' stall census while it waits for them at exit (watchdog.answer_at_exit), so that
    a rank stalled in a collective it can no longer complete stops at once."""
    settings = host.apply(node_size, tune_allocator, set_blas_threads=device != "cuda")
    wanted, settings["fail_fast"] = failfast.install_for_init(fail_fast, MPI.COMM_WORLD.Get_size())
    if wanted and world_mpi.Compare(MPI.COMM_WORLD) == MPI.IDENT:
        answer_at_exit()
        settings["fail_fast"] += "; a rank that ends its program answers the stall census at its exit"
    return settings


def init(dp: int | None = None, pp: int = 1, tp: int = 1, device: str = "auto",
         comm: MPI.Comm | None = None, wait_policy: str | None = None, tune_allocator: bool = True,
         shm: bool | None = None, node_size: int | None = None, backend: str = "auto",
         device_nonblocking: bool | None = None, runtime=None, fail_fast: bool = True) -> ParallelContext:
    """Factor the world into dp x pp x tp and build the communicators.

    Raises LayoutError on every rank, before any communication, when the layout does not
    fit. With a GPU the device is chosen by node-local rank before anything allocates on it.
    Process-wide settings happen here, never on import (hpcpar.host.apply): glibc's allocator is
    tuned unless ``tune_allocator=False`` or HPCPAR_MALLOC_TUNING=0; on CPUs each rank's BLAS gets
    its share of the node's cores; with several ranks an uncaught exception aborts the job
    (failfast.install_for_init) unless ``fail_fast=False`` or HPCPAR_FAIL_FAST=0. ``shm`` (default
    HPCPAR_SHM) attaches the shared-memory collectives (hpcpar.runtime.shm) on CPUs; ``node_size``
    (default HPCPAR_NODE_SIZE) cuts nodes into pretend nodes for them (hpcpar.runtime.nodes).
    Rank 0 warns (PlacementWarning) when tensor parallelism crosses nodes but would fit inside them.
    ``backend`` ("auto", "mpi", "nccl": ``hpcpar.runtime.nccl.choose_backend``) picks what moves
    device buffers on the dp, pp and tp communicators (world and node stay on MPI);
    ``device_nonblocking`` overrides the table of MPI libraries that take device buffers in
    non-blocking collectives (``hpcpar.runtime.device_transport.DEVICE_NONBLOCKING``); ``runtime``: the
    NCCL runtime (default CuPy's; tests pass a double). Rank 0 logs which device it uses and why.
    """
    world_mpi = comm if comm is not None else MPI.COMM_WORLD
    dp, pp, tp = resolve_layout(world_mpi.Get_size(), dp, pp, tp)
    log.ensure_configured()  # rank 0's log lines on stdout, unless the application set up its own
    requested_device, device = device, agreed_device(world_mpi, device)
    use_shm, shm_node_size = shm_setting(shm), nodes.node_size_setting(node_size)

    node = world_mpi.Split_type(MPI.COMM_TYPE_SHARED, key=world_mpi.Get_rank())
    node_rank, node_size = node.Get_rank(), node.Get_size()
    # The CPUs of the node's ranks together: each rank pinned to its own core is not oversubscribed.
    node_cpus = host.usable_cpus(set().union(*node.allgather(host.affinity())))
    color = nodes.node_color(world_mpi, node, shm_node_size) if use_shm and device == "cpu" else None
    topo = _topology.discover(world_mpi, node)
    if world_mpi.Get_rank() == 0:
        _topology.warn_about_placement(topo, dp, pp, tp)
    if device == "cuda":
        arrays.select_gpu(node_rank)
    settings = process_settings(world_mpi, node_size, tune_allocator, device, fail_fast)

    cuda_aware = query_cuda_aware()
    policy = wait_policy or default_wait_policy(node_size, node_cpus)
    chosen = agreed_backend(world_mpi, backend, device, cuda_aware, runtime)
    if requested_device == "auto" and world_mpi.Get_rank() == 0:  # say what "auto" chose
        logger.info(arrays.device_choice(requested_device, device) + f"; communication: {chosen}")
    options = dict(cuda_aware=cuda_aware, wait_policy=policy, device_nonblocking=device_nonblocking)
    make = lambda mpi_comm, name: Communicator(mpi_comm, name, **options)  # noqa: E731
    if chosen == "nccl":
        runtime = runtime or nccl.cupy_runtime()
        make_axis = lambda mpi_comm, name: nccl.NcclCommunicator(mpi_comm, name, runtime=runtime, **options)  # noqa: E731
    else:
        make_axis = make

    # dims in (pp, dp, tp) order: MPI's row-major cartesian numbering makes tp fastest.
    cart = world_mpi.Create_cart([pp, dp, tp], periods=[False, False, False], reorder=False)
    pp_rank, dp_rank, tp_rank = cart.Get_coords(cart.Get_rank())
    pp_comm = cart.Sub([True, False, False])
    prev_stage, next_stage = pp_comm.Shift(0, 1)
    ctx = ParallelContext(
        world=make(world_mpi, "world"),
        dp=make_axis(cart.Sub([False, True, False]), "dp"),
        pp=make_axis(pp_comm, "pp"),
        tp=make_axis(cart.Sub([False, False, True]), "tp"),
        dp_size=dp, pp_size=pp, tp_size=tp,
        dp_rank=dp_rank, pp_rank=pp_rank, tp_rank=tp_rank,
        pp_prev=None if prev_stage == MPI.PROC_NULL else prev_stage,
        pp_next=None if next_stage == MPI.PROC_NULL else next_stage,
        node_rank=node_rank, node_size=node_size,
        device=device, cuda_aware=cuda_aware, wait_policy=policy,
        node_cpus=node_cpus, host=settings, shm=color is not None, shm_node_size=shm_node_size,
        node=make(node, "node"), topology=topo, backend=chosen, runtime=runtime if chosen == "nccl" else None,
    )
    assert (pp_rank, dp_rank, tp_rank) == coordinates(world_mpi.Get_rank(), dp, pp, tp)
    ctx.grid, ctx.serial = cart, next(_serials)
    _open.add(ctx)
    if color is not None:
        for communicator in ctx.communicators().values():
            if communicator.size > 1:
                communicator.shm = ShmCollectives(communicator, color)
    return ctx


def open_contexts() -> list:
    """The contexts ``init`` made that are not closed yet, oldest first (tests close theirs)."""
    return sorted(_open, key=lambda ctx: ctx.serial)


def single_process(device: str = "cpu") -> ParallelContext:
    """A 1 x 1 x 1 context on COMM_SELF, for serial runs and reference answers."""
    return init(1, 1, 1, device=device, comm=MPI.COMM_SELF)
