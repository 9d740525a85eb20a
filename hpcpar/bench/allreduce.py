"""``hpcpar bench allreduce``: hpcpar's array all-reduce next to raw C ``MPI_Allreduce``.

    mpiexec -n 4 hpcpar bench allreduce [--max-mib 64] [--rounds 3] [--wait spin|yield]

Both sides run in the same processes on the same MPI library: the C loop comes from
``libhpcpar_native.so`` (built by CMakeLists.txt, on first use if missing) called through
ctypes with this communicator. Each size is timed C, hpcpar, C, hpcpar ... over several
rounds and the medians are compared, so drift on a shared machine hits both alike.
Bus bandwidth = bytes x 2(n-1)/n / time (the OSU/NCCL-tests convention).
"""
from __future__ import annotations

import argparse
import statistics

import numpy as np

from ..dist.context import init
from .. import native
from ..tables import format_table, human_bytes


def sizes(max_bytes: int, min_bytes: int = 8) -> list[int]:
    out, n = [], min_bytes
    while n <= max_bytes:
        out.append(n)
        n *= 4
    if out[-1] != max_bytes:
        out.append(max_bytes)
    return out


def iterations(nbytes: int) -> tuple[int, int]:
    """(warm-up, timed) calls: many for latency-bound sizes, few for bandwidth-bound ones."""
    if nbytes <= 64 * 1024:
        return 20, 200
    if nbytes <= 4 << 20:
        return 5, 30
    return 2, 8


def bus_bandwidth(nbytes: int, seconds: float, ranks: int) -> float:
    return nbytes * 2 * (ranks - 1) / ranks / seconds / 1e9 if ranks > 1 else 0.0


def time_hpcpar(comm, buf, warmup: int, iters: int) -> float:
    """Mean seconds per in-place all-reduce, max over ranks (as the C side reports)."""
    import time

    for _ in range(warmup):
        comm.allreduce(buf, out=buf)
    comm.mpi.Barrier()
    start = time.perf_counter()
    for _ in range(iters):
        comm.allreduce(buf, out=buf)
    elapsed = (time.perf_counter() - start) / iters
    return comm.mpi.allreduce(elapsed, op=__import__("mpi4py").MPI.MAX)


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="hpcpar bench allreduce")
    parser.add_argument("--max-mib", type=float, default=64.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--wait", choices=("spin", "yield"), default=None,
                        help="wait policy of the hpcpar path (default: yield when oversubscribed)")
    args = parser.parse_args(argv)

    ctx = init(wait_policy=args.wait)
    comm = ctx.world
    lib = native.load_native()
    if lib is None and ctx.rank == 0:
        native.build_native()
    comm.mpi.Barrier()
    lib = lib or native.load_native()
    if lib is None:
        raise SystemExit("hpcpar bench allreduce: the C baseline library could not be built (see above)")
    if comm.wait_policy == "yield":
        # More ranks than cores: MPICH's own waits must sleep too, or the C side spins against the
        # rank it waits for and its figures mean nothing (10 ms for 8 bytes on 4 ranks, 2 cores).
        lib.set_wait_policy(1)

    rows = []
    for nbytes in sizes(int(args.max_mib * (1 << 20))):
        buf = np.ones(max(1, nbytes // 4), dtype=np.float32)
        warmup, iters = iterations(nbytes)
        c_times, py_times = [], []
        for _ in range(args.rounds):
            c_times.append(native.time_raw_allreduce(comm.mpi, buf.nbytes, warmup, iters))
            py_times.append(time_hpcpar(comm, buf, warmup, iters))
        c_s, py_s = statistics.median(c_times), statistics.median(py_times)
        rows.append([human_bytes(buf.nbytes), c_s * 1e6, py_s * 1e6, py_s / c_s,
                     bus_bandwidth(buf.nbytes, c_s, comm.size), bus_bandwidth(buf.nbytes, py_s, comm.size)])
    if ctx.rank == 0:
        title = (f"all-reduce, float32 sum, {comm.size} ranks, hpcpar wait policy '{comm.wait_policy}', "
                 f"median of {args.rounds} rounds")
        print(format_table(["size", "C us", "hpcpar us", "ratio", "C busbw GB/s", "hpcpar busbw GB/s"],
                           rows, title), flush=True)
