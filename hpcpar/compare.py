"""``hpcpar compare JOB.toml``: the layouts side by side, measured on your model and machine.

    mpiexec -n 4 hpcpar compare jobs/gpt-dp.toml [--steps 8] [--out runs/compare]

Runs the job's model and data for a few steps under one rank (the baseline), then under every
layout of the world the model allows (``factorisations``: pure data, pipeline and tensor
parallelism, then the hybrids), one after another in one MPI job, and reports throughput,
speed-up, where the step goes, memory and traffic per layout (``measure``) under a header
naming the CPUs and threads (``cpu_budget``). Prints the table, writes ``compare.json`` and,
with matplotlib, ``compare.png``. Layouts the job cannot run in are listed under the table
with the reason; a job whose one-rank baseline cannot run (a parameter-server job: its servers
need ranks of their own) is refused with one line before anything runs. An MoE job's
``parallel.ep`` is kept where it divides a layout's dp, else cut to the largest that does.
"""
from __future__ import annotations

import json
import math
import os
import statistics
import time
from dataclasses import replace

from mpi4py import MPI

from . import host, log
from .backend import DeviceError
from .bench.step import traced_peak
from .runtime.context import init
from .runtime.grid import GRID
from .runtime.process import agreed_device
from .runtime.failfast import UsageError, agreed_verdict
from .paths import output_problem
from .runtime.waiting import wait_idle
from .parallel.pipeline.schedules import interleaved_fit
from .optim import check_precision
from .tables import format_table
from .train.build import build
from .train.config import JobError
from .train.config_load import load_job
from .train.identity import ranks_with_another_job
from .train.loop import context_options, step_masks
from .train.validate import check_machine, validate

logger = log.get_logger(__name__)


def factorisations(n: int) -> list[tuple[int, ...]]:
    """The grid's layouts of n ranks (their ``Mesh.shape``): pure strategies first, then hybrids."""
    layouts = [mesh.shape for mesh in GRID.factorisations(n)]
    pure = [shape for axis in range(len(GRID.spelt)) for shape in layouts if shape[axis] == n] if n > 1 else layouts
    return pure + [layout for layout in layouts if layout not in pure]


def label(layout) -> str:
    """"2x1x1 pure data": the sizes and which kind of parallelism the layout is."""
    mesh = GRID.mesh(*layout)
    kinds = [GRID.axis(name).kind for name, size in mesh.by_name().items() if size > 1]
    kind = "one rank" if not kinds else (f"pure {kinds[0]}" if len(kinds) == 1 else "hybrid")
    return f"{mesh.label()} {kind}"


def layout_job(job, layout, steps: int, precision: str | None = None, zero: int | None = None):
    mesh = GRID.mesh(*layout)
    pp, tp = mesh.size("pp"), mesh.size("tp")
    micro = job.parallel.micro_batches if pp > 1 else 1
    if pp > 1 and micro < pp:
        micro = 2 * pp  # a pipeline needs micro-batches to fill its stages
    parallel = replace(job.parallel, **mesh.by_name(), micro_batches=micro,
                       schedule=job.parallel.schedule if pp > 1 else "1f1b", chunks=1 if pp == 1 else job.parallel.chunks,
                       sequence_parallel=job.parallel.sequence_parallel and tp > 1,  # nothing to split at tp = 1
                       zero=job.parallel.zero if zero is None else zero,
                       ep=math.gcd(job.parallel.ep, mesh.size("dp")))  # experts over a group of dp: at most dp
    if parallel.schedule == "interleaved" and (interleaved_fit(pp, micro) is not None or pp * parallel.chunks > job.num_layers):
        parallel = replace(parallel, schedule="1f1b", chunks=1)
    train = replace(job.train, steps=steps + 2, eval_interval=0, sample_tokens=0,
                    precision=precision or job.precision.name)
    return validate(replace(job, parallel=parallel, train=train), mesh.world_size)


def step_shares(stats: dict, inter_node_s: float = 0.0) -> tuple[float, float, float]:
    """(communication, idle, inter-node) shares of one rank's step: compute is the rest, so that
    compute, communication and idle add up to 1; the inter-node share (``inter_node_s``, the
    communication across nodes) is part of the communication share.

    The step is the longer of its measured time and its parts (a strategy's finish adds to the
    parts after the step's own time was taken)."""
    parts = sum(max(stats.get(key, 0.0), 0.0) for key in ("compute_s", "comm_s", "idle_s"))
    step = max(stats.get("step_s", 0.0), parts)
    if step <= 0:
        return 0.0, 0.0, 0.0
    comm = min(max(stats.get("comm_s", 0.0), 0.0), step)
    idle = min(max(stats.get("idle_s", 0.0), 0.0), step - comm)
    return comm / step, idle / step, min(max(inter_node_s, 0.0), comm) / step


def measure(job, comm, steps: int) -> dict:
    """Train ``steps`` + 2 steps of ``job`` on ``comm`` and return this layout's figures (on rank 0).

    As medians over the steps after two warm-up steps (the slowest rank decides a step):
    throughput, and (in ``run``) the speed-up over one rank and scaling efficiency = speed-up /
    ranks; where the step goes (``step_shares``: communication, idle, compute; averaged over the
    steps and then over the ranks), on several nodes the share spent communicating across nodes
    (the time less that on the communicators whose ranks share a node) and which communicators
    cross nodes; parameter + optimizer-state memory per rank, and the peak of NumPy allocations
    during a step (activations and workspace, from tracemalloc on one extra step); bytes sent
    per step on the network, as ring algorithms would send them (``runtime.stats.ring_wire_bytes``)."""
    ctx = init(**job.parallel.grid_sizes(), comm=comm, **context_options(job))  # parallel.shm, backend, ...
    run = build(job, ctx)
    strategy = run.strategy
    times, shares = [], []
    # Communication on the communicators that stay inside a node; on several nodes, the rest of
    # comm_s crossed nodes.
    inside = [c for name, c in ctx.axes.items() if name not in ctx.crossing_axes]
    several_nodes = ctx.topology.nodes > 1
    ctx.reset_stats()
    for step in range(steps + 2):
        if step == 2:
            ctx.reset_stats()
        inputs, targets = run.train_data.batch_at(step)
        ctx.world.barrier()
        inside_before = sum(c.stats.total_seconds for c in inside)
        start = time.perf_counter()
        with step_masks(run, step):
            loss = strategy.train_step(inputs, targets)
            strategy.finish_step(job.optimizer.grad_clip, loss)
        elapsed = ctx.world.mpi.allreduce(time.perf_counter() - start, op=MPI.MAX)
        if step >= 2:
            times.append(elapsed)
            inside_s = sum(c.stats.total_seconds for c in inside) - inside_before
            inter_node_s = strategy.stats.get("comm_s", 0.0) - inside_s if several_nodes else 0.0
            shares.append(step_shares(strategy.stats, inter_node_s))
    traffic = sum(c.stats.total_wire_bytes for c in ctx.communicators().values())  # size 1 sends nothing
    inputs, targets = run.train_data.batch_at(0)
    losses = []
    with step_masks(run, 0):
        activation_peak = traced_peak(lambda: losses.append(strategy.train_step(inputs, targets)))
        strategy.finish_step(0.0, losses[0])
    state = strategy.optimizer_state_bytes()  # with the float32 masters under mixed precision
    params = strategy.parameter_bytes()
    step_s = statistics.median(times)
    gather = lambda value, op=MPI.MAX: ctx.world.mpi.allreduce(value, op=op)  # noqa: E731
    tokens = job.data.batch_size * (job.model.block_size if job.model.kind == "gpt" else 1)
    comm_share, idle_share, inter_share = (gather(statistics.fmean(s[k] for s in shares), MPI.SUM) / ctx.world_size
                                           for k in (0, 1, 2))
    figures = {"layout": list(ctx.mesh.shape), "zero": job.parallel.zero, "precision": job.precision.name, "ranks": ctx.world_size, "step_s": step_s,
            "tokens_per_s": tokens / step_s,
            "compute_share": 1.0 - comm_share - idle_share, "comm_share": comm_share, "bubble_share": idle_share,
            "inter_node_share": inter_share, "nodes": ctx.topology.nodes, "across_nodes": ctx.crossing_axes,
            "param_state_mb_per_rank": gather(params + state) / 2**20,
            "activation_peak_mb_per_rank": gather(activation_peak) / 2**20,
            "bytes_per_step": gather(traffic / steps, MPI.SUM)}
    ctx.close()  # the next layout needs communicator ids of its own
    return figures


def layouts_to_measure(job, world_size: int, steps: int, precisions, zeros=(None,)) -> tuple[list, list]:
    """([the job of each layout to measure], [(label, why) of each layout left out]): the same on
    every rank, before anything runs; each layout in each of ``precisions`` and, where it has
    replicas, each ZeRO stage of ``zeros`` (None: the job's). JobError when the one-rank
    baseline of a precision is refused (a parameter-server job's, say): every speed-up is
    measured against it."""
    runs, skipped = [], []
    baseline = GRID.mesh().shape  # one rank
    layouts = [baseline] + (factorisations(world_size) if world_size > 1 else [])
    for layout, precision, zero in [(layout, precision, zero) for layout in layouts for precision in precisions
                                    for zero in zeros]:
        if zero is not None and GRID.mesh(*layout).size("dp") == 1 and zero != zeros[0]:
            continue  # nothing to shard over: the layout's first row is the one
        try:
            runs.append(layout_job(job, layout, steps, precision, zero))
        except JobError as error:
            if layout == baseline:
                raise JobError(error.source, [(key, f"{text} (in the one-rank baseline every speed-up is measured "
                                                    f"against)") for key, text in error.problems]) from None
            skipped.append((label(layout), "; ".join(text for _, text in error.problems)))
    return runs, skipped


class JobsDiffer(RuntimeError):
    """The ranks hold different jobs; raised on every rank, reported once (by world rank 0)."""

    report_elsewhere = False


def same_job_everywhere(job, world) -> None:
    """Raise JobsDiffer on every rank alike unless every rank of ``world`` holds ``job``'s settings
    (collective: one small all-gather of a digest)."""
    differ = ranks_with_another_job(job, world)
    if differ:
        error = JobsDiffer(f"hpcpar compare: world rank(s) {differ} hold another job than rank 0 "
                           f"(job {job.source} here); every rank must measure the same job")
        error.report_elsewhere = world.Get_rank() != 0
        raise error


def measure_on_first_ranks(job, world, steps: int) -> dict | None:
    """``measure`` ``job`` on the first ranks of ``world`` that its layout holds: its figures there,
    None on the other ranks (collective over ``world``, which they only join to split it; they
    then wait in a barrier that sleeps, ``runtime.waiting.wait_idle``, in ``run``).

    Every rank must pass the same job: a rank that builds another model (it read a job file
    another rank was rewriting, say) would call the layout's collectives with other buffers, and
    MPI would fail or hang in one of them: ``same_job_everywhere`` checks first."""
    same_job_everywhere(job, world)
    group = world.Split(0 if world.Get_rank() < job.parallel.grid_ranks() else MPI.UNDEFINED, world.Get_rank())
    if group == MPI.COMM_NULL:
        return None
    figures = measure(job, group, steps)
    group.Free()  # after the layout's last collective, on every rank of it
    return figures


def add_arguments(parser) -> None:
    parser.add_argument("job", help="the job file whose model, data and optimizer are measured")
    parser.add_argument("--steps", type=int, default=8, help="timed steps per layout (after 2 warm-up steps)")
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help="override a job key, TOML syntax (repeatable) (default: none)")
    parser.add_argument("--out", default=None,
                        help="folder for compare.json and compare.png (default: runs/compare-JOB)")
    parser.add_argument("--precision", nargs="+", choices=["fp32", "bf16", "fp16"], default=None,
                        help="also measure each layout in these precisions, beside fp32 (default: the job's only)")
    parser.add_argument("--zero", nargs="+", type=int, choices=[0, 1, 2, 3], default=None,
                        help="measure each layout with replicas under these ZeRO stages, a row each (default: the "
                             "job's parallel.zero only)")
    parser.set_defaults(func=run)


def cpu_budget(world) -> tuple[str, str | None]:
    """(the header's words on CPUs and threads, a warning when a node runs more threads than it may use).

    Per node: the CPUs its ranks may run on (the union of their affinity masks, capped by the
    cgroup's quota) against the sum of the ranks' BLAS threads (after hpcpar's share of the cores)."""
    node = world.Split_type(MPI.COMM_TYPE_SHARED, key=world.Get_rank())
    host.share_cores(node.Get_size())  # what init does in every layout
    facts = node.gather((host.affinity(), host.blas_thread_count()), root=0)
    summary = None
    if node.Get_rank() == 0:
        cpus = host.usable_cpus(set().union(*(mask for mask, _ in facts)))
        summary = (os.uname().nodename, cpus, [threads for _, threads in facts])
    node.Free()
    nodes = [s for s in world.gather(summary, root=0) or [] if s is not None]
    if world.Get_rank() != 0:
        return "", None
    counts = sorted({t for _, _, threads in nodes for t in threads})
    per_rank = str(counts[0]) if len(counts) == 1 else f"{counts[0]}-{counts[-1]}"
    cpus = sum(c for _, c, _ in nodes)
    text = (f"{world.Get_size()} ranks on {len(nodes)} nodes ({cpus} usable CPUs)" if len(nodes) > 1 else
            f"{world.Get_size()} ranks on {cpus} usable CPUs") + f", {per_rank} BLAS thread(s) per rank"
    over = [(name, cpus, threads) for name, cpus, threads in nodes if sum(threads) > cpus]
    if not over:
        return text, None
    name, cpus, threads = over[0]
    fix = (f"launch at most {cpus} ranks per node" if len(threads) > cpus else
           f"set OMP_NUM_THREADS and OPENBLAS_NUM_THREADS to {cpus // len(threads)}")
    return text, (f"{len(threads)} ranks with {sum(threads)} BLAS threads in all on {cpus} usable CPU(s) of {name}: "
                  f"the cores are oversubscribed and the timings of every layout are distorted; {fix}")


def run(args) -> int:
    world = MPI.COMM_WORLD
    if args.steps < 1:  # every figure is a median over the timed steps
        raise UsageError(f"hpcpar compare: error: --steps must be >= 1 (timed steps per layout), got {args.steps}")
    precisions = [None] if args.precision is None else ["fp32"] + [p for p in args.precision if p != "fp32"]
    with agreed_verdict("hpcpar compare", (JobError,)):  # the same verdict on every rank, before any waits
        job = load_job(args.job, args.set)
        zeros = (None,) if args.zero is None else tuple(dict.fromkeys(args.zero))
        runs, skipped = layouts_to_measure(job, world.Get_size(), args.steps, precisions, zeros)
        for layout_job in runs:  # this machine's environment and memory, as hpcpar train checks them
            check_machine(layout_job, writes=False)  # its metrics, trace and checkpoints are never written
    with agreed_verdict("hpcpar compare", (DeviceError,)):  # every rank gets here: the device as init agrees on it
        device = agreed_device(world, job.train.device)
        for precision in sorted({run.precision for run in runs}, key=lambda p: p.name):  # as training checks it
            check_precision(device, precision)
    cpus, problem = cpu_budget(world)
    if problem:
        logger.warning(problem)
    out = args.out or os.path.join("runs", "compare-" + os.path.basename(args.job).rsplit(".", 1)[0])
    # before measuring (it was a traceback after every layout ran); rank 0 writes it, so rank 0's verdict
    if problem := world.bcast(output_problem(out, folder=True) if world.Get_rank() == 0 else None, root=0):
        raise UsageError(f"hpcpar compare: error: --out {out} {problem}")
    results = []
    for layout_run in runs:
        figures = measure_on_first_ranks(layout_run, world, args.steps)
        if world.Get_rank() == 0:
            results.append(figures)
        wait_idle(world.Ibarrier())  # ranks outside a smaller layout: leave the cores to it
    if world.Get_rank() != 0:
        return 0
    base = {r["precision"]: r["tokens_per_s"] for r in reversed(results)}  # one rank, in each precision
    fp32 = {(tuple(r["layout"]), r["zero"]): r for r in results if r["precision"] == "fp32"}
    for r in results:
        r["speedup"] = r["tokens_per_s"] / base[r["precision"]]
        r["efficiency"] = r["speedup"] / r["ranks"]
        r["label"] = (label(r["layout"]) + (f" zero-{r['zero']}" if args.zero is not None and r["zero"] else "")
                      + (f" {r['precision']}" if len(precisions) > 1 else ""))
        same = fp32.get((tuple(r["layout"]), r["zero"]))
        if same is not None:  # beside the same layout in float32
            r["step_vs_fp32"] = r["step_s"] / same["step_s"]
            r["activations_vs_fp32"] = r["activation_peak_mb_per_rank"] / same["activation_peak_mb_per_rank"]
    print(report(job, results, skipped, cpus, args.steps), flush=True)
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "compare.json"), "w") as f:
        json.dump({"job": args.job, "world": world.Get_size(), "steps": args.steps, "cpus": cpus,
                   "cpu_warning": problem, "results": results, "skipped": skipped}, f, indent=1)
    from .plot import plot_compare

    chart = plot_compare(os.path.join(out, "compare.json"), os.path.join(out, "compare.png"))
    print(f"wrote {os.path.join(out, 'compare.json')}" + (f" and {chart}" if chart else ""), flush=True)
    return 0


def report(job, results, skipped, cpus: str, steps: int) -> str:
    """The table under a header naming the CPUs and threads (``cpus``). On several nodes the comm
    column adds, in brackets, the share of the step spent communicating across nodes, and a
    column names the communicators that cross them."""
    unit = "tok/s" if job.model.kind == "gpt" else "img/s"
    nodes = max(r["nodes"] for r in results)
    versus = any(r["precision"] != "fp32" and "step_vs_fp32" in r for r in results)
    rows = []
    for r in results:
        comm = f"{100 * r['comm_share']:.0f}%" + (f" ({100 * r['inter_node_share']:.0f}%)" if nodes > 1 else "")
        row = [r["label"], f"{r['tokens_per_s']:,.0f}", f"{r['speedup']:.2f}x", f"{100 * r['efficiency']:.0f}%",
               comm, f"{100 * r['bubble_share']:.0f}%", f"{r['param_state_mb_per_rank']:.1f}",
               f"{r['activation_peak_mb_per_rank']:.1f}", f"{r['bytes_per_step'] / 2**20:.2f}"]
        if versus:
            row += [f"{r['step_vs_fp32']:.2f}" if "step_vs_fp32" in r else "-",
                    f"{r['activations_vs_fp32']:.2f}" if "activations_vs_fp32" in r else "-"]
        rows.append(row + ([",".join(r["across_nodes"]) or "-"] if nodes > 1 else []))
    m = job.model
    model = (f"GPT layers {m.n_layer}, width {m.n_embd}, heads {m.n_head}, context {m.block_size}"
             if m.kind == "gpt" else "digits CNN")
    headers = [f"layout {' x '.join(GRID.spelt)}", unit, "speed-up", "efficiency", "comm" if nodes == 1 else "comm (inter-node)",
               "bubble", "params+opt MB/rank", "activations MB/rank", "MB sent/step"]
    headers += ["step vs fp32", "activations vs fp32"] if versus else []
    text = format_table(headers + (["across nodes"] if nodes > 1 else []), rows,
                        f"hpcpar compare: {model}, global batch {job.data.batch_size}, {cpus}, median of {steps} steps")
    for name, why in skipped:
        text += f"\nskipped {name}: {why}"
    if versus:
        from .bench.step import CPU_NOTE

        text += "\n\nspeed-up: over one rank in the same precision. " + CPU_NOTE
    return text
