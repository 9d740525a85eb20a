"""``hpcpar info``: what this job runs on, printed once by rank 0."""
from __future__ import annotations

import os
import warnings

from mpi4py import MPI

from . import backend
from .autograd import fused
from .runtime.device_transport import device_nonblocking_supported, library_version, query_cuda_aware
from .runtime.context import init
from .runtime.grid import GRID, LayoutError
from .runtime.process import agreed_backend, agreed_device
from .runtime.nccl import BACKENDS, describe_backend, nccl_available
from .runtime.nodes import node_size_setting
from .runtime.shm import shm_setting
from .runtime.failfast import agreed_verdict
from .runtime.topology import PlacementWarning


def add_arguments(parser) -> None:
    others = " x ".join(name for name in GRID.spelt if name != GRID.fill)
    for axis in map(GRID.axis, GRID.spelt):  # --dp, --pp, --tp
        fill = axis.name == GRID.fill
        parser.add_argument(f"--{axis.name}", type=int, default=None if fill else 1,
                            help=f"{axis.help} (default: the world / ({others}))" if fill else axis.help)
    parser.add_argument("--device", default="auto", choices=backend.DEVICES,
                        help="auto: HPCPAR_DEVICE if set, else a GPU when CuPy sees one (default: auto)")
    parser.add_argument("--backend", default="auto", choices=BACKENDS,
                        help="what moves GPU buffers, as parallel.backend: auto = NCCL on GPUs when CuPy has it, "
                             "else MPI (default: auto)")
    parser.set_defaults(func=run)


def run(args) -> None:
    # checked before any rank waits on another, and agreed: a node's own device or NCCL can differ
    # ValueError: a variable of the environment init reads (HPCPAR_DEVICE=gpu was a traceback)
    with agreed_verdict("hpcpar info", (LayoutError, RuntimeError, ValueError)):
        sizes = {name: getattr(args, name) for name in GRID.spelt}
        GRID.resolve(MPI.COMM_WORLD.Get_size(), **sizes)
        shm_setting(), node_size_setting(), device_nonblocking_supported("MPICH", ())  # (a library named: no query)
        world = MPI.COMM_WORLD  # the device and the backend as init will find them (the same on every rank)
        agreed_backend(world, args.backend, agreed_device(world, args.device), query_cuda_aware(), None)
    print_info(sizes, device=args.device, comm_backend=args.backend)


def cupy_state(facts: dict) -> str:
    return f"broken ({facts['cupy_error']})" if facts["cupy_error"] else "not installed"


def parallel_hdf5() -> bool:
    import h5py

    return bool(h5py.get_config().mpi)


def print_info(sizes: dict, device="auto", comm_backend="auto") -> None:
    """``sizes``: the grid's, by axis name (the fill axis None: it fills the world)."""
    with warnings.catch_warnings():  # the placement report below carries the warning
        warnings.simplefilter("ignore", PlacementWarning)
        ctx = init(**sizes, device=device, backend=comm_backend)
    placement = ctx.world.gather_object((ctx.rank, os.uname().nodename, ctx.node_rank, os.getpid()))
    if ctx.rank != 0:
        return
    import h5py
    import mpi4py

    facts = backend.describe()
    name, version = library_version()
    library = f"{name} {'.'.join(map(str, version))}"
    lines = [
        f"hpcpar        {__import__('hpcpar').__version__}",
        f"MPI library   {MPI.Get_library_version().splitlines()[0].strip()}",
        f"MPI standard  {'.'.join(map(str, MPI.Get_version()))} (mpi4py {mpi4py.__version__})",
        f"world size    {ctx.world_size}   layout " + " ".join(f"{n}={v}" for n, v in ctx.mesh.by_name().items() if ctx.mesh.shown(n)),
        f"device        {backend.device_choice(device, ctx.device).removeprefix('device ')}   CUDA-aware MPI: "
        f"{'yes' if ctx.cuda_aware else 'no (GPU buffers staged through host)'}",
        *(f"comm {name:<8} {describe_backend(comm, ctx.device)}" for name, comm in ctx.communicators().items()),
        f"GPU MPI       non-blocking collectives on device buffers: "
        f"{'yes' if device_nonblocking_supported() else 'no (blocking)'} for {library} (docs/gpu.md)",
        f"backends      numpy {facts['numpy']}, cupy {facts['cupy'] or cupy_state(facts)}, GPUs visible: "
        f"{facts['gpus']}, NCCL: {'yes' if nccl_available() else 'no'}",
        f"bfloat16 CPU  {'yes (ml_dtypes)' if facts['bfloat16_on_cpu'] else 'no (pip install ml_dtypes)'}",
        f"h5py          {h5py.__version__}, HDF5 {h5py.version.hdf5_version}, parallel HDF5: {'yes' if parallel_hdf5() else 'no (file-per-rank checkpoints)'}",
        f"wait policy   {ctx.wait_policy} ({ctx.node_size} ranks on this node, {ctx.node_cpus} usable CPUs: "
        f"affinity and cgroup quota; os.cpu_count() {os.cpu_count()})",
        f"BLAS threads  {facts['blas_threads']} per rank; hpcpar.init: {ctx.host['blas']}",
        f"allocator     {ctx.host['allocator']}",
        f"elementwise   {fused.status()} (GELU, LayerNorm, attention softmax, AdamW; HPCPAR_FUSED=0: NumPy)",
        f"fail-fast     {ctx.host['fail_fast']}",
        f"shared memory {ctx.shm_description()}",
        "",
        ctx.grid_table(),
        "",
        "rank  host                 node-local rank  pid",
    ]
    lines += [f"{r:>4}  {host:<20} {local:>15}  {pid}" for r, host, local, pid in placement]
    lines += ["", ctx.placement_report()]
    print("\n".join(lines), flush=True)
