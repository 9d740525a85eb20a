"""``hpcpar bench net``: point-to-point and all-reduce inside a node next to the same across nodes.

    mpiexec -n 4 -ppn 2 hpcpar bench net [--max-mib 16] [--rounds 5]    # at least 2 nodes, 2 ranks on one

The baseline is the same call between ranks of one node (shared memory), measured in the same
run: a ping-pong between node 0's first two ranks against one between the first ranks of nodes
0 and 1, and an in-place float32 all-reduce over m ranks of node 0 against one over the first
ranks of m nodes (m = min(ranks on node 0, nodes): the same number of ranks, the same bytes).
Each size is timed intra, inter, intra, inter ... over the rounds and the medians are compared,
so drift on a shared machine hits both alike. The ranks not in a measurement wait politely.
Point-to-point: latency = half the round trip, bandwidth = bytes / latency. All-reduce: time per
call (the slowest rank) and bus bandwidth = bytes x 2(m-1)/m / time.
"""
from __future__ import annotations

import statistics
import time

import numpy as np
from mpi4py import MPI

from ..cli import above, at_least
from ..runtime.comm import wait_politely
from ..runtime.context import init
from ..runtime.failfast import UsageError
from .allreduce import bus_bandwidth, iterations, sizes
from ..tables import format_table, human_bytes


def ping_pong(comm: MPI.Comm, peer: int, buf: np.ndarray, warmup: int, iters: int) -> float:
    """Seconds of half a round trip between this rank and ``peer`` (rank 0 of the pair starts)."""
    first = comm.Get_rank() < peer
    for i in range(warmup + iters):
        if i == warmup:
            start = time.perf_counter()
        if first:
            comm.Send(buf, dest=peer)
            comm.Recv(buf, source=peer)
        else:
            comm.Recv(buf, source=peer)
            comm.Send(buf, dest=peer)
    return (time.perf_counter() - start) / iters / 2


def allreduce_time(comm: MPI.Comm, buf: np.ndarray, warmup: int, iters: int) -> float:
    """Seconds per in-place all-reduce, the slowest rank's."""
    for _ in range(warmup):
        comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM)
    comm.Barrier()
    start = time.perf_counter()
    for _ in range(iters):
        comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM)
    return comm.allreduce((time.perf_counter() - start) / iters, op=MPI.MAX)


def groups(ctx) -> tuple[list[int], list[int]]:
    """World ranks of the intra-node and the inter-node group (same size); a UsageError (the
    same verdict on every rank: the topology is the world's) when the launch cannot give them."""
    topo = ctx.topology
    node0 = topo.ranks_on(0)
    if topo.nodes < 2 or len(node0) < 2:
        raise UsageError(f"hpcpar bench net: needs ranks on at least 2 nodes and 2 on the first "
                         f"(got {topo.node_sizes()} ranks on {topo.nodes} node(s)); e.g. mpiexec -n 4 -ppn 2")
    m = min(len(node0), topo.nodes)
    return node0[:m], [topo.ranks_on(n)[0] for n in range(m)]


def measure(world, intra, inter, nbytes, rounds):
    """Median (intra, inter) seconds for a ping-pong and an all-reduce of nbytes (on world rank 0)."""
    rank = world.Get_rank()
    subs = {name: world.Split(0 if rank in ranks else MPI.UNDEFINED, ranks.index(rank) if rank in ranks else 0)
            for name, ranks in (("intra", intra), ("inter", inter))}
    buf = np.ones(max(1, nbytes // 4), dtype=np.float32)
    warmup, iters = iterations(nbytes)
    times = {(kind, name): [] for kind in ("p2p", "allreduce") for name in subs}
    for _ in range(rounds):
        for kind in ("p2p", "allreduce"):
            for name, sub in subs.items():
                if sub != MPI.COMM_NULL:
                    if kind == "p2p" and sub.Get_rank() < 2:  # the group's first two ranks
                        seconds = ping_pong(sub, 1 - sub.Get_rank(), buf, warmup, iters)
                    elif kind == "allreduce":
                        seconds = allreduce_time(sub, buf, warmup, iters)
                    else:
                        seconds = None
                    if sub.Get_rank() == 0 and seconds is not None:
                        times[(kind, name)].append(seconds)
                wait_politely(world.Ibarrier())
    for sub in subs.values():
        if sub != MPI.COMM_NULL:
            sub.Free()
    # Rank 0 leads both groups (node 0's first rank), so it holds every figure.
    return {key: statistics.median(values) for key, values in times.items() if values} if rank == 0 else None


def add_arguments(parser) -> None:
    parser.add_argument("--max-mib", type=above(0), default=16.0, help="largest message, MiB (sizes double up to it)")
    parser.add_argument("--rounds", type=at_least(1), default=5, help="rounds per size, intra and inter in turn; medians")
    parser.set_defaults(func=run)


def run(args) -> None:
    ctx = init()
    world = ctx.world.mpi
    intra, inter = groups(ctx)
    p2p_rows, allreduce_rows = [], []
    for nbytes in sizes(int(args.max_mib * (1 << 20))):
        t = measure(world, intra, inter, nbytes, args.rounds)
        if t is None:
            continue
        size, nbytes = human_bytes(4 * max(1, nbytes // 4)), 4 * max(1, nbytes // 4)
        a, e = t[("p2p", "intra")], t[("p2p", "inter")]
        p2p_rows.append([size, a * 1e6, e * 1e6, e / a, nbytes / a / 1e9, nbytes / e / 1e9])
        a, e = t[("allreduce", "intra")], t[("allreduce", "inter")]
        allreduce_rows.append([size, a * 1e6, e * 1e6, e / a, bus_bandwidth(nbytes, a, len(intra)),
                               bus_bandwidth(nbytes, e, len(inter))])
    if world.Get_rank() != 0:
        return
    hosts = ctx.topology.hosts
    where = (f"intra: ranks {intra} on {hosts[0]}; inter: ranks {inter} on "
             f"{', '.join(hosts[ctx.topology.node_of[r]] for r in inter)}; median of {args.rounds} rounds")
    print(format_table(["size", "intra us", "inter us", "inter/intra", "intra GB/s", "inter GB/s"], p2p_rows,
                       f"point-to-point ping-pong (half round trip), {where}"), flush=True)
    print()
    print(format_table(["size", "intra us", "inter us", "inter/intra", "intra busbw GB/s", "inter busbw GB/s"],
                       allreduce_rows, f"all-reduce, float32 sum in place, {len(intra)} ranks, {where}"), flush=True)
