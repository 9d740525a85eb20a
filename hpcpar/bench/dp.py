"""``hpcpar bench dp``: data-parallel gradient synchronisation and weak scaling of the GPT.

    mpiexec -n 4 hpcpar bench dp [--steps 5] [--batch 8] [--bucket-mb 6]

For groups of 1, 2, 4 ... ranks (sub-communicators of the world; ranks outside the group
wait at a barrier) each rank trains the GPT of ``hpcpar bench step`` on its own batch
(weak scaling: the global batch grows with the ranks) and the run reports, as medians:

- **sync**: the gradient synchronisation without overlap (all buckets all-reduced after
  backward) next to **raw**: one ``MPI_Allreduce`` of a single flat buffer of the same
  bytes, timed in the same steps right after it: the ratio is the cost of bucketing and Python;
- **exposed**: the synchronisation left after backward with overlap on; the hidden share
  is ``1 - exposed / sync``;
- the step time (forward, backward, synchronisation with overlap, AdamW) per group size.
"""
from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
from mpi4py import MPI

from ..dist.comm import Communicator
from ..dist.context import init
from ..nn.gpt import GPT, GPTConfig
from ..optim import AdamW
from ..parallel import DistributedDataParallel
from ..tables import format_table

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
        ctx.dp.barrier()
        start = time.perf_counter()
        model.loss(ids[:, :-1], ids[:, 1:]).backward()
        # Ranks finish backward at different moments; without this barrier the synchronisation
        # time would include waiting for the slowest rank, which is not communication.
        ctx.dp.barrier()
        before_sync = ddp.sync_seconds
        ddp.finish_grad_sync()
        sync = ddp.sync_seconds - before_sync
        optimizer.step()
        optimizer.zero_grad()
        elapsed = time.perf_counter() - start
        if not overlap:
            ctx.dp.barrier()
            raw_start = time.perf_counter()
            ctx.dp.mpi.Allreduce(MPI.IN_PLACE, flat, MPI.SUM)
            raw = time.perf_counter() - raw_start
        if step >= 2:
            step_times.append(elapsed)
            sync_times.append(sync)
            if not overlap:
                raw_times.append(raw)
    median = statistics.median
    return {"step": median(step_times), "sync": median(sync_times), "raw": median(raw_times) if raw_times else None,
            "bytes": nbytes, "buckets": len(ddp.buckets)}


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="hpcpar bench dp")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--batch", type=int, default=8, help="sequences per rank (weak scaling)")
    parser.add_argument("--bucket-mb", type=float, default=6.0,
                        help="bucket size (the 12 MiB of gradients in 3 buckets: room to overlap)")
    args = parser.parse_args(argv)

    world = MPI.COMM_WORLD
    waiting = Communicator(world, "world", wait_policy="yield")  # idle ranks must not spin on the busy cores
    sizes = [n for n in (1, 2, 4, 8, 16) if n <= world.Get_size()]
    rows, base_step = [], None
    for n in sizes:
        member = world.Get_rank() < n
        group = world.Split(0 if member else MPI.UNDEFINED, world.Get_rank())
        if member:
            ctx = init(comm=group)
            no_overlap = measure(ctx, args.batch, args.steps, args.bucket_mb, overlap=False)
            overlap = measure(ctx, args.batch, args.steps, args.bucket_mb, overlap=True)
            raw = group.allreduce(no_overlap["raw"], op=MPI.MAX)
            # The slowest rank decides a synchronous step.
            worst = lambda value: group.allreduce(value, op=MPI.MAX)  # noqa: E731
            sync, exposed, step = worst(no_overlap["sync"]), worst(overlap["sync"]), worst(overlap["step"])
            base_step = base_step or step
            hidden = 1 - exposed / sync if n > 1 and sync > 0 else 0.0
            rows.append([n, no_overlap["buckets"], f"{no_overlap['bytes'] / 2**20:.1f} MiB", sync * 1e3, raw * 1e3,
                         sync / raw if n > 1 else float("nan"), exposed * 1e3, f"{100 * hidden:.0f}%", step * 1e3,
                         n * args.batch * BENCH_CONFIG.block_size / step, base_step / step])
            group.Free()
        waiting.barrier()
    if world.Get_rank() == 0:
        print(format_table(
            ["ranks", "buckets", "grads", "sync ms", "raw ms", "sync/raw", "exposed ms", "hidden", "step ms",
             "tokens/s", "weak eff."], rows,
            f"data parallel GPT (layers {BENCH_CONFIG.n_layer}, width {BENCH_CONFIG.n_embd}, context "
            f"{BENCH_CONFIG.block_size}), batch {args.batch}/rank, bucket {args.bucket_mb} MB, median of {args.steps} steps"),
            flush=True)
