"""``hpcpar bench roofline``: a GPT training step against its matrix products alone, in one run.

    hpcpar bench roofline [--steps 10] [--batch 8] [--precision fp32] [--no-torch]
    mpiexec -n 2 hpcpar bench roofline      # dp 2: each rank its own batch, gradients all-reduced

``hpcpar train``'s step (AllReduce strategy, AdamW, dp = the world) on ``hpcpar bench step``'s GPT,
no dropout or clipping, ``--batch`` sequences per rank, against *GEMM-only*: that step's own
``precision.matmul`` calls, recorded once and replayed alone on the same arrays (16-bit operands
upcast as matmul does). Beside them: the step with NumPy's elementwise passes (where
``autograd.fused`` is built) and PyTorch's (one process, or DDP over gloo). Variants take turns;
medians by wall-clock and CPU time, the slowest rank deciding; one BLAS thread a rank, the header
naming the kernel (``env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE`` for OpenBLAS's own choice).
"""
from __future__ import annotations

import contextlib
import statistics
import time

import numpy as np
from mpi4py import MPI

from ..autograd import fused, precision
from ..backend import get_array_module
from ..cli import at_least
from ..tables import format_table
from ..train.config_load import load_job
from ..train.validate import validate
from .cp import header
from .step import BENCH_CONFIG, limit_blas_threads
from .zero import make_strategy, one_step

WARMUP = 2


def roofline_job(args, world: int, precision_name: str):
    """``hpcpar bench step``'s GPT as a job at dp = ``world``: ``args.batch`` sequences per rank."""
    c = BENCH_CONFIG
    overrides = [f"model.n_layer={c.n_layer}", f"model.n_embd={c.n_embd}", f"model.n_head={c.n_head}",
                 f"model.block_size={c.block_size}", "model.dropout=0.0", f"data.batch_size={args.batch * world}",
                 f"parallel.dp={world}", f'train.precision="{precision_name}"', "optimizer.grad_clip=0.0",
                 'train.device="cpu"']
    return validate(load_job(None, overrides), world)


@contextlib.contextmanager
def recorded_products():
    """Inside: every ``precision.matmul`` call appends its operands, as multiplied, to the yielded list."""
    calls, original = [], precision.matmul

    def recording(a, b, keep_float32=False):
        calls.append(multiplied(a, b))
        return original(a, b, keep_float32)

    precision.matmul = recording
    try:
        yield calls
    finally:
        precision.matmul = original


def multiplied(a, b) -> tuple:
    """The operands as ``precision.matmul`` hands them to BLAS: 16-bit ones upcast on NumPy."""
    if precision.compute_dtype((a, b)) is not None and get_array_module(a) is np:
        return precision.upcast(a), precision.upcast(b)
    return a, b


def flops(calls) -> float:
    """2·m·k·n summed over the products (batch dimensions broadcast)."""
    total = 0.0
    for a, b in calls:
        batch = np.broadcast_shapes(a.shape[:-2], b.shape[:-2])
        total += 2.0 * float(np.prod(batch)) * a.shape[-2] * a.shape[-1] * b.shape[-1]
    return total


def replay(calls):
    """The products alone, on the recorded arrays."""
    def gemms():
        for a, b in calls:
            a @ b
    return gemms


def hpcpar_step(args, world, numpy_passes: bool = False):
    """One training step of a fresh strategy on a fresh batch of this rank's own; ``numpy_passes``:
    with the elementwise passes in NumPy (``autograd.fused`` set aside), the fused passes' baseline."""
    strategy = make_strategy(roofline_job(args, world.Get_size(), args.precision), world)
    rng = np.random.default_rng([world.Get_rank(), 0])

    def step():
        ids = rng.integers(0, BENCH_CONFIG.vocab_size, (args.batch, BENCH_CONFIG.block_size + 1))
        with fused.numpy_path() if numpy_passes else contextlib.nullcontext():
            one_step(strategy, ids[:, :-1], ids[:, 1:], 0.0)

    return step


def variants(args, world) -> tuple[dict, float, list]:
    """({name: step function}, GEMM flops of one hpcpar step, [(peer, why it did not run)])."""
    size, found, missing = world.Get_size(), {}, []
    step = hpcpar_step(args, world)
    step()  # AdamW's state made, the buffers allocated: the recorded step is a steady one
    with recorded_products() as calls:
        step()
    found[f"hpcpar {args.precision}"] = step
    found[f"GEMM-only ({len(calls)} products)"] = replay(calls)
    if fused.status().startswith("native"):
        found[f"hpcpar {args.precision}, NumPy passes"] = hpcpar_step(args, world, numpy_passes=True)
    if not args.no_torch:
        from .torch_peers import ddp_step

        peer = "pytorch fp32" if size == 1 else "pytorch DDP fp32 (gloo)"
        torch_step, why = ddp_step(BENCH_CONFIG, args.batch, world)
        if torch_step is None:
            missing.append((peer, why))
        else:
            found[peer] = torch_step
    return found, flops(calls), missing


def measure(args, world) -> dict:
    """{name: (wall, cpu)}: median seconds of the slowest rank, wall-clock and the process's CPU time
    (steadier on a shared machine: a rank's own work), the variants taking turns after ``WARMUP`` rounds."""
    found, gemm_flops, missing = variants(args, world)
    times = {name: ([], []) for name in found}
    for round_ in range(WARMUP + args.steps):
        for name, step in found.items():
            world.Barrier()
            wall, cpu = time.perf_counter(), time.process_time()
            step()
            wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
            if round_ >= WARMUP:
                times[name][0].append(world.allreduce(wall, op=MPI.MAX))
                times[name][1].append(world.allreduce(cpu, op=MPI.MAX))
    return {"times": {name: (statistics.median(w), statistics.median(c)) for name, (w, c) in times.items()},
            "flops": gemm_flops, "missing": missing}


def table_rows(result: dict, tokens: int) -> list:
    """[variant, ms, cpu ms, GFLOP/s of the products, tokens/s, vs GEMM-only (wall, cpu), vs hpcpar] per variant."""
    times = result["times"]
    gemm = next(t for name, t in times.items() if name.startswith("GEMM-only"))
    ours = next(iter(times.values()))
    return [[name, wall * 1e3, cpu * 1e3, f"{result['flops'] / wall / 1e9:.0f}", f"{tokens / wall:,.0f}",
             f"{wall / gemm[0]:.2f}", f"{cpu / gemm[1]:.2f}", f"{wall / ours[0]:.2f}"]
            for name, (wall, cpu) in times.items()]


def add_arguments(parser) -> None:
    parser.add_argument("--batch", type=at_least(1), default=8, help="sequences per rank per step")
    parser.add_argument("--steps", type=at_least(1), default=10, help=f"timed rounds (after {WARMUP} warm-up)")
    parser.add_argument("--precision", default="fp32", choices=["fp32", "bf16", "fp16", "fp64"],
                        help="hpcpar's compute precision (16 bits: float32 masters; PyTorch stays fp32)")
    parser.add_argument("--no-torch", action="store_true", help="leave out the PyTorch peer")
    parser.set_defaults(func=run)


def run(args) -> int:
    world = MPI.COMM_WORLD
    with limit_blas_threads(1):
        result = measure(args, world)
    if world.Get_rank() == 0:
        print_table(args, world.Get_size(), result)
    return 0


def print_table(args, ranks: int, result: dict) -> None:
    c = BENCH_CONFIG
    print(header(ranks, f" products, medians of {args.steps} rounds (variants taking turns, after {WARMUP} warm-up)"))
    title = (f"GPT step n_layer {c.n_layer} n_head {c.n_head} n_embd {c.n_embd} block {c.block_size} vocab "
             f"{c.vocab_size}, {args.batch} sequences per rank, dp {ranks}, AdamW, no dropout; GEMM-only: the "
             f"hpcpar step's own products replayed alone; GFLOP/s: the products' flops / the row's time")
    print(format_table(["variant", "ms/step", "cpu ms/step", "GFLOP/s", "tokens/s", "vs GEMM-only", "cpu vs GEMM-only",
                        "vs hpcpar"],
                       table_rows(result, args.batch * ranks * c.block_size), title=title))
    print(f"elementwise passes: {fused.status()}")
    for name, why in result["missing"]:
        print(f"not run: {name}: {why}")
