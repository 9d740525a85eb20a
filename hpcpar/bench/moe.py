"""``hpcpar bench moe``: expert parallelism's all-to-all and the cost of imbalance, in one run.

    mpiexec -n 4 hpcpar bench moe [--n-layer 2 --n-embd 64 --experts 8 --top-k 2 --block 128 --batch 4]

One MoE GPT (``hpcpar train``'s AllReduce strategy, AdamW fp32, clipping at 1, dp = the world)
at ep = 1, 2, 4 (groups carved out of dp), plus the largest ep with the router forced: its
weights zeroed before every step, so every logit ties and every token goes to the lowest
top_k experts (ties go to the lower one), all held by each group's first rank. Variants take
turns step by step; medians, the slowest rank deciding a step. Per step, from the ep
communicator's counters: alltoall + alltoallv seconds (the most- and least-waiting rank),
bytes given (all ranks) and those that leave their rank (wire); expert rows: the rows the
experts of a rank computed (the largest rank against the even share). One BLAS thread a rank.
"""
from __future__ import annotations

import statistics
import time

import numpy as np
from mpi4py import MPI

from ..cli import at_least
from ..runtime.failfast import UsageError
from ..tables import format_table
from ..train.config_load import load_job
from ..train.validate import validate
from .cp import header
from .step import limit_blas_threads
from .zero import make_strategy, one_step

A2A = ("alltoall", "alltoallv")
WARMUP = 2  # the first step makes AdamW's state; the second settles the routing's first move


def moe_job(args, world: int, ep: int):
    """The bench's MoE GPT at dp = ``world``, ep = ``ep``: ``args.batch`` sequences per rank, dropout off."""
    overrides = [f"model.n_layer={args.n_layer}", f"model.n_embd={args.n_embd}", f"model.n_head={args.n_head}",
                 f"model.block_size={args.block}", "model.dropout=0.0", f"data.batch_size={args.batch * world}",
                 f"parallel.dp={world}", f"parallel.ep={ep}", f"model.moe.experts={args.experts}",
                 f"model.moe.top_k={args.top_k}", 'train.device="cpu"']
    if args.capacity_factor is not None:
        overrides.append(f"model.moe.capacity_factor={args.capacity_factor}")
    return validate(load_job(None, overrides), world)


def rank_batch(job, rows: int, step: int, rank: int):
    """This rank's own random rows of ``step`` (each rank routes other tokens, as dp ranks do)."""
    ids = np.random.default_rng([step, rank]).integers(0, job.model.vocab_size, (rows, job.model.block_size + 1))
    return ids[:, :-1], ids[:, 1:]


def force_router(strategy) -> None:
    """Zero every router's weights (AdamW moved them in the last step): all logits tie."""
    for _, moe in strategy.model.moe_blocks():
        moe.router.weight.data[...] = 0


def ep_counters(strategy) -> tuple[float, int, int]:
    """(seconds, bytes given, wire bytes) of the ep communicator's all-to-alls so far (0 at ep = 1: none)."""
    comm = strategy.ctx.expert_group()
    if comm is None:
        return 0.0, 0, 0
    stats = comm.stats
    return (sum(stats.seconds(op) for op in A2A), sum(stats.bytes(op) for op in A2A),
            sum(stats.wire_bytes(op) for op in A2A))


def expert_rows(strategy, world, ep: int) -> list[int]:
    """Rows the experts of each rank computed in the last forward: rank r (position r % ep of
    group r // ep) holds experts [p * local, (p + 1) * local) and serves its group's tokens."""
    blocks = strategy.model.moe_blocks()
    counts = np.array(world.allgather(sum(moe.routing.counts for _, moe in blocks)))  # (ranks, experts)
    local = counts.shape[1] // ep
    return [int(counts[r // ep * ep:(r // ep + 1) * ep, r % ep * local:(r % ep + 1) * local].sum())
            for r in range(world.Get_size())]


def timed_step(world, strategy, ep: int, forced: bool, step: int) -> tuple:
    """(step s, all-to-all s max rank, min rank, bytes all ranks, wire all ranks, [expert rows per rank])."""
    job = strategy.job
    inputs, targets = rank_batch(job, job.data.batch_size // world.Get_size(), step, world.Get_rank())
    if forced:
        force_router(strategy)
    world.Barrier()
    before = ep_counters(strategy)
    start = time.perf_counter()
    one_step(strategy, inputs, targets, 1.0)
    wall = time.perf_counter() - start
    seconds, nbytes, wire = (after - b for after, b in zip(ep_counters(strategy), before))
    return (world.allreduce(wall, op=MPI.MAX), world.allreduce(seconds, op=MPI.MAX),
            world.allreduce(seconds, op=MPI.MIN), world.allreduce(nbytes), world.allreduce(wire),
            expert_rows(strategy, world, ep))


def variants(args, world) -> dict:
    """{name: (strategy, ep, forced)}: every ep of ``args.eps``, then the largest one forced."""
    found = {f"ep = {ep}": (make_strategy(moe_job(args, world.Get_size(), ep), world), ep, False) for ep in args.eps}
    top = max(args.eps)
    found[f"ep = {top}, router forced"] = (make_strategy(moe_job(args, world.Get_size(), top), world), top, True)
    return found


def measure(args, world) -> list:
    """[name, ep, step ms, a2a max ms, a2a min ms, bytes, wire, max rank rows, even rows] per variant:
    medians of ``args.repeats`` steps after the warm-up ones, the variants taking turns."""
    runs = variants(args, world)
    samples = {name: [] for name in runs}
    for step in range(WARMUP + args.repeats):
        for name, (strategy, ep, forced) in runs.items():
            sample = timed_step(world, strategy, ep, forced, step)
            if step >= WARMUP:
                samples[name].append(sample)
    rows = []
    for name, (strategy, ep, _) in runs.items():
        picked = samples[name]
        medians = [statistics.median(s[i] for s in picked) for i in range(5)]
        largest = statistics.median(max(s[5]) for s in picked)
        even = statistics.median(sum(s[5]) / len(s[5]) for s in picked)
        rows.append([name, ep, *medians, largest, even])
        strategy.ctx.close()
    return rows


def table_rows(rows: list) -> list:
    """The printed rows: ms, the step against ep = 1's, the all-to-all share of the step, MiB."""
    base = next((r[2] for r in rows if r[1] == 1), rows[0][2])
    return [[name, ep, step * 1e3, f"{step / base:.3f}", most * 1e3, least * 1e3, f"{most / step:.1%}",
             f"{nbytes / 2**20:.3f}", f"{wire / 2**20:.3f}", int(largest), int(even)]
            for name, ep, step, most, least, nbytes, wire, largest, even in rows]


def imbalance_line(rows: list, top_k: int) -> str:
    """The forced router against the normal one at the same ep: step time and the largest rank's rows."""
    normal, forced = rows[-2], rows[-1]
    experts = "experts 0 and 1" if top_k == 2 else "expert 0"
    return (f"imbalance at ep = {forced[1]} (every token on {experts}): step x{forced[2] / normal[2]:.2f} "
            f"({forced[2] * 1e3:.1f} vs {normal[2] * 1e3:.1f} ms), largest rank's expert rows "
            f"x{forced[7] / max(normal[7], 1):.2f} ({int(forced[7])} vs {int(normal[7])}; even share {int(normal[8])})")


def add_arguments(parser) -> None:
    parser.add_argument("--n-layer", type=at_least(1), default=2, help="GPT blocks (each with an MoE MLP)")
    parser.add_argument("--n-embd", type=at_least(1), default=64, help="GPT width")
    parser.add_argument("--n-head", type=at_least(1), default=4, help="attention heads")
    parser.add_argument("--experts", type=at_least(1), default=8, help="experts per MoE block")
    parser.add_argument("--top-k", type=int, choices=(1, 2), default=2, help="experts per token")
    parser.add_argument("--capacity-factor", type=float, default=None, help="tokens an expert takes per sequence (default: unset, dropless)")
    parser.add_argument("--block", type=at_least(2), default=128, help="context length of the timed steps")
    parser.add_argument("--batch", type=at_least(1), default=4, help="sequences per rank per step")
    parser.add_argument("--eps", type=at_least(1), nargs="+", default=None,
                        help="ep sizes (default: 1, 2, 4 up to the world size)")
    parser.add_argument("--repeats", type=at_least(1), default=5, help=f"timed steps per variant (after {WARMUP} warm-up)")
    parser.set_defaults(func=run)


def check_eps(args, size: int) -> None:
    """The ep sizes, sorted (default: 1, 2, 4 dividing the world); each divides the world and the experts."""
    args.eps = sorted(set(args.eps or [ep for ep in (1, 2, 4) if size % ep == 0]))
    wrong = [ep for ep in args.eps if size % ep or args.experts % ep]
    if wrong:
        raise UsageError(f"hpcpar bench moe: ep {wrong} must divide the world ({size} ranks) and --experts ({args.experts})")


def run(args) -> int:
    world = MPI.COMM_WORLD
    check_eps(args, world.Get_size())
    with limit_blas_threads(1):
        rows = measure(args, world)
    if world.Get_rank() == 0:
        print_table(args, world.Get_size(), rows)
    return 0


def print_table(args, ranks: int, rows: list) -> None:
    print(header(ranks, f", medians of {args.repeats} steps (variants taking turns, after {WARMUP} warm-up)"))
    drops = "dropless" if args.capacity_factor is None else f"capacity factor {args.capacity_factor}"
    title = (f"MoE GPT {args.n_layer} layers, width {args.n_embd}, {args.experts} experts top-{args.top_k} ({drops}) "
             f"in every block, block {args.block}, {args.batch} sequences per rank, dp {ranks}, AdamW fp32; "
             f"all-to-all: the ep communicator's alltoall + alltoallv per step (most / least waiting rank), "
             f"share: most / step; MiB per step summed over the ranks (given; wire: leaving their rank)")
    print(format_table(["variant", "ep", "step ms", "vs ep=1", "a2a ms max", "a2a ms min", "a2a share", "ep MiB",
                        "wire MiB", "expert rows max rank", "even share"], table_rows(rows), title=title))
    print(imbalance_line(rows, args.top_k))
