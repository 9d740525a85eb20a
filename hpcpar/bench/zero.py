"""``hpcpar bench zero``: each ZeRO stage against DDP on the same GPT and batch, in one run.

    mpiexec -n 2 hpcpar bench zero [--n-layer 4 --n-embd 256 --batch 8 --steps 8] [--no-peer]

Stages 0 (DDP) to 3 (resharding after forward or not) are ``hpcpar train``'s own strategy at
dp = the world (AdamW, clipping, float32, one BLAS thread per rank), taking turns step by step
with PyTorch FSDP2 (``torch_peers``); medians, the slowest rank deciding a step. Memory per rank, a stage at a
time, shm off (tracemalloc does not see MPI's windows): what the build and a first step keep
plus the peak of two more steps on 1 x 8 tokens per rank, beside ``formula`` (hpcpar's bytes
per stage; its terms: docs/architecture.md, "ZeRO-2" and "ZeRO-3") and what backward keeps.
"""
from __future__ import annotations

import gc
import math
import statistics
import time
import tracemalloc

import numpy as np
from mpi4py import MPI

from ..cli import at_least
from ..host import blas_kernel
from ..nn import activation_memory
from ..parallel.zero_grads import IN_FLIGHT
from ..parallel.zero_params import gathered_at_peak
from ..runtime.context import init
from ..tables import format_table
from ..train.build import build_model
from ..train.config_load import load_job
from ..train.loop import context_options
from ..train.strategies.allreduce import AllReduce
from ..train.validate import validate
from .step import limit_blas_threads

# (ZeRO stage, ZeRO-3's reshard_after_forward) of each measured variant
STAGES = ((0, None), (1, None), (2, None), (3, True), (3, False))


def stage_name(stage: int, reshard) -> str:
    if stage == 3:
        return f"hpcpar ZeRO-3 reshard_after_forward={'true' if reshard else 'false'}"
    return f"hpcpar ZeRO-{stage}" if stage else "hpcpar DDP"


def stage_job(args, world: int, stage, batch: int, block: int, shm: bool = True):
    """The job of ``stage`` (a pair of ``STAGES``) at dp = ``world``; ``shm=False``: buffers in
    NumPy's memory, which tracemalloc sees (not MPI's shared windows)."""
    zero, reshard = stage
    overrides = [f"model.n_layer={args.n_layer}", f"model.n_embd={args.n_embd}", f"model.n_head={args.n_head}",
                 f"model.block_size={block}", f"data.batch_size={batch * world}", f"parallel.dp={world}",
                 f"parallel.zero={zero}", f"parallel.bucket_mb={args.bucket_mb}", 'train.device="cpu"',
                 f"parallel.shm={'true' if shm else 'false'}"]
    if reshard is not None:
        overrides.append(f"parallel.reshard_after_forward={'true' if reshard else 'false'}")
    return validate(load_job(None, overrides), world)


def make_strategy(job, world):
    ctx = init(**job.parallel.grid_sizes(), comm=world, **context_options(job))
    return AllReduce(job, ctx, build_model(job, ctx, np.float32), job.precision)


def one_step(strategy, inputs, targets, clip: float) -> None:
    loss = strategy.train_step(inputs, targets)
    strategy.finish_step(clip, loss)


def batch_of(job, rows: int, step: int):
    rng = np.random.default_rng(step)
    ids = rng.integers(0, job.model.vocab_size, (rows, job.model.block_size + 1))
    return ids[:, :-1], ids[:, 1:]


def kept_for_backward(job, rows: int, tokens: int) -> float:
    """What the GPT keeps for backward on ``rows`` x ``tokens`` (``nn.activation_memory``, float32)."""
    m = job.model
    block = activation_memory.block_kept_bytes(rows, tokens, m.n_embd, m.n_head, dropout=m.dropout)
    return (m.n_layer * block + activation_memory.embedding_kept_bytes(rows, tokens, m.n_embd)
            + activation_memory.head_kept_bytes(rows, tokens, m.n_embd, m.vocab_size))


def formula(stage: int, params, ranks: int, buckets: list[int], gathered: int = 0) -> float:
    """Bytes of parameters, gradients and AdamW's state per rank at a step's peak, float32 (the
    module docstring); ``buckets``: ZeRO-2's and 3's bucket sizes in elements; ``gathered``:
    the most elements of ZeRO-3's units gathered at once. Activations are added apart."""
    psi = sum(p.size for p in params)
    shard = -(-psi // ranks)
    if stage == 0:  # AdamW's scratch: one array per distinct parameter shape
        return 16 * psi + 4 * sum(math.prod(shape) for shape in {p.shape for p in params})
    if stage == 1:
        return 8 * psi + 4 * shard * ranks + 20 * shard
    in_flight = 4 * sum(sorted(buckets)[-(IN_FLIGHT + 1):])
    if stage == 2:
        return 4 * psi + 20 * shard + in_flight
    return 20 * shard + in_flight + 4 * gathered


def memory_row(args, world, stage) -> list:
    """[name, measured MiB, formula MiB, measured / formula] on rank 0 (the largest rank's peak)."""
    gc.collect()
    job = stage_job(args, world.Get_size(), stage, batch=1, block=8, shm=False)
    tracemalloc.start()
    try:
        strategy = make_strategy(job, world)
        one_step(strategy, *batch_of(job, 1, 0), job.optimizer.grad_clip)  # AdamW's state is made
        tracemalloc.reset_peak()  # from here: what the build and the first step keep, and a step's peak
        for step in (1, 2):
            one_step(strategy, *batch_of(job, 1, step), job.optimizer.grad_clip)
        store = strategy.sharded_parameters
        # ZeRO-3's units in anonymous mappings are outside tracemalloc's sight: their peak is added
        mapped = store.peak_gathered_bytes if store is not None and store.free_pages else 0
        peak = world.allreduce(tracemalloc.get_traced_memory()[1] + mapped, op=MPI.MAX)
    finally:
        tracemalloc.stop()
    params = [p for _, p in strategy.named_parameters()]
    buckets = [b.end - b.begin for b in strategy.grad_sync.buckets] if stage[0] >= 2 else []
    gathered = gathered_at_peak([(u.end - u.begin, u.shared or not store.reshard_after_forward) for u in store.units]) if store else 0
    expected = formula(stage[0], params, world.Get_size(), buckets, gathered) + kept_for_backward(job, 1, 8)
    strategy.ctx.close()
    return [stage_name(*stage), peak / 2**20, expected / 2**20, peak / expected]


def speed_rows(args, world) -> tuple[list, list]:
    """([name, step ms, vs DDP, communication waited ms] per stage and peer, the steps taking
    turns; [(peer, why it did not run)])."""
    jobs = {s: stage_job(args, world.Get_size(), s, batch=args.batch, block=args.block) for s in STAGES}
    strategies = {stage_name(*s): make_strategy(job, world) for s, job in jobs.items()}
    steps = {name: (lambda strategy=strategy, job=jobs[s]: lambda ids: one_step(strategy, ids[:, :-1], ids[:, 1:],
                                                                                  job.optimizer.grad_clip))()
             for (name, strategy), s in zip(strategies.items(), STAGES)}
    peers, missing = torch_peers(args, jobs[STAGES[0]], world)
    steps.update(peers)
    times, waited = {name: [] for name in steps}, {name: [] for name in steps}
    for step in range(args.steps + 2):
        ids = np.concatenate(batch_of(jobs[STAGES[0]], args.batch, step), axis=1)[:, : args.block + 1]
        for name, run in steps.items():
            world.Barrier()
            start = time.perf_counter()
            run(ids)
            elapsed = world.allreduce(time.perf_counter() - start, op=MPI.MAX)
            if step >= 2:
                times[name].append(elapsed)
                strategy = strategies.get(name)
                waited[name].append(world.allreduce(strategy.stats.get("comm_s", 0.0), op=MPI.MAX)
                                    if strategy else float("nan"))
    ddp = statistics.median(times["hpcpar DDP"])
    rows = [[name, statistics.median(times[name]) * 1e3, statistics.median(times[name]) / ddp,
             statistics.median(waited[name]) * 1e3] for name in steps]
    for strategy in strategies.values():
        strategy.ctx.close()
    return rows, missing


def torch_peers(args, job, world) -> tuple[dict, list]:
    """PyTorch FSDP2 on the same GPT and batch ({name: step(ids)}), with reshard_after_forward
    False (gathered parameters kept from forward to backward: ZeRO-2's memory) and True (ZeRO-3);
    [(name, why it did not run)]."""
    if args.no_peer:
        return {}, []
    from .torch_peers import fsdp_step

    ids = np.concatenate(batch_of(job, args.batch, 0), axis=1)[:, : args.block + 1]
    peers, missing = {}, []
    for reshard, what in ((False, "ZeRO-2-like"), (True, "ZeRO-3")):
        name = f"torch FSDP2 reshard_after_forward={reshard} ({what})"
        step, problem = fsdp_step(job.gpt_config(), ids, job.optimizer.grad_clip, reshard, world)
        if step is None:
            missing.append((name, problem))
        else:
            peers[name] = lambda _ids, step=step: step()
    return peers, missing


def add_arguments(parser) -> None:
    parser.add_argument("--n-layer", type=at_least(1), default=4, help="GPT blocks")
    parser.add_argument("--n-embd", type=at_least(1), default=256, help="GPT width")
    parser.add_argument("--n-head", type=at_least(1), default=4, help="attention heads")
    parser.add_argument("--block", type=at_least(1), default=128, help="context length of the timed steps")
    parser.add_argument("--batch", type=at_least(1), default=8, help="rows per rank of the timed steps")
    parser.add_argument("--bucket-mb", type=float, default=4.0, help="DDP's and ZeRO-2's bucket size in MiB")
    parser.add_argument("--steps", type=at_least(1), default=8, help="timed steps per stage (after 2 warm-up)")
    parser.add_argument("--no-peer", action="store_true", help="leave out PyTorch FSDP2 (default: run it if installed)")
    parser.add_argument("--memory-only", action="store_true", help="measure memory per rank only, no step times")
    parser.set_defaults(func=run)


def run(args) -> int:
    world = MPI.COMM_WORLD
    with limit_blas_threads(1):
        memory = [memory_row(args, world, s) for s in STAGES]
        speed, missing = speed_rows(args, world) if not args.memory_only else ([], [])
    if world.Get_rank() == 0:
        n = world.Get_size()
        print(f"ZeRO stages against DDP: GPT {args.n_layer} layers, width {args.n_embd}, AdamW fp32, grad_clip 1, "
              f"dp {n}, buckets {args.bucket_mb} MiB, one BLAS thread per rank ({blas_kernel()})")
        if speed:
            print(format_table(["step", "ms", "vs hpcpar DDP", "waited for comm ms"],
                               [[name, f"{ms:.1f}", f"{r:.3f}", "-" if w != w else f"{w:.1f}"]
                                for name, ms, r, w in speed]))
            print(f"(batch {args.batch} x {args.block} tokens per rank, median of {args.steps} steps, taking turns)")
        for name, why in missing:
            print(f"{name}: did not run: {why}")
        print(format_table(["stage", "measured MiB", "formula MiB", "measured / formula"],
                           [[name, f"{m:.2f}", f"{f:.2f}", f"{r:.3f}"] for name, m, f, r in memory]))
        print("measured: tracemalloc peak per rank (largest rank), what the build and the first step keep and the "
              "next two steps' peak on 1 x 8 tokens per rank, shm off, and ZeRO-3's mapped units; formula: "
              "hpcpar/bench/zero.py, with what backward keeps of 1 x 8 tokens (nn.activation_memory)")
    return 0
