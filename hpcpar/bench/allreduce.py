"""``hpcpar bench allreduce``: the same all-reduce calls from C, mpi4py and hpcpar; the shared-memory path.

    mpiexec -n 2 hpcpar bench allreduce [--max-mib 64] [--rounds 3] [--wait spin|yield]

All sides run in the same processes on the same MPI library: the C loops come from
``libhpcpar_native.so`` (built by CMakeLists.txt, on first use if missing) called through
ctypes with this communicator. Each size is timed C, mpi4py, hpcpar, ... in turn over
several rounds and the medians are compared, so drift on a shared machine hits all alike.
A time is the mean of back-to-back calls after a barrier, on the slowest rank. The first
table sets the same call side by side (``same_call_row``: in place, out of place, polled), the
second hpcpar's shared-memory path against MPICH's in-place call and a memory copy
(``shm_row``). Bus bandwidth = bytes x 2(n-1)/n / time (the OSU/NCCL-tests convention).
"""
from __future__ import annotations

import statistics
import time

import numpy as np
from mpi4py import MPI

from ..cli import above, at_least
from .. import native
from ..runtime.comm import Communicator
from ..runtime.waiting import polite_pause
from ..runtime.context import init
from ..runtime.shm import MIN_BYTES, shared_zeros
from ..tables import format_table, human_bytes

CALLS = ("in place", "out of place", "polled in place")


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


def time_calls(mpi: MPI.Comm, fn, warmup: int, iters: int) -> float:
    """Mean seconds per call of ``fn`` after a barrier, slowest rank (as the C loops report)."""
    for _ in range(warmup):
        fn()
    mpi.Barrier()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    return mpi.allreduce((time.perf_counter() - start) / iters, op=MPI.MAX)


def polled(mpi: MPI.Comm, buf, polite: bool) -> None:
    """mpi4py's non-blocking in-place all-reduce, polled with Test under the bench's wait setting."""
    request = mpi.Iallreduce(MPI.IN_PLACE, buf, MPI.SUM)
    start = time.perf_counter()
    while not request.Test():
        if polite:
            polite_pause(time.perf_counter() - start)


class Sides:
    """Every timed call of one size, as named callables over buffers made once."""

    def __init__(self, ctx, lib, nbytes: int, polite: bool):
        self.ctx, self.lib, self.polite = ctx, lib, polite
        mpi = ctx.world.mpi
        count = max(1, nbytes // 4)
        self.nbytes = count * 4
        self.send = np.ones(count, dtype=np.float32)
        self.recv = np.zeros(count, dtype=np.float32)
        self.buf = np.zeros(count, dtype=np.float32)  # in place: zeros, as the C loops (ones would overflow)
        self.shared = shared_zeros(ctx.world, count, np.float32)
        # hpcpar's own MPI paths, without the shared-memory path: blocking, and as configured.
        self.blocking = Communicator(mpi, "bench-blocking", wait_policy="spin")
        self.blocking.watchdog = None  # a watchdog polls: without it "spin" means MPI's blocking call
        self.default = Communicator(mpi, "bench", wait_policy=ctx.wait_policy)
        self.mpi = mpi

    def c(self, call: str, warmup: int, iters: int) -> float:
        return self.lib.time_allreduce_call(self.mpi, self.nbytes, warmup, iters, call, self.polite)

    def python(self) -> dict:
        mpi, buf, send, recv = self.mpi, self.buf, self.send, self.recv
        return {
            ("mpi4py", "in place"): lambda: mpi.Allreduce(MPI.IN_PLACE, buf, MPI.SUM),
            ("mpi4py", "out of place"): lambda: mpi.Allreduce(send, recv, MPI.SUM),
            ("mpi4py", "polled in place"): lambda: polled(mpi, buf, self.polite),
            ("hpcpar", "in place"): lambda: self.blocking.allreduce(buf, out=buf),
            ("hpcpar", "out of place"): lambda: self.default.allreduce(send, out=recv),
            ("hpcpar", "polled in place"): lambda: self.default.iallreduce(buf, out=buf).wait(),
            ("hpcpar", "MPI path"): lambda: self.default.allreduce(buf, out=buf),
            ("shm", "window"): lambda: self.ctx.world.allreduce(self.shared, out=self.shared),
            ("shm", "copy"): lambda: self.ctx.world.allreduce(buf, out=buf),
            ("memory", "copy"): lambda: np.copyto(recv, send),
        }


def measure(ctx, lib, nbytes: int, rounds: int, polite: bool) -> tuple[dict, bool]:
    """Median seconds of every call at one size; and whether hpcpar took the shared-memory path."""
    sides = Sides(ctx, lib, nbytes, polite)
    warmup, iters = iterations(sides.nbytes)
    times: dict = {}
    shm_calls = ctx.world.shm.stats.calls("allreduce") if ctx.world.shm is not None else 0
    for _ in range(rounds):
        for call in CALLS:
            times.setdefault(("C", call), []).append(sides.c(call, warmup, iters))
        for key, fn in sides.python().items():
            times.setdefault(key, []).append(time_calls(sides.mpi, fn, warmup, iters))
    took_shm = ctx.world.shm is not None and ctx.world.shm.stats.calls("allreduce") > shm_calls
    return {key: statistics.median(values) for key, values in times.items()}, took_shm


def same_call_row(nbytes: int, t: dict) -> list:
    """The first table's row: each column group issues one kind of call on every side, float32
    sums of the same bytes:

    - *in place*: ``MPI_Allreduce(MPI_IN_PLACE, buf)``; mpi4py ``Allreduce(IN_PLACE, buf)``;
      hpcpar ``allreduce(buf, out=buf)`` configured to block (wait "spin", no watchdog);
    - *out of place*: ``MPI_Allreduce(send, recv)``; mpi4py ``Allreduce(send, recv)``; hpcpar
      ``allreduce(send, out=recv)`` as configured by default (a copy, then its in-place call);
    - *polled*: ``MPI_Iallreduce(MPI_IN_PLACE, buf)`` then ``MPI_Test`` until done; the same
      from mpi4py; hpcpar ``iallreduce(buf, out=buf).wait()`` (its non-blocking path, DDP's).

    The wait setting is the same on every side: under ``--wait yield`` (the default when ranks
    outnumber CPUs) MPICH's blocking waits sleep (its progress throttle, set through MPI_T for
    the whole process, so C's, mpi4py's and hpcpar's blocking calls alike), and every polled
    loop pauses between polls as hpcpar's yield policy does (sched_yield for 2 ms, then 50 us
    sleeps, written out in C too); under ``spin`` everything spins. The mpi4py columns are
    what a user without hpcpar gets.
    """
    row = [human_bytes(nbytes)]
    for call in CALLS:
        c, mpi4py, hpcpar = t[("C", call)], t[("mpi4py", call)], t[("hpcpar", call)]
        row += [c * 1e6, mpi4py * 1e6, hpcpar * 1e6, hpcpar / c]
    return row


SHM_HEADERS = ["size", "path", "MPICH in-place us", "hpcpar MPI us", "shm us", "shm/MPICH", "shm/hpcpar MPI",
               "copy-in us", "copy-in/MPICH", "busbw MPICH GB/s", "busbw shm GB/s", "busbw memcpy GB/s",
               "shm/memcpy"]


def shm_row(nbytes: int, t: dict, took_shm: bool, ranks: int) -> list:
    """The second table's row (``runtime.shm``): hpcpar's all-reduce with the shared-memory path on
    (the world communicator of ``init``, its wait policy and watchdog), next to MPICH's in-place
    call (C) and to hpcpar's own in-place call with the path off (the same settings):

    - *shm*: the buffer lives in the node's window (``shared_zeros``, as DDP's buckets and
      ZeRO's flat buffers do) and is reduced where it lies: no copy in or out;
    - *copy-in*: a plain array, copied into the window's scratch buffer and back (what
      tensor-parallel activations get; up to ``MAX_COPY_BYTES``, above it MPI's call).

    Under ``MIN_BYTES`` hpcpar hands both to MPI (path "MPI"), so there the columns time
    hpcpar's MPI call with the path's size check in front. The path's bound is the memory:
    each rank reads the node's slices of its part and writes its part into every buffer, the
    traffic of one copy of the buffer per rank, so the table also times ``numpy.copyto`` of the
    same bytes on every rank at once and gives the bus bandwidth an all-reduce at that copy's
    speed would have ("busbw memcpy").
    """
    c, hpcpar, window = t[("C", "in place")], t[("hpcpar", "MPI path")], t[("shm", "window")]
    copy_in, copy = t[("shm", "copy")], t[("memory", "copy")]
    return [human_bytes(nbytes), "shm" if took_shm else "MPI", c * 1e6, hpcpar * 1e6, window * 1e6, window / c,
            window / hpcpar, copy_in * 1e6, copy_in / c, bus_bandwidth(nbytes, c, ranks),
            bus_bandwidth(nbytes, window, ranks), bus_bandwidth(nbytes, copy, ranks), window / copy]


def load_library(ctx):
    lib = native.load_native(quiet=True)
    if lib is None and ctx.rank == 0:
        native.build_native()
    ctx.world.mpi.Barrier()
    try:
        return native.load_everywhere(ctx.world.mpi)
    except RuntimeError as exc:
        raise SystemExit(f"hpcpar bench allreduce: the C baseline library is unusable: {exc}") from None


def add_arguments(parser) -> None:
    parser.add_argument("--max-mib", type=above(0), default=64.0, help="largest message, MiB (sizes double up to it)")
    parser.add_argument("--min-bytes", type=at_least(1), default=8, help="smallest message, bytes")
    parser.add_argument("--rounds", type=at_least(1), default=3, help="rounds per size; the tables show medians")
    parser.add_argument("--wait", choices=("spin", "yield"), default=None,
                        help="wait setting of every side (default: yield when ranks outnumber CPUs)")
    parser.set_defaults(func=run)


def run(args) -> None:
    ctx = init(wait_policy=args.wait, shm=True)
    lib = load_library(ctx)
    polite = ctx.wait_policy == "yield"
    # Blocking MPI waits (C's, mpi4py's and hpcpar's blocking call) sleep under "yield", spin under "spin".
    lib.set_wait_policy(1 if polite else 0)

    same, shared = [], []
    for nbytes in sizes(int(args.max_mib * (1 << 20)), args.min_bytes):
        times, took_shm = measure(ctx, lib, nbytes, args.rounds, polite)
        nbytes = max(4, nbytes // 4 * 4)
        same.append(same_call_row(nbytes, times))
        shared.append(shm_row(nbytes, times, took_shm, ctx.world_size))
    if ctx.rank != 0:
        return
    setting = (f"{ctx.world_size} ranks, {ctx.node_cpus} CPUs, wait '{ctx.wait_policy}' on every side, "
               f"median of {args.rounds} rounds, us = mean per call, slowest rank")
    headers = ["size"]
    for short in ("in-place", "out-of-place", "polled"):
        headers += [f"{short} C", "mpi4py", "hpcpar", "hpcpar/C"]
    print(format_table(headers, same, f"all-reduce, float32 sum, the same call on each side: {setting}"), flush=True)
    print()
    print(format_table(
        SHM_HEADERS, shared,
        f"shared-memory all-reduce (hpcpar.runtime.shm; MPI under {human_bytes(MIN_BYTES)}), in place: shm = the "
        f"buffer in the window (as DDP's buckets), copy-in = a plain array copied into the window and back; "
        f"against MPICH's and hpcpar's in-place MPI call and numpy.copyto of the same bytes: {setting}"), flush=True)
