"""``hpcpar bench cp``: context parallelism's balance, speed, overlap and memory, in one run.

    mpiexec -n C hpcpar bench cp [--heads 4 --head-size 64 --tokens 2048 --block 1024 --repeats 5]
    mpiexec -n 4 hpcpar bench cp --memory [--blocks 512 1024 2048 --cps 1 2 4]

Balance: ``ring_attention`` forward + backward per rank, zigzag chunks against the contiguous
split, with the chunk pairs each rank computes. Overlap: the same isend/irecv ring (calls and
bytes counted on the cp communicator) timed alone against the cp wait inside attention. Speed:
a GPT step (AdamW, gradients averaged over cp) at cp = C against the same B x T tokens on one
rank. Peer: PyTorch's experimental ``context_parallel`` SDPA over gloo, same shapes. Variants
take turns round by round; medians; one BLAS thread per rank. ``--memory``: bytes kept for
backward (``autograd.memory``) and the tracemalloc peak of a step per rank, for each C and block.
"""
from __future__ import annotations

import statistics
import sys
import time

import numpy as np
from mpi4py import MPI

from ..autograd import Tensor
from ..autograd.memory import kept_for_backward
from ..autograd.ops.ring_attention import KV_TAG, pairs_per_rank, ring_attention
from ..autograd.ops.sequence_chunks import ChunkLayout
from ..cli import at_least
from ..host import blas_kernel
from ..nn.gpt import CausalSelfAttention
from ..runtime.context import init
from ..runtime.failfast import UsageError
from ..runtime.waiting import wait_idle
from ..tables import format_table
from ..train.config_load import load_job
from ..train.validate import validate
from .step import limit_blas_threads, traced_peak
from .zero import batch_of, make_strategy, one_step

LAYOUTS = (("zigzag", True), ("contiguous", False))


def idle_barrier(comm) -> None:
    """A barrier that sleeps: ranks sitting out another's measurement leave it the cores."""
    wait_idle(comm.Ibarrier())


def attention_call(comm, layout: ChunkLayout, shape: tuple, seed: int = 0):
    """Forward and backward of ``ring_attention`` on this rank's (B, H, T/C, hs) q, k, v."""
    rng = np.random.default_rng(seed + comm.rank)
    q, k, v = (rng.standard_normal(shape).astype(np.float32) for _ in range(3))
    grad = rng.standard_normal(shape).astype(np.float32)

    def call():
        tensors = [Tensor(a, requires_grad=True) for a in (q, k, v)]
        ring_attention(*tensors, comm, layout).backward(grad)

    return call


def ring_alone(comm, nbytes: int, calls: int):
    """The ring's transfers without the compute: ``calls`` isend/irecv pairs of ``nbytes`` each,
    to the next rank and from the previous one, each completed before the next is posted."""
    block, incoming = np.zeros(nbytes // 4, np.float32), np.empty(nbytes // 4, np.float32)
    nxt, prev = (comm.rank + 1) % comm.size, (comm.rank - 1) % comm.size

    def call():
        for _ in range(calls):
            send, recv = comm.isend(block, nxt, KV_TAG), comm.irecv(incoming, prev, KV_TAG)
            recv.wait()
            send.wait()

    return call


def timed(world, comm, call) -> tuple[float, float, float]:
    """(wall seconds, seconds in ``comm``'s isend/irecv and their waits, process CPU seconds) of one
    ``call`` on this rank (CPU time: what the rank ran, whatever else shares its core)."""
    world.Barrier()
    before = comm.stats.seconds("isend") + comm.stats.seconds("irecv")
    start, cpu = time.perf_counter(), time.process_time()
    call()
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu
    return wall, comm.stats.seconds("isend") + comm.stats.seconds("irecv") - before, cpu


def rounds(world, comm, calls: dict, repeats: int) -> dict:
    """{name: [``timed``'s (wall, comm, cpu) per round]} on this rank, the calls taking turns, one warm-up round."""
    samples = {name: [] for name in calls}
    for round_ in range(repeats + 1):
        for name, call in calls.items():
            sample = timed(world, comm, call)
            if round_:
                samples[name].append(sample)
    return samples


def torch_ring(world, shape: tuple, seed: int = 0):
    """(PyTorch ``context_parallel``'s causal SDPA forward + backward on the same shapes, None), or
    (None, why it did not run): q, k, v of the whole sequence, sharded by the context manager."""
    from .torch_peers import join_gloo

    problem = join_gloo(world)
    if problem:
        return None, problem
    import torch
    import torch.nn.functional as F
    try:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.experimental import context_parallel

        mesh = init_device_mesh("cpu", (world.Get_size(),))
        full = (shape[0], shape[1], shape[2] * world.Get_size(), shape[3])
        gen = torch.Generator().manual_seed(seed)
        qkv = [torch.randn(full, generator=gen) for _ in range(3)]

        def call():
            tensors = [t.clone() for t in qkv]
            # sharded in place and not restored: they require grad inside, which a restore cannot resize
            with context_parallel(mesh, buffers=tensors, buffer_seq_dims=[2, 2, 2], no_restore_buffers=set(tensors)):
                leaves = [t.requires_grad_() for t in tensors]
                F.scaled_dot_product_attention(*leaves, is_causal=True).sum().backward()

        call()  # its failure on CPU shows here, once, rather than inside the timed rounds
    except Exception as err:  # noqa: BLE001 - the peer's own failure is reported, not raised
        return None, f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
    return call, None


def median_ms(samples, pick) -> float:
    return statistics.median(pick(s) for s in samples) * 1e3


def attention_rows(args, world, ctx) -> tuple[list, list, list]:
    """(per-rank rows, summary rows, [(peer, why it did not run)]): the layouts, the ring alone and
    the peer taking turns; the summary's spread is max / min over the ranks."""
    comm, shape = ctx.cp, (args.batch, args.heads, args.tokens // world.Get_size(), args.head_size)
    calls = {name: attention_call(comm, ChunkLayout(comm.rank, comm.size, zigzag), shape) for name, zigzag in LAYOUTS}
    before = (comm.stats.calls("isend"), comm.stats.bytes("isend"))
    calls["zigzag"]()  # counts the ring's transfers, which the alone pattern repeats
    sends, nbytes = comm.stats.calls("isend") - before[0], comm.stats.bytes("isend") - before[1]
    calls["ring transfers alone"] = ring_alone(comm, nbytes // max(sends, 1), sends)
    missing = []
    if not args.no_peer:
        peer, why = torch_ring(world, shape)
        why = next((w for w in world.allgather(why) if w), None)  # every rank runs the peer, or none does
        if why:
            missing.append(("torch context_parallel (gloo, CPU)", why))
        else:
            calls["torch context_parallel"] = peer
    samples = rounds(world, comm, calls, args.repeats)
    per_rank = world.gather({name: (median_ms(s, lambda x: x[0]), median_ms(s, lambda x: x[1]),
                                    median_ms(s, lambda x: x[0] - x[1]), median_ms(s, lambda x: x[2]))
                             for name, s in samples.items()}, root=0)
    if world.Get_rank() != 0:
        return [], [], missing
    return (*attention_tables(per_rank, world.Get_size(), sends, nbytes), missing)


def spread(values: list) -> str:
    return f"{max(values) / min(values):.3f}" if min(values) > 0 else "-"


def attention_tables(per_rank: list, size: int, sends: int, nbytes: int) -> tuple[list, list]:
    """Rank 0: [layout, rank, chunks, pairs, wall ms, cp wait ms, compute ms, cpu ms] and the summary
    [variant, wall ms (slowest rank), compute max/min, cpu max/min, wall max/min]."""
    rows, summary = [], []
    for name, zigzag in LAYOUTS:
        pairs = pairs_per_rank(size, zigzag)
        for rank, ranks in enumerate(per_rank):
            rows.append([name, rank, str(ChunkLayout(rank, size, zigzag).chunks()), pairs[rank], *ranks[name]])
    for name in per_rank[0]:
        walls = [r[name][0] for r in per_rank]
        summary.append([name, max(walls), *(spread([r[name][column] for r in per_rank]) for column in (2, 3, 0))])
    alone = max(r["ring transfers alone"][0] for r in per_rank)
    # the least-waiting rank's wait: the others' also hold the wait for a slower neighbour's compute
    exposed = min(r["zigzag"][1] for r in per_rank)
    summary.append([f"overlap: {sends} sends x {nbytes / max(sends, 1) / 2**20:.2f} MiB per rank",
                    f"{alone:.2f} alone", f"exposed {exposed:.2f} ms", f"hidden {1 - exposed / alone:.1%}", ""])
    return rows, summary


def gpt_job(args, cp: int, block: int):
    """The GPT job of this bench at cp = ``cp``, dp = 1: ``args.batch`` whole sequences of ``block``
    tokens per step (each cp rank computes its chunks of them), AdamW fp32, dropout off, shm off."""
    overrides = [f"model.n_layer={args.n_layer}", f"model.n_embd={args.n_embd}", f"model.n_head={args.n_head}",
                 f"model.block_size={block}", "model.dropout=0.0", f"data.batch_size={args.batch}", "parallel.dp=1",
                 f"parallel.cp={cp}", 'train.device="cpu"', "parallel.shm=false"]
    return validate(load_job(None, overrides), cp)


def speed_rows(args, world) -> list:
    """[variant, ms, cpu ms, tokens/s, speed-up, comm waited ms]: the step at cp = world and the same
    batch on rank 0 alone (the others sleeping at a barrier), taking turns; cpu: the slowest rank's
    CPU time (wall less the time the rank was not running: the figure that a loaded machine spares)."""
    size = world.Get_size()
    spread = make_strategy(gpt_job(args, size, args.block), world)
    alone = make_strategy(gpt_job(args, 1, args.block), MPI.COMM_SELF) if world.Get_rank() == 0 else None
    times, waited = {"cp": [], "one": []}, []
    for step in range(args.repeats + 1):
        inputs, targets = batch_of(spread.job, args.batch, step)
        world.Barrier()
        cp = timed_step(spread, inputs, targets)
        cp = (world.allreduce(cp[0], op=MPI.MAX), world.allreduce(cp[1], op=MPI.MAX))
        comm = world.allreduce(spread.stats.get("comm_s", 0.0), op=MPI.MAX)
        one = timed_step(alone, inputs, targets) if alone is not None else None
        idle_barrier(world)
        if step:
            times["cp"].append(cp), times["one"].append(one), waited.append(comm)
    spread.ctx.close()
    if alone is None:
        return []
    alone.ctx.close()
    wall = {key: statistics.median(t[0] for t in samples) for key, samples in times.items()}
    return [[name, wall[key] * 1e3, median_ms(times[key], lambda t: t[1]), args.batch * args.block / wall[key],
             f"{wall['one'] / wall[key]:.2f}", wait]
            for name, key, wait in ((f"cp = {size} ({size} ranks)", "cp", f"{statistics.median(waited) * 1e3:.1f}"),
                                    ("cp = 1 (1 rank)", "one", "-"))]


def timed_step(strategy, inputs, targets) -> tuple[float, float]:
    """(wall, process CPU) seconds of one training step (gradient clipping at 1, as the jobs')."""
    wall, cpu = time.perf_counter(), time.process_time()
    one_step(strategy, inputs, targets, 1.0)
    return time.perf_counter() - wall, time.process_time() - cpu


def memory_row(args, comm, block: int, ring_at_one: bool = False) -> list:
    """[C, attention, block, tokens per rank, kept MiB, step peak MiB] (the largest rank of ``comm``,
    cp = its size): what the forward keeps for backward, and the tracemalloc peak of one more step
    after a first (AdamW's state made), above what was held before it. ``ring_at_one``: the ring
    at one rank, whose attention keeps no T x T array as the plain one does (C's effect alone)."""
    strategy = make_strategy(gpt_job(args, comm.size, block), comm)
    model = strategy.model
    if ring_at_one:  # the GPT takes the ring only at cp > 1: hand its attention the size-1 cp group
        for _, module in model.named_modules():
            if isinstance(module, CausalSelfAttention):
                object.__setattr__(module, "cp", strategy.ctx.cp)
    inputs, targets = batch_of(strategy.job, args.batch, 0)
    with kept_for_backward(exclude=model.parameters()) as kept:
        model.loss(inputs, targets)
    one_step(strategy, inputs, targets, 1.0)
    peak = traced_peak(lambda: one_step(strategy, inputs, targets, 1.0))
    kept_bytes, peak = comm.allreduce(kept.bytes, op=MPI.MAX), comm.allreduce(peak, op=MPI.MAX)
    strategy.ctx.close()
    ring = comm.size > 1 or ring_at_one
    return [comm.size, "ring" if ring else "plain", block, block // comm.size, kept_bytes / 2**20, peak / 2**20]


def memory_rows(args, world) -> list:
    """Rank 0: the rows of every C of ``args.cps`` (ranks 0 to C-1; the others sleep) and block."""
    rows = []
    for cp in args.cps:
        group = world.Split(0 if world.Get_rank() < cp else MPI.UNDEFINED, world.Get_rank())
        if group != MPI.COMM_NULL:
            for block in args.blocks:
                variants = (False, True) if cp == 1 else (False,)
                rows += [memory_row(args, group, block, ring_at_one) for ring_at_one in variants]
            group.Free()
        idle_barrier(world)
    return rows if world.Get_rank() == 0 else []


def memory_table(rows: list) -> list:
    """The rows with the ratios to C = 1's ring at the same block (1/C is the ideal)."""
    base = {row[2]: row for row in rows if row[0] == 1 and row[1] == "ring"}

    def ratio(row, column):
        return f"{row[column] / base[row[2]][column]:.3f}" if row[2] in base else "-"

    return [[*row[:4], f"{row[4]:.2f}", ratio(row, 4), f"{row[5]:.2f}", ratio(row, 5), f"{1 / row[0]:.3f}"]
            for row in sorted(rows, key=lambda r: (r[2], r[0]))]


def add_arguments(parser) -> None:
    parser.add_argument("--batch", type=at_least(1), default=1, help="sequences per step (attention and GPT)")
    parser.add_argument("--heads", type=at_least(1), default=4, help="attention heads of the balance measurement")
    parser.add_argument("--head-size", type=at_least(1), default=64, help="head size of the balance measurement")
    parser.add_argument("--tokens", type=at_least(2), default=2048, help="sequence length of the balance measurement")
    parser.add_argument("--n-layer", type=at_least(1), default=2, help="GPT blocks")
    parser.add_argument("--n-embd", type=at_least(1), default=128, help="GPT width")
    parser.add_argument("--n-head", type=at_least(1), default=4, help="GPT attention heads")
    parser.add_argument("--block", type=at_least(2), default=1024, help="GPT context length of the timed steps")
    parser.add_argument("--repeats", type=at_least(1), default=5, help="timed rounds (after one warm-up); medians")
    parser.add_argument("--no-peer", action="store_true", help="leave out PyTorch's context_parallel")
    parser.add_argument("--memory", action="store_true", help="the memory table only (run on max(--cps) ranks)")
    parser.add_argument("--blocks", type=at_least(2), nargs="+", default=[512, 1024, 2048], help="--memory's blocks")
    parser.add_argument("--cps", type=at_least(1), nargs="+", default=[1, 2, 4], help="--memory's cp sizes")
    parser.set_defaults(func=run)


def run(args) -> int:
    world = MPI.COMM_WORLD
    if args.memory and max(args.cps) > world.Get_size():
        raise UsageError(f"hpcpar bench cp --memory: cp {max(args.cps)} needs as many ranks, got {world.Get_size()}")
    if not args.memory and (args.tokens % (2 * world.Get_size()) or args.block % (2 * world.Get_size())):
        raise UsageError(f"hpcpar bench cp: --tokens and --block are cut into 2 x {world.Get_size()} chunks: "
                         f"{args.tokens} and {args.block} must both divide by {2 * world.Get_size()}")
    with limit_blas_threads(1):
        if args.memory:
            print_memory(args, memory_rows(args, world))
            return 0
        # waits that give the core away: a rank's CPU time is then its compute, however loaded the machine
        ctx = init(cp=world.Get_size(), device="cpu", comm=world, wait_policy="yield")
        attention = attention_rows(args, world, ctx)
        ctx.close()
        speed = speed_rows(args, world)
    print_speed(args, world.Get_size(), *attention, speed)
    return 0


def header(ranks: int, timing: str) -> str:
    """The command line (as ``hpcpar ...``, however it was started) and the BLAS kernel."""
    command = " ".join(sys.argv[1:])  # after the program: the hpcpar script or hpcpar/__main__.py
    return (f"command: mpiexec -n {ranks} hpcpar {command}\n{ranks} ranks, one BLAS thread each ({blas_kernel()}), "
            f"float32{timing}")


def print_speed(args, ranks: int, rows, summary, missing, speed) -> None:
    if MPI.COMM_WORLD.Get_rank():
        return
    print(header(ranks, f", medians of {args.repeats} rounds (variants taking turns)"))
    shape = f"B={args.batch} H={args.heads} hs={args.head_size} T={args.tokens} (T/C={args.tokens // ranks} per rank)"
    print(format_table(["layout", "rank", "chunks", "chunk pairs", "wall ms", "cp wait ms", "compute ms", "cpu ms"], rows,
                       title=f"ring_attention forward + backward per rank, {shape}; compute = wall - cp wait; cpu: "
                             f"the rank's CPU time, its waits yielding the core (so: its own work, under any load)"))
    print(format_table(["variant", "wall ms (slowest rank)", "compute max/min", "cpu max/min", "wall max/min"], summary,
                       title="balance across ranks, and the share of the ring's transfer time hidden behind compute "
                             "(hidden = 1 - exposed / alone; exposed: zigzag's cp wait on the least-waiting rank)"))
    for name, why in missing:
        print(f"{name}: did not run: {why}")
    print(format_table(["GPT training step", "ms", "cpu ms", "tokens/s", "speed-up vs 1 rank", "comm waited ms"], speed,
                       title=f"the same step of B={args.batch} x T={args.block} tokens (forward, backward, AdamW; "
                             f"gradients averaged over cp): GPT {args.n_layer} layers, width {args.n_embd}, "
                             f"{args.n_head} heads, vocab 256"))


def print_memory(args, rows) -> None:
    if MPI.COMM_WORLD.Get_rank():
        return
    print(header(MPI.COMM_WORLD.Get_size(), ""))
    print(format_table(["C", "attention", "block", "tokens/rank", "kept MiB", "vs C=1 ring", "step peak MiB",
                        "vs C=1 ring", "1/C"], memory_table(rows),
                       title=f"memory per rank (largest rank): GPT {args.n_layer} layers, width {args.n_embd}, "
                             f"{args.n_head} heads, vocab 256, batch {args.batch}, AdamW fp32; C ranks each "
                             f"(the others sleep)"))
    print("kept: bytes the forward keeps for backward (autograd.memory.kept_for_backward, parameters excluded); "
          "step peak: tracemalloc peak of a training step above what was held before it; plain: "
          "ops.attention (keeps T x T), what cp = 1 runs; ring: ring_attention")
