"""``hpcpar bench dp``: data-parallel gradient synchronisation and weak scaling of the GPT.

    mpiexec -n 4 hpcpar bench dp [--steps 5] [--batch 8] [--bucket-mb 6] [--path both|mpi|shm]

For groups of 1, 2, 4 ... ranks (sub-communicators of the world; ranks outside the group
wait at a barrier) each rank trains the GPT of ``hpcpar bench step`` on its own batch
(weak scaling: the global batch grows with the ranks), once with the buckets all-reduced
by MPI and once with them in the node's shared-memory window (hpcpar.runtime.shm; path
"shm"), and the run reports, as medians, the synchronisation without overlap next to a raw
mpi4py all-reduce of the same bytes, the synchronisation overlap leaves exposed, and the step
time (forward, backward, synchronisation with overlap, AdamW) per group size (``group_row``).
"""
from __future__ import annotations

import statistics
import time

import numpy as np
from mpi4py import MPI

from ..cli import above, at_least
from ..runtime.comm import Communicator
from ..runtime.context import init
from ..nn.gpt import GPT, GPTConfig
from ..optim import AdamW
from ..parallel import DistributedDataParallel
from ..tables import format_table
from .allreduce import polled

BENCH_CONFIG = GPTConfig(vocab_size=256, block_size=128, n_layer=4, n_head=4, n_embd=256)


def measure(ctx, batch: int, steps: int, bucket_mb: float, overlap: bool, seed: int = 0) -> dict:
    """Median step and synchronisation times; without overlap, also a raw flat all-reduce in each step.

    The raw all-reduce runs right after the synchronisation, in the same step, on a buffer of the
    same bytes: both see the same machine state (caches, other ranks' progress), so their ratio
    is not distorted by drift between separate loops.
    """
    model = GPT(BENCH_CONFIG, dtype=np.float32)
    ddp = DistributedDataParallel(model, ctx, bucket_mb=bucket_mb, overlap=overlap)
    optimizer = AdamW(model.named_parameters(), lr=1e-4)
    rng = np.random.default_rng([seed, ctx.rank])
    nbytes = sum(p.data.nbytes for p in model.parameters())
    flat = np.ones(nbytes // 4, dtype=np.float32)
    step_times, sync_times, raw_times = [], [], []
    for step in range(steps + 2):  # two warm-up steps
        ids = rng.integers(0, BENCH_CONFIG.vocab_size, (batch, BENCH_CONFIG.block_size + 1))
        ctx.dp.barrier()  # nothing in flight here: the last step's buckets are complete
        start = time.perf_counter()
        model.loss(ids[:, :-1], ids[:, 1:]).backward()
        if not overlap:
            # Nothing is in flight yet: a barrier keeps the slowest rank's backward out of the sync time.
            ctx.dp.barrier()
        backward_end = time.perf_counter()
        ddp.finish_grad_sync()
        sync = time.perf_counter() - backward_end
        optimizer.step()
        optimizer.zero_grad()
        elapsed = time.perf_counter() - start
        if not overlap:
            ctx.dp.barrier()
            raw_start = time.perf_counter()
            polled(ctx.dp.mpi, flat, ctx.wait_policy == "yield")
            raw = time.perf_counter() - raw_start
        if step >= 2:
            step_times.append(elapsed)
            sync_times.append(sync)
            if not overlap:
                raw_times.append(raw)
    median = statistics.median
    return {"step": median(step_times), "sync": median(sync_times), "raw": median(raw_times) if raw_times else None,
            "bytes": nbytes, "buckets": len(ddp.buckets),
            "shm": ctx.dp.shm is not None and ctx.dp.shm.stats.calls("iallreduce") > 0}


def group_row(group: MPI.Comm, shm: bool, args) -> list:
    """One table row (without the weak efficiency): this group of ranks, its buckets by MPI or in the window.

    - **sync**: the gradient synchronisation without overlap (all buckets all-reduced after
      backward, timed from a barrier) next to **raw**: one all-reduce of a single flat buffer of
      the same bytes by plain mpi4py, issued and waited for as hpcpar's MPI path does under the
      same wait policy (``Iallreduce`` in place, polled with ``Test``, pausing between polls
      under "yield"), timed in the same steps right after it;
    - **exposed**: with overlap on, the synchronisation the step cannot hide. No barrier
      separates backward from ``finish_grad_sync`` (one would advance the buckets in flight):
      each rank times from the end of its own backward to its last bucket's completion, and
      the rank that finished backward last waits least, so the minimum over ranks is the
      synchronisation left on the critical path; the hidden share is ``1 - exposed / sync``;
    - the step time (forward, backward, synchronisation with overlap, AdamW).
    """
    ctx = init(comm=group, shm=shm)
    no_overlap = measure(ctx, args.batch, args.steps, args.bucket_mb, overlap=False)
    overlap = measure(ctx, args.batch, args.steps, args.bucket_mb, overlap=True)
    n = group.Get_size()
    worst = lambda value: group.allreduce(value, op=MPI.MAX)  # noqa: E731 - the slowest rank decides
    sync, raw, step = worst(no_overlap["sync"]), worst(no_overlap["raw"]), worst(overlap["step"])
    exposed = group.allreduce(overlap["sync"], op=MPI.MIN)  # the rank whose backward ended last
    hidden = 1 - exposed / sync if n > 1 and sync > 0 else 0.0
    path = "-" if n == 1 else "shm" if no_overlap["shm"] and overlap["shm"] else "MPI"
    return [n, path, no_overlap["buckets"], f"{no_overlap['bytes'] / 2**20:.1f} MiB", sync * 1e3, raw * 1e3,
            sync / raw if n > 1 else float("nan"), exposed * 1e3, f"{100 * hidden:.0f}%", step * 1e3,
            n * args.batch * BENCH_CONFIG.block_size / step]


def add_arguments(parser) -> None:
    parser.add_argument("--steps", type=at_least(1), default=5, help="timed steps per world size; medians shown")
    parser.add_argument("--batch", type=at_least(1), default=8, help="sequences per rank (weak scaling)")
    parser.add_argument("--bucket-mb", type=above(0), default=6.0,
                        help="bucket size (the 12 MiB of gradients in 3 buckets: room to overlap)")
    parser.add_argument("--path", choices=("both", "mpi", "shm"), default="both",
                        help="buckets all-reduced by MPI, in the shared-memory window, or each in turn")
    parser.set_defaults(func=run)


def run(args) -> None:
    world = MPI.COMM_WORLD
    waiting = Communicator(world, "world", wait_policy="yield")  # idle ranks must not spin on the busy cores
    sizes = [n for n in (1, 2, 4, 8, 16) if n <= world.Get_size()]
    paths = {"both": (False, True), "mpi": (False,), "shm": (True,)}[args.path]
    rows = []
    for n in sizes:
        member = world.Get_rank() < n
        group = world.Split(0 if member else MPI.UNDEFINED, world.Get_rank())
        for shm in paths if n > 1 else paths[:1]:
            if member:
                rows.append(group_row(group, shm, args))
            waiting.barrier()
        if member:
            group.Free()
    if world.Get_rank() == 0:
        one_rank_ms = rows[0][-2]
        rows = [row + [one_rank_ms / row[-2]] for row in rows]
        print(format_table(
            ["ranks", "path", "buckets", "grads", "sync ms", "raw ms", "sync/raw", "exposed ms", "hidden", "step ms",
             "tokens/s", "weak eff."], rows,
            f"data parallel GPT (layers {BENCH_CONFIG.n_layer}, width {BENCH_CONFIG.n_embd}, context "
            f"{BENCH_CONFIG.block_size}), batch {args.batch}/rank, bucket {args.bucket_mb} MB, median of {args.steps} "
            f"steps; raw = one MPI all-reduce of the same bytes under the same wait policy"), flush=True)
