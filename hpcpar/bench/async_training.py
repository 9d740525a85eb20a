"""``hpcpar bench async``: all-reduce, parameter server (synchronous and asynchronous) and local SGD
training the same small GPT, with one worker slowed down.

    mpiexec -n 4 hpcpar bench async [--slow-rank 1] [--slow-factor 3] [--steps 40] [--batch 8] [--rotate]

Every mode (``mode_specs``) trains GPTConfig(vocab_size=256, block_size=64, n_layer=2, n_head=4,
n_embd=128) in float32 with AdamW on byte-level text (the Python standard library's sources),
``--steps`` steps per worker of ``--batch`` windows each, from the same initial parameters, one
BLAS thread per rank. World rank ``--slow-rank`` is the straggler (``run_mode``); with
``--rotate`` the role moves on to the next worker every step. A persistent straggler gates every
mode: bounded staleness lets the fast workers run at most s steps ahead, so with a fixed step
count per worker the asynchronous rows mostly show the waiting moved, not removed; they gain
where the slowness comes and goes (``--rotate``). The columns: ``run``.
"""
from __future__ import annotations

import time
from dataclasses import replace

import numpy as np

from ..cli import above, at_least
from ..autograd import no_grad
from ..runtime.failfast import UsageError
from ..data.corpus import batch_windows, stdlib_corpus
from ..runtime.context import init
from ..nn.gpt import GPT, GPTConfig
from ..tables import format_table
from ..train.config_load import load_job
from ..train.strategies import make_strategy
from .step import limit_blas_threads

BENCH_CONFIG = GPTConfig(vocab_size=256, block_size=64, n_layer=2, n_head=4, n_embd=128)
HELD_OUT_WINDOWS = 32
TAIL_STEPS = 5


def mode_specs(servers: int) -> list[dict]:
    """The modes, in this order:

    - ``allreduce``: DistributedDataParallel over all N ranks (the baseline of the speed column);
    - ``allreduce (W)``: the same over the first W = N - servers ranks only, the like-for-like
      baseline of the parameter-server rows (the others wait);
    - ``ps sync``, ``ps async s=1``, ``ps async s=4``: W workers and ``--servers`` server ranks;
    - ``local SGD H=4``, ``local SGD H=16``: all N ranks, parameters averaged every H steps.
    """
    return [
        {"label": "allreduce", "mode": "allreduce"},
        {"label": "allreduce (W)", "mode": "allreduce", "subset": True},
        {"label": "ps sync", "mode": "ps", "staleness": 0, "servers": servers},
        {"label": "ps async s=1", "mode": "ps", "staleness": 1, "servers": servers},
        {"label": "ps async s=4", "mode": "ps", "staleness": 4, "servers": servers},
        {"label": "local SGD H=4", "mode": "local_sgd", "local_steps": 4},
        {"label": "local SGD H=16", "mode": "local_sgd", "local_steps": 16},
    ]


def bench_job(spec: dict, args):
    """The job of one row: its strategy's keys; AdamW as ``AdamW(lr=args.lr)`` makes it."""
    keys = [f"parallel.mode={spec['mode']}", f"optimizer.lr={args.lr}", "optimizer.weight_decay=0.01"]
    keys += [f"parallel.{key}={spec[key]}" for key in ("staleness", "servers", "local_steps") if key in spec]
    return load_job(None, keys)


def bench_model(seed: int) -> GPT:
    """Every mode's model: ``BENCH_CONFIG`` initialised from ``--seed``."""
    return GPT(replace(BENCH_CONFIG, seed=seed), dtype=np.float32)


def run_mode(spec: dict, world_ctx, args, train_tokens, held_out) -> dict | None:
    """Train with one mode on every rank; rank 0 returns the row's numbers.

    The straggler sleeps, after each forward and backward, ``slow-factor - 1`` times the CPU time
    that compute just took (CPU, not wall time: on an oversubscribed node the wall time grows with
    the other ranks' load, and a sleep in proportion to it would amplify whatever contention a
    mode happens to cause). With ``--rotate`` worker ``(slow-rank + step) % W`` is slow: the
    transient slowness that bounded staleness is made for.
    """
    world = world_ctx.world
    workers = world.size - args.servers
    ctx = world_ctx
    member = True
    if spec.get("subset"):  # like-for-like with the parameter server: only its W worker ranks train
        member = world.rank < workers
        group = world.split(0 if member else None, world.rank, "subset")  # None outside it
        ctx = init(comm=group.mpi, device="cpu", wait_policy=world.wait_policy) if member else None

    model = bench_model(args.seed)
    strategy = make_strategy(bench_job(spec, args), ctx, model, data=None) if member else None
    world.barrier()
    start = time.perf_counter()
    losses, compute = [], 0.0
    if strategy is not None and not strategy.trains:
        strategy.serve(save_step=None)
    elif strategy is not None:
        for step in range(args.steps):
            begin, begin_cpu = time.perf_counter(), time.process_time()
            rng = np.random.default_rng([args.seed, step, strategy.ctx.dp_rank])
            starts = rng.integers(0, len(train_tokens) - BENCH_CONFIG.block_size - 1, args.batch)
            loss = strategy.train_step(*batch_windows(train_tokens, starts, BENCH_CONFIG.block_size))
            slow = (strategy.ctx.dp_rank == (args.slow_rank + step) % strategy.ctx.dp_size if args.rotate
                    else world.rank == args.slow_rank)
            if slow and args.slow_rank >= 0:
                time.sleep((args.slow_factor - 1) * (time.process_time() - begin_cpu))
            compute += time.perf_counter() - begin
            strategy.finish_step(0.0, loss)
            losses.append(loss)
        strategy.shutdown()
    elapsed = time.perf_counter() - start
    is_worker = strategy is not None and strategy.trains
    ps = getattr(strategy, "ps", None)
    mine = {"elapsed": elapsed, "worker": is_worker, "tail": float(np.mean(losses[-TAIL_STEPS:])) if losses else None,
            "busy": compute / elapsed, "staleness": ps.max_staleness if ps else 0, "lead": ps.max_lead if ps else 0}
    everyone = world.allgather_object(mine)
    if ctx is not world_ctx and member:  # the subset's context, then the group it was made on (collective)
        ctx.close()
        group.close()
    if world.rank != 0:
        return None
    with no_grad():
        held_out_loss = model.loss(*held_out).item()  # rank 0 is a worker in every mode: the final model
    trained = [r for r in everyone if r["worker"]]
    return {"label": spec["label"], "workers": len(trained), "seconds": max(r["elapsed"] for r in everyone),
            "held_out": held_out_loss, "tail": float(np.mean([r["tail"] for r in trained])),
            "staleness": max(r["staleness"] for r in everyone), "lead": max(r["lead"] for r in everyone),
            "busy": float(np.mean([r["busy"] for r in trained])), "ps": spec["mode"] == "ps"}


def add_arguments(parser) -> None:
    parser.add_argument("--steps", type=at_least(1), default=40, help="steps per worker")
    parser.add_argument("--batch", type=at_least(1), default=8, help="windows of 64 bytes per worker and step")
    parser.add_argument("--slow-rank", type=at_least(-1), default=1, help="world rank of the straggler, -1 for none")
    parser.add_argument("--slow-factor", type=above(0), default=3.0, help="its compute takes this many times longer")
    parser.add_argument("--rotate", action="store_true", help="the straggler role moves to the next worker each step")
    parser.add_argument("--servers", type=at_least(1), default=1, help="parameter-server ranks (the last ranks)")
    parser.add_argument("--lr", type=above(0), default=2e-3, help="learning rate of every mode")
    parser.add_argument("--seed", type=int, default=0, help="seed of the model and the batches")
    parser.set_defaults(func=run)


def run(args) -> None:
    """Every mode in turn; rank 0 prints the table. Columns: the wall time until every worker has
    finished its steps (and the final parameter pull or average); speed relative to
    ``allreduce``; the loss of the final parameters on a fixed held-out batch (text after the
    training part) and the training loss averaged over the workers' last 5 steps; the largest
    staleness a server saw (versions applied between a read and its push) and the largest lead
    (steps ahead of the slowest worker, at most s); and the share of the time workers spent
    computing (the rest is waiting and communicating)."""
    world_ctx = init(device="cpu")
    size = world_ctx.world_size
    workers = size - args.servers
    if workers < 1:
        raise UsageError(f"hpcpar bench async: error: {args.servers} server(s) leave no worker among {size} ranks; "
                         f"launch at least {args.servers + 1} ranks (mpiexec -n 4)")
    if args.slow_rank >= workers:
        raise UsageError(f"hpcpar bench async: error: --slow-rank {args.slow_rank} must be a worker in every mode "
                         f"(ranks 0..{workers - 1}; the last {args.servers} are servers), or -1 for none")
    if args.slow_factor < 1:
        raise UsageError(f"hpcpar bench async: error: --slow-factor must be >= 1, got {args.slow_factor}")

    tokens = stdlib_corpus(1 << 20)
    split = int(0.9 * len(tokens))
    train_tokens, held_out_tokens = tokens[:split], tokens[split:]
    starts = np.linspace(0, len(held_out_tokens) - BENCH_CONFIG.block_size - 2, HELD_OUT_WINDOWS).astype(np.int64)
    held_out = batch_windows(held_out_tokens, starts, BENCH_CONFIG.block_size)

    with limit_blas_threads(1):  # ranks share the cores: BLAS threads would fight them
        warm = GPT(BENCH_CONFIG, dtype=np.float32)  # first-call costs (BLAS, allocator) outside every timing
        warm.loss(*batch_windows(train_tokens, starts[:args.batch], BENCH_CONFIG.block_size)).backward()
        rows = [run_mode(spec, world_ctx, args, train_tokens, held_out) for spec in mode_specs(args.servers)]
    if world_ctx.rank != 0:
        return
    base = rows[0]["seconds"]
    table = [[r["label"], r["workers"], r["seconds"], base / r["seconds"], r["held_out"], r["tail"],
              r["staleness"] if r["ps"] else "-", r["lead"] if r["ps"] else "-", f"{100 * r['busy']:.0f}%"]
             for r in rows]
    if args.slow_rank < 0 or args.slow_factor == 1:
        slow = "no straggler"
    elif args.rotate:
        slow = f"one worker per step slowed {args.slow_factor:g}x, rotating from rank {args.slow_rank}"
    else:
        slow = f"rank {args.slow_rank} slowed {args.slow_factor:g}x"
    title = (f"async training: GPT (layers {BENCH_CONFIG.n_layer}, width {BENCH_CONFIG.n_embd}, context "
             f"{BENCH_CONFIG.block_size}), float32 AdamW lr {args.lr:g}, {args.steps} steps per worker x {args.batch} "
             f"windows, {slow}.\nFairness: {size} ranks; allreduce and local SGD train on all {size}, ps on "
             f"W = {workers} workers + {args.servers} server(s) (fewer windows per step); "
             f"'allreduce (W)' is the like-for-like baseline on the same {workers} workers.")
    print(format_table(["mode", "workers", "time s", "speed", "held-out loss", f"loss last {TAIL_STEPS}",
                        "max staleness", "max lead", "busy"], table, title), flush=True)
