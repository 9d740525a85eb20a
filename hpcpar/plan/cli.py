"""``hpcpar plan``: predicted step time, memory and traffic of every layout; ``hpcpar plan calibrate``.

    hpcpar plan JOB --world N [--machine FILE] [--top K] [--explain LAYOUT]
    mpiexec -n 4 hpcpar plan calibrate [--out FILE] [--inter FILE]

Serial except ``calibrate``; docs/planner.md describes the model and its validation.
"""
from __future__ import annotations

import os

from ..paths import output_problem
from ..runtime.grid import GRID
from ..tables import format_table
from .machine import DEFAULT_MACHINE, MachineError, load_machine, shipped



def add_arguments(parser) -> None:
    parser.add_argument("job", help="the job file to plan, or the word 'calibrate' to measure this machine")
    parser.add_argument("--world", type=int, default=None, help="ranks to plan for (default: the job's dp x pp x tp x cp)")
    parser.add_argument("--machine", default=None,
                        help=f"machine file, or a shipped one by name ({', '.join(shipped())}) "
                             f"(default: {DEFAULT_MACHINE}, written by hpcpar plan calibrate)")
    parser.add_argument("--top", type=int, default=None, help="layouts shown, best first (0: all) (default: 10)")
    parser.add_argument("--explain", metavar="LAYOUT", default=None,
                        help="the breakdown of one layout, labelled exactly as in the table (another label: "
                             "an error naming the nearest ones) (default: none)")
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help="override a job key, TOML syntax (repeatable) (default: none)")
    parser.add_argument("--out", default=None, help=f"calibrate: the machine file written (default: {DEFAULT_MACHINE})")
    parser.add_argument("--inter", default=None, metavar="FILE",
                        help="calibrate on one node: take the inter-node link from this machine file (default: equal to intra-node)")
    parser.set_defaults(func=run)


def _usage(message: str):
    from ..runtime.failfast import UsageError

    return UsageError(f"hpcpar plan: error: {message}")


def machine_from(path: str | None):
    path = path or DEFAULT_MACHINE
    if path == DEFAULT_MACHINE and not os.path.exists(path):
        raise _usage(f"no machine file {path}: run `hpcpar plan calibrate` first, or pass --machine "
                     f"({', '.join(shipped())} or a file)")
    try:
        return load_machine(path)
    except MachineError as error:
        raise _usage(str(error)) from None


# Flags that only one of the two uses reads: given to the other, they would do nothing.
PLANNING_FLAGS = {"world": "--world", "machine": "--machine", "top": "--top", "explain": "--explain", "set": "--set"}
CALIBRATE_FLAGS = {"out": "--out", "inter": "--inter"}


def refuse_unread_flags(args) -> None:
    """One usage line for flags this use of ``hpcpar plan`` would not read, or out of range."""
    calibrating = args.job == "calibrate"
    unread = PLANNING_FLAGS if calibrating else CALIBRATE_FLAGS
    given = [flag for name, flag in unread.items() if getattr(args, name) not in (None, [])]
    if given:
        what = "calibrate measures this machine" if calibrating else "planning a job writes no machine file"
        raise _usage(f"{', '.join(given)} {'does' if len(given) == 1 else 'do'} nothing here: {what}")
    if args.explain is not None and args.top is not None:
        raise _usage("--top does nothing with --explain, which shows one layout")
    for flag, value, low in (("--world", args.world, 1), ("--top", args.top, 0)):  # --top -1 dropped the last row
        if value is not None and value < low:
            raise _usage(f"{flag} must be >= {low}, got {value}")


def run(args) -> int:
    refuse_unread_flags(args)
    if args.job == "calibrate":
        return run_calibrate(args)
    from ..train.config import JobError
    from ..train.config_load import load_job

    try:
        job = load_job(args.job, args.set)
    except JobError as error:
        raise _usage(str(error)) from None
    from .predict import unmodelled

    why = unmodelled(job)
    if why:
        raise _usage(f"{job.source}: {why}")
    world = args.world or job.parallel.grid_ranks()
    if not world or world < 1:
        raise _usage("--world N is needed (the job does not set parallel.dp)")
    machine = machine_from(args.machine)
    from .layouts import find, not_found, plan_layouts

    ranked = plan_layouts(job, world, machine)
    if args.explain:
        chosen = find(ranked, args.explain)
        if chosen is None:
            raise _usage(not_found(ranked, args.explain, world))
        print(explain(chosen, machine))
        return 0
    print(table(job, world, machine, ranked, 10 if args.top is None else args.top))
    return 0


def run_calibrate(args) -> int:
    from mpi4py import MPI

    from ..runtime.failfast import agreed_verdict
    from .calibrate import calibrate, write_machine

    world = MPI.COMM_WORLD
    out = args.out or DEFAULT_MACHINE
    if args.inter:  # read first: a bad file is one line on every rank, not a traceback after the measuring
        with agreed_verdict("hpcpar plan", (MachineError,)):
            load_machine(args.inter)
    if problem := world.bcast(output_problem(out) if world.Get_rank() == 0 else None, root=0):  # rank 0 writes it
        raise _usage(f"--out {out} {problem}")  # before measuring too: not a traceback after it
    machine, comments = calibrate(world, inter_file=args.inter)
    if world.Get_rank() == 0:
        os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
        write_machine(machine, comments, out)
        c = machine.compute["fp32"]
        print(f"wrote {out}: {comments['name']}; gemm {c.gemm_flops / 1e9:.1f} GFLOP/s, elementwise "
              f"{c.bandwidth / 1e9:.1f} GB/s, op {c.op_overhead_s * 1e6:.1f} us, "
              f"2-rank all-reduce {machine.intra.latency_s * 1e6:.0f} us + {machine.intra.bandwidth / 1e9:.2f} GB/s")
    return 0


def _mb(x: float) -> str:
    """Bytes in MiB, or GiB from 10 GiB up."""
    return f"{x / 2**20:,.1f} MiB" if x < 2**30 * 10 else f"{x / 2**30:,.1f} GiB"


def table(job, world: int, machine, ranked, top: int) -> str:
    unit = "tok/s" if job.model.kind == "gpt" else "img/s"
    tokens = job.data.batch_size * (job.model.block_size if job.model.kind == "gpt" else 1)
    shown = ranked.predictions if top == 0 else ranked.predictions[:top]
    rows = [[str(i + 1), q.label, f"{q.step_s * 1e3:,.2f}", f"{tokens / q.step_s:,.0f}", _mb(q.memory.total),
             "yes" if ranked.fits[id(q)] else "NO", f"{100 * q.comm_share:.0f}%", f"{100 * q.bubble_share:.0f}%",
             f"{q.traffic.wire() / 2**20:,.2f}"] for i, q in enumerate(shown)]
    m, e = job.model, job.moe
    moe = m.kind == "gpt" and e.experts > 0
    model = (f"GPT {m.n_layer} layers, width {m.n_embd}, {m.n_head} heads, context {m.block_size}, "
             f"{parameter_count(job) / 1e6:,.1f} M parameters" if m.kind == "gpt" else "digits CNN")
    if moe:
        model += (f" (MoE: {e.experts} experts, top {e.top_k}, in {m.n_layer // e.every} of {m.n_layer} blocks, "
                  + ("dropless)" if e.capacity_factor is None else f"capacity factor {e.capacity_factor:g})"))
    title = (f"hpcpar plan: {model}, global batch {job.data.batch_size}, {job.precision.name}, {world} ranks on "
             f"{machine.name} ({len(ranked.predictions)} valid layouts, planned in {ranked.seconds:.1f} s)")
    text = format_table(["#", f"layout {layout_heading(moe)}", "step ms", unit, "memory/rank", "fits", "comm",
                         "bubble", "MB sent/step"], rows, title)
    if top and len(ranked.predictions) > top:
        text += f"\n... {len(ranked.predictions) - top} more (--top 0 shows all)"
    reasons: dict = {}
    for name, why in ranked.excluded:
        reasons.setdefault(why, []).append(name)
    for why, names in reasons.items():
        listed = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
        text += f"\nexcluded {listed}: {why}"
    return text


def layout_heading(moe: bool = False) -> str:
    """The axes as the labels spell them: "dp x pp x tp[-cp]" (a suffix axis only above 1), and
    "[-ep]" for an MoE job's expert parallelism (``predict.Layout.label``)."""
    digits = [name for name in GRID.spelt if not GRID.axis(name).suffix]
    suffixes = [name for name in GRID.spelt if GRID.axis(name).suffix] + (["ep"] if moe else [])
    return " x ".join(digits) + "".join(f"[-{name}]" for name in suffixes)


def parameter_count(job) -> int:
    from .inventory import layers
    from .model import shape_of

    return sum(e for layer in layers(shape_of(job, 1, tp=1, ep=1)) for name, e, _ in layer.params
               if not (name == "embed.wte.weight" and layer.name == "head"))


def explain(q, machine) -> str:
    """Where one layout's predicted step goes: parts, per-stage times, memory, messages."""
    lines = [f"{q.label} on {machine.name}: predicted step {q.step_s * 1e3:,.3f} ms"]
    names = {"compute_s": "compute", "comm_s": "comm (exposed)", "idle_s": "idle (bubble)",
             "optimizer_s": "of compute: optimizer"}
    for key, value in q.parts.items():
        if key in names:
            lines.append(f"  {names[key]:<22} {value * 1e3:10.3f} ms")
    lines.append("  per virtual stage and micro-batch (F / B / W ms): " + "; ".join(
        f"s{s}: {f * 1e3:.3f} / {b * 1e3:.3f} / {w * 1e3:.3f}" for s, (f, b, w) in enumerate(q.stage_times)))
    mem = q.memory
    lines.append(f"  memory per rank {_mb(mem.total)}: parameters {_mb(mem.params)}, optimizer state {_mb(mem.optimizer)}, "
                 f"buffers {_mb(mem.buffers)}, gradients {_mb(mem.gradients)}, activations {_mb(mem.activations)}, "
                 f"workspace {_mb(mem.workspace)}")
    for comm, ops in q.traffic.by_comm().items():
        text = ", ".join(f"{op} {calls} calls {nbytes / 2**20:,.2f} MB given, {wire / 2**20:,.2f} MB on the wire"
                         for op, (calls, nbytes, wire) in ops.items())
        lines.append(f"  {comm:<8} (all ranks, one step): {text}")
    return "\n".join(lines)


def dry_run(job_path: str, overrides: list, mpi_world: int, machine_path: str | None) -> int:
    """``hpcpar train JOB --dry-run``: validate, predict this layout, print on rank 0, train nothing.

    The world is the launch's (``mpiexec -n N``); launched alone, the job's own dp x pp x tp x cp."""
    from .. import log
    from ..runtime.failfast import agreed_verdict
    from ..train.config import JobError
    from ..train.config_load import load_job
    from ..train.validate import validate
    from .predict import StepPlan, unmodelled

    with agreed_verdict("hpcpar train", (JobError,)):  # a job file one node lacks: every rank says so, once
        job = load_job(job_path, overrides)
        p = job.parallel
        world = mpi_world if mpi_world > 1 or p.grid_ranks() is None else p.grid_ranks()
        job = validate(job, world)
        if job.parallel.layout == "auto":
            from .auto import planned_job

            job = planned_job(job, world, machine_path)
    path = machine_path or (DEFAULT_MACHINE if os.path.exists(DEFAULT_MACHINE) else None)
    machine = machine_from(path) if path else None
    if log.world_rank() != 0:
        return 0
    why = unmodelled(job)
    if why:
        p = job.parallel
        layout = GRID.mesh(**p.grid_sizes()).label()
        print(f"{job.source}: valid for {world} ranks, layout {layout}; nothing trained (--dry-run)")
        print(f"no prediction: {why}")
        return 0
    plan = StepPlan(job, machine or load_machine("dgx-a100"))  # memory and bytes do not depend on the machine
    q = plan.predict()
    tokens = job.data.batch_size * (job.model.block_size if job.model.kind == "gpt" else 1)
    print(f"{job.source}: valid for {world} ranks, layout {q.label}; nothing trained (--dry-run)")
    lines = explain(q, plan.machine).splitlines()[1:]
    if machine is None:
        print("step time: no machine file (run `hpcpar plan calibrate` or pass --machine)")
        lines = [line for line in lines if not line.endswith(" ms") and "F / B / W" not in line]
    else:
        ranks_on_node = min(world, machine.ranks_per_node)
        fits = q.memory.total <= machine.memory_per_rank(ranks_on_node)
        print(f"predicted on {machine.name}: step {q.step_s * 1e3:,.2f} ms, {tokens / q.step_s:,.0f} "
              f"{'tok' if job.model.kind == 'gpt' else 'img'}/s, comm {100 * q.comm_share:.0f}%, bubble "
              f"{100 * q.bubble_share:.0f}%; memory per rank {_mb(q.memory.total)} "
              f"({'fits' if fits else 'does NOT fit'} in {_mb(machine.memory_per_rank(ranks_on_node))})")
    print("\n".join(lines))
    return 0
