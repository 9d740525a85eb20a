"""``hpcpar bench pipeline``: measured pipeline bubble next to theory, per schedule.

    mpiexec -n 4 hpcpar bench pipeline [--batch 16] [--micro 4 8 16] [--steps 3]

For 2 and 4 stages (the first p ranks of the world; the others wait at a barrier) and each
schedule and micro-batch count m, trains the GPT of ``hpcpar bench step`` and reports
medians over steps of: the step time, the measured bubble (the share of the step a stage
spends waiting for a receive, averaged over stages), the theoretical bubble
(p-1)/(m+p-1) (divided by v when interleaved; ZB-H1 is set against 1F1B's, which it
shrinks), and the communication share. With more ranks than cores the stages share cores,
which the table notes.
"""
from __future__ import annotations

import os
import statistics
from dataclasses import replace

import numpy as np
from mpi4py import MPI

from ..cli import at_least
from ..runtime.comm import Communicator
from ..runtime.context import init
from ..nn.gpt import GPT
from ..parallel.pipeline import PipelineParallel
from .dp import BENCH_CONFIG
from ..tables import format_table

SCHEDULES = (("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("zb1", 1))


def run_case(ctx, schedule, chunks, m, batch, steps, sample, config=BENCH_CONFIG):
    model = GPT(config, dtype=np.float32)
    layers = len(model.layers())
    if ctx.pp_size * chunks > layers or (schedule == "interleaved" and m % ctx.pp_size):
        return None
    pipe = PipelineParallel(model, ctx, schedule=schedule, micro_batches=m, chunks=chunks,
                            partition="balanced", sample_input=sample)
    rng = np.random.default_rng(0)
    records = []
    for step in range(steps + 1):
        ids = rng.integers(0, BENCH_CONFIG.vocab_size, (batch, BENCH_CONFIG.block_size + 1))
        ctx.pp.barrier()
        pipe.train_step(ids[:, :-1], ids[:, 1:])
        pipe.zero_grad()
        if step:
            records.append(pipe.stats)
    pick = lambda key: statistics.median([r[key] for r in records])  # noqa: E731
    step_s = ctx.pp.mpi.allreduce(pick("step_s"), op=MPI.MAX)
    bubble = ctx.pp.mpi.allreduce(pick("idle_s"), op=MPI.SUM) / ctx.pp_size / step_s
    comm = ctx.pp.mpi.allreduce(pick("comm_s"), op=MPI.SUM) / ctx.pp_size / step_s
    return step_s, bubble, records[0]["theoretical_bubble"], comm


def add_arguments(parser) -> None:
    parser.add_argument("--batch", type=at_least(1), default=16, help="sequences per step (split into micro-batches)")
    parser.add_argument("--micro", type=at_least(1), nargs="+", default=[4, 8, 16], help="micro-batch counts to measure")
    parser.add_argument("--steps", type=at_least(1), default=3, help="timed steps per row; medians shown")
    parser.add_argument("--stages", type=at_least(1), nargs="+", default=[2, 4], help="pipeline depths to measure (those that fit the world)")
    parser.add_argument("--n-layer", type=at_least(1), default=6,
                        help="blocks; 6 (+ embedding + head = 8 layers) cut evenly into 2 and 4 stages, "
                             "and 2 stages x 2 chunks (4 layers make the interleaved stages uneven)")
    parser.set_defaults(func=run)


def run(args) -> None:
    config = replace(BENCH_CONFIG, n_layer=args.n_layer)

    world = MPI.COMM_WORLD
    waiting = Communicator(world, "world", wait_policy="yield")  # idle ranks must not spin on the busy cores
    rows = []
    sample = np.random.default_rng(1).integers(0, BENCH_CONFIG.vocab_size, (args.batch // max(args.micro), BENCH_CONFIG.block_size))
    for p in [s for s in args.stages if s <= world.Get_size()]:
        member = world.Get_rank() < p
        group = world.Split(0 if member else MPI.UNDEFINED, world.Get_rank())
        if member:
            ctx = init(pp=p, comm=group)
            for schedule, chunks in SCHEDULES:
                for m in args.micro:
                    result = run_case(ctx, schedule, chunks, m, args.batch, args.steps, sample, config)
                    if result is None:
                        continue
                    step_s, bubble, theory, comm = result
                    rows.append([schedule, p, m, step_s * 1e3, f"{100 * bubble:.1f}%", f"{100 * theory:.1f}%",
                                 f"{100 * comm:.1f}%", bubble / (theory + comm)])
            group.Free()
        waiting.barrier()
    if world.Get_rank() == 0:
        cores = os.cpu_count()
        print(format_table(["schedule", "stages", "micro", "step ms", "bubble", "theory", "comm", "bubble/(theory+comm)"],
                           rows, f"pipeline GPT (layers {config.n_layer}, width {config.n_embd}), batch "
                           f"{args.batch}, balanced partition, median of {args.steps} steps, {cores} cores"), flush=True)
