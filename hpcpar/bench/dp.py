"""``hpcpar bench dp``: data-parallel gradient synchronisation and weak scaling of the GPT.

    mpiexec -n 4 hpcpar bench dp [--steps 5] [--batch 8] [--bucket-mb 6] [--path both|mpi|shm]

For groups of 1, 2, 4 ... ranks (sub-communicators of the world; ranks outside the group
wait at a barrier) each rank trains the GPT of ``hpcpar bench step`` on its own batch
(weak scaling: the global batch grows with the ranks), with the buckets all-reduced by MPI
and with them in the node's shared-memory window (hpcpar.runtime.shm; path "shm"), the two
paths taking turns step by step in one process, and the run reports, as medians, the synchronisation without overlap next to a raw
mpi4py all-reduce of the same bytes, the synchronisation overlap leaves exposed, and the step
time (forward, backward, synchronisation with overlap, AdamW) per group size (``group_rows``).
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


class Runner:
    """One DDP training setup (its own model, optimizer and batches) whose steps ``step`` times.

    Without overlap each step also times a raw flat all-reduce of the same bytes right after the
    synchronisation: both see the same machine state (caches, other ranks' progress), so their
    ratio is not distorted by drift between separate loops.
    """

    def __init__(self, ctx, batch: int, bucket_mb: float, overlap: bool, seed: int = 0):
        self.ctx, self.batch, self.overlap = ctx, batch, overlap
        self.model = GPT(BENCH_CONFIG, dtype=np.float32)
        self.ddp = DistributedDataParallel(self.model, ctx, bucket_mb=bucket_mb, overlap=overlap)
        self.optimizer = AdamW(self.model.named_parameters(), lr=1e-4)
        self.rng = np.random.default_rng([seed, ctx.rank])
        self.nbytes = sum(p.data.nbytes for p in self.model.parameters())
        self.flat = np.ones(self.nbytes // 4, dtype=np.float32)
        self.times: list[tuple] = []

    def step(self, record: bool) -> None:
        """One step: (step, sync, raw or None) seconds appended when ``record``."""
        ctx = self.ctx
        ids = self.rng.integers(0, BENCH_CONFIG.vocab_size, (self.batch, BENCH_CONFIG.block_size + 1))
        ctx.dp.barrier()  # nothing in flight here: the last step's buckets are complete
        start = time.perf_counter()
        self.model.loss(ids[:, :-1], ids[:, 1:]).backward()
        if not self.overlap:
            # Nothing is in flight yet: a barrier keeps the slowest rank's backward out of the sync time.
            ctx.dp.barrier()
        backward_end = time.perf_counter()
        self.ddp.finish_grad_sync()
        sync = time.perf_counter() - backward_end
        self.optimizer.step()
        self.optimizer.zero_grad()
        elapsed, raw = time.perf_counter() - start, None
        if not self.overlap:
            ctx.dp.barrier()
            raw_start = time.perf_counter()
            polled(ctx.dp.mpi, self.flat, ctx.wait_policy == "yield")
            raw = time.perf_counter() - raw_start
        if record:
            self.times.append((elapsed, sync, raw))

    def medians(self) -> dict:
        median = statistics.median
        return {"step": median(t[0] for t in self.times), "sync": median(t[1] for t in self.times),
                "raw": None if self.overlap else median(t[2] for t in self.times), "bytes": self.nbytes,
                "buckets": len(self.ddp.buckets),
                "shm": self.ctx.dp.shm is not None and self.ctx.dp.shm.stats.calls("iallreduce") > 0}


def group_rows(group: MPI.Comm, paths: tuple, args) -> list:
    """The table rows (without the weak efficiency) of this group of ranks, one per path (MPI,
    the shared-memory window): every path's runs, without overlap and with it, take turns step
    by step (two warm-up rounds), so the paths see the same machine and their rows compare.

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
    contexts = {shm: init(comm=group, shm=shm) for shm in paths}
    runners = {(shm, overlap): Runner(contexts[shm], args.batch, args.bucket_mb, overlap)
               for shm in paths for overlap in (False, True)}
    for round_ in range(args.steps + 2):
        for runner in runners.values():
            runner.step(record=round_ >= 2)
    rows = [path_row(group, runners[shm, False].medians(), runners[shm, True].medians(), args) for shm in paths]
    for ctx in contexts.values():
        ctx.close()
    return rows


def path_row(group: MPI.Comm, no_overlap: dict, overlap: dict, args) -> list:
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
        if member:
            rows += group_rows(group, paths if n > 1 else paths[:1], args)
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
