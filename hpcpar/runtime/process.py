"""Process setup: the device, BLAS threads, allocator, fail-fast and communication backend of a
rank, agreed over the world before any grid is built on it.

``setup`` makes the process-wide changes (never on import: hpcpar.host.apply) and returns a
``Process``, what a ``ParallelContext`` needs of them: which device and backend every rank
agreed on, the node, the placement of the ranks, and how to make a communicator.
"""
from __future__ import annotations

from dataclasses import dataclass

from mpi4py import MPI

from .. import backend as arrays, host, log
from . import failfast, nccl, nodes
from . import topology as _topology
from .comm import Communicator, default_wait_policy
from .device_transport import query_cuda_aware
from .shm import shm_setting
from .watchdog import answer_at_exit

logger = log.get_logger(__name__)


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


def agreed_backend(comm: MPI.Comm, requested: str, device: str, cuda_aware: bool, runtime,
                   ranks_per_node: int | None = None, gpus: int | None = None) -> str:
    """``nccl.choose_backend``'s answer, the same on every rank of ``comm`` (``agreed``)."""
    have_nccl = True if runtime is not None else None  # a runtime given (a test's double) stands for NCCL
    return agreed(comm, f"parallel.backend = {requested!r}",
                  lambda: nccl.choose_backend(requested, device, cuda_aware, have_nccl=have_nccl,
                                              ranks_per_node=ranks_per_node, gpus=gpus),
                  "every rank must move device buffers the same way: give every node NCCL or none, or set the "
                  "backend (parallel.backend)")


def process_settings(world_mpi: MPI.Comm, node_size: int, tune_allocator: bool, device: str, fail_fast: bool) -> dict:
    """What setup changes in the process (hpcpar.host.apply, fail-fast), as ``ctx.host`` reports it.
    With fail-fast wanted and ``world_mpi`` the world, a rank that ends its program also answers
    the others' stall census while it waits for them at exit (watchdog.answer_at_exit), so that
    a rank stalled in a collective it can no longer complete stops at once."""
    settings = host.apply(node_size, tune_allocator, set_blas_threads=device != "cuda")
    wanted, settings["fail_fast"] = failfast.install_for_init(fail_fast, MPI.COMM_WORLD.Get_size())
    if wanted and world_mpi.Compare(MPI.COMM_WORLD) == MPI.IDENT:
        answer_at_exit()
        settings["fail_fast"] += "; a rank that ends its program answers the stall census at its exit"
    return settings


@dataclass(frozen=True)
class Process:
    """What ``setup`` found and changed, for the context built on it."""

    world: MPI.Comm  # the ranks of the grid
    node: MPI.Comm  # ``world`` split by shared memory (MPI_COMM_TYPE_SHARED); the context frees it
    node_cpus: int  # CPUs the node's ranks may run on (affinity and cgroup quota)
    topology: _topology.Topology  # the node of every world rank
    device: str  # "cpu" or "cuda"
    cuda_aware: bool
    wait_policy: str
    backend: str  # what moves device buffers on the grid's axes: "mpi" or "nccl"
    runtime: object  # the NCCL runtime when backend is "nccl", else None
    host: dict  # what setup changed in the process (hpcpar.host.apply, fail-fast)
    shm_color: int | None  # the (pretend) node of this rank for the shared-memory collectives; None: off
    shm_node_size: int | None  # pretend nodes of this many ranks for them (None: real nodes)
    device_nonblocking: bool | None

    @property
    def node_rank(self) -> int:  # node-local rank: picks the GPU
        return self.node.Get_rank()

    @property
    def node_size(self) -> int:
        return self.node.Get_size()

    def communicator(self, mpi_comm: MPI.Comm, name: str) -> Communicator:
        """An MPI communicator (world, node)."""
        return Communicator(mpi_comm, name, cuda_aware=self.cuda_aware, wait_policy=self.wait_policy,
                            device_nonblocking=self.device_nonblocking)

    def axis_communicator(self, mpi_comm: MPI.Comm, name: str) -> Communicator:
        """A communicator along grid axes: NCCL's when that is the backend."""
        if self.backend != "nccl":
            return self.communicator(mpi_comm, name)
        return nccl.NcclCommunicator(mpi_comm, name, runtime=self.runtime, cuda_aware=self.cuda_aware,
                                     wait_policy=self.wait_policy, device_nonblocking=self.device_nonblocking)


def setup(world: MPI.Comm, device: str = "auto", wait_policy: str | None = None, tune_allocator: bool = True,
          shm: bool | None = None, node_size: int | None = None, backend: str = "auto",
          device_nonblocking: bool | None = None, runtime=None, fail_fast: bool = True) -> Process:
    """Set this process up on ``world`` (collective; ``init``'s options).

    With a GPU the device is chosen by node-local rank before anything allocates on it; rank 0
    logs which device it uses and why when it was "auto". Process-wide settings happen here,
    never on import (hpcpar.host.apply): glibc's allocator is tuned unless
    ``tune_allocator=False`` or HPCPAR_MALLOC_TUNING=0; on CPUs each rank's BLAS gets its share
    of the node's cores; with several ranks an uncaught exception aborts the job
    (failfast.install_for_init) unless ``fail_fast=False`` or HPCPAR_FAIL_FAST=0. ``shm``
    (default HPCPAR_SHM) attaches the shared-memory collectives (hpcpar.runtime.shm) on CPUs;
    ``node_size`` (default HPCPAR_NODE_SIZE) cuts nodes into pretend nodes for them
    (hpcpar.runtime.nodes). ``backend`` ("auto", "mpi", "nccl": ``nccl.choose_backend``) picks
    what moves device buffers on the grid's communicators (world and node stay on MPI);
    ``device_nonblocking`` overrides the table of MPI libraries that take device buffers in
    non-blocking collectives (``device_transport.DEVICE_NONBLOCKING``); ``runtime``: the NCCL
    runtime (default CuPy's; tests pass a double)."""
    log.ensure_configured()  # rank 0's log lines on stdout, unless the application set up its own
    requested_device, device = device, agreed_device(world, device)
    use_shm, shm_node_size = shm_setting(shm), nodes.node_size_setting(node_size)
    node = world.Split_type(MPI.COMM_TYPE_SHARED, key=world.Get_rank())
    # The CPUs of the node's ranks together: each rank pinned to its own core is not oversubscribed.
    node_cpus = host.usable_cpus(set().union(*node.allgather(host.affinity())))
    color = nodes.node_color(world, node, shm_node_size) if use_shm and device == "cpu" else None
    topology = _topology.discover(world, node)
    if device == "cuda":
        arrays.select_gpu(node.Get_rank())
    settings = process_settings(world, node.Get_size(), tune_allocator, device, fail_fast)
    cuda_aware = query_cuda_aware()
    gpus = arrays.gpu_count() if device == "cuda" else None
    chosen = agreed_backend(world, backend, device, cuda_aware, runtime, node.Get_size(), gpus)
    sharing = nccl.shared_gpus(node.Get_size(), gpus)
    if backend == "auto" and sharing and nccl.nccl_available() and world.Get_rank() == 0:
        logger.info(f"communication: MPI, not NCCL: {sharing}, and NCCL needs a GPU per rank")
    if requested_device == "auto" and world.Get_rank() == 0:  # say what "auto" chose
        logger.info(arrays.device_choice(requested_device, device) + f"; communication: {chosen}")
    return Process(world=world, node=node, node_cpus=node_cpus, topology=topology, device=device,
                   cuda_aware=cuda_aware, wait_policy=wait_policy or default_wait_policy(node.Get_size(), node_cpus),
                   backend=chosen, runtime=(runtime or nccl.cupy_runtime()) if chosen == "nccl" else None,
                   host=settings, shm_color=color, shm_node_size=shm_node_size,
                   device_nonblocking=device_nonblocking)
