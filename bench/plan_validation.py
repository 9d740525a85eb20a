"""The planner against measurement, out of sample: calibrate, predict, measure with ``hpcpar compare``.

    mpiexec -n 4 hpcpar run bench/plan_validation.py [--steps 5] [--out runs/plan-validation]

1. ``hpcpar plan calibrate`` on all ranks: op families, concurrency, collectives per group size,
   and the machine's ``model_factor`` from the calibration GPT (4 layers, width 128, on one rank:
   the only model the planner sees; ``hpcpar.plan.calibrate.fit_model``).
2. For three held-out models (a deeper-narrower GPT, a shallower-wider GPT, the digits CNN)
   at 2 and 4 ranks: every layout ``hpcpar compare`` runs (its own ``layout_job`` and
   ``measure``, the same steps and medians), predicted first, then measured.
3. Tables: layout | predicted ms | measured ms | error; memory per rank predicted vs measured
   (parameters + optimizer state; the tracemalloc peak of a step); bytes per step predicted vs
   counted; whether the measured best layout is in the predicted top 2.

``--models 0,1,2`` picks the held-out models (all three in one run by default, or one per run:
``for m in 0 1 2; do mpiexec -n 4 hpcpar run bench/plan_validation.py --models $m --out
runs/plan-validation-$m; done``).
``--against JOB COMPARE_JSON MACHINE`` prints predictions beside an earlier ``hpcpar compare`` run.

Runs with more ranks than cores are oversubscribed: the planner slows compute by ranks / cores
and the summary reports those rows apart (the targets are for ranks <= cores).
"""
import argparse
import json
import os
import statistics
import sys
import tempfile

for variable in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(variable, "1")
# Ranks outside a layout wait for its whole run (a minute under load): no stall census for them.
os.environ.setdefault("HPCPAR_STALL_S", "0")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from mpi4py import MPI  # noqa: E402

from hpcpar import host  # noqa: E402
from hpcpar.compare import factorisations, layout_job, measure_on_first_ranks  # noqa: E402
from hpcpar.runtime.waiting import wait_idle  # noqa: E402
from hpcpar.plan.calibrate import calibrate, write_machine  # noqa: E402
from hpcpar.plan.predict import StepPlan  # noqa: E402
from hpcpar.tables import format_table  # noqa: E402
from hpcpar.train.config import JobError  # noqa: E402
from hpcpar.train.config_load import load_job  # noqa: E402

GPT = """[model]\nkind = "gpt"\nblock_size = {s}\nn_layer = {L}\nn_head = {a}\nn_embd = {h}\n
[data]\nbatch_size = {b}\n[parallel]\nmicro_batches = 4\n[optimizer]\ngrad_clip = 1.0\n[train]\nsteps = 10\ndevice = "cpu"\n"""
CNN = """[model]\nkind = "cnn"\nchannels = [32, 64]\n[data]\nkind = "digits"\nbatch_size = 256\n
[parallel]\nmicro_batches = 4\n[optimizer]\nname = "adamw"\n[train]\nsteps = 10\ndevice = "cpu"\n"""
HELD_OUT = [("deep-narrow GPT 8x64", GPT.format(s=64, L=8, a=4, h=64, b=16)),
            ("shallow-wide GPT 2x256", GPT.format(s=64, L=2, a=8, h=256, b=16)),
            ("digits CNN 32/64", CNN)]


def job_from(text: str, name: str):
    """The job of ``text``, read by this rank from a file of its own.

    Not one file shared by the ranks: each rewrote it while others read it, and a rank that read
    it half written built the defaults' model (width 256 for 64); its parameter broadcast then
    failed in MPICH ("Other MPI error" in MPIDU_Sched_progress_state) or its layouts went out of
    step with the other ranks'. A rank's own folder also exists on every node."""
    with tempfile.TemporaryDirectory(prefix="plan-validation-") as folder:
        path = os.path.join(folder, name.split()[0] + ".toml")
        with open(path, "w") as f:
            f.write(text)
        return load_job(path)


def run_layouts(job, machine, world, ranks: int, steps: int) -> list:
    """[(label, prediction, measured figures)] for every layout compare runs at ``ranks`` (rank 0)."""
    rows = []
    for layout in [(1, 1, 1)] + factorisations(ranks):
        try:
            layout_run = layout_job(job, layout, steps)
        except JobError:
            continue
        figures = measure_on_first_ranks(layout_run, world, steps)
        wait_idle(world.Ibarrier())  # ranks outside a smaller layout: leave the cores to it
        if world.Get_rank() == 0:
            prediction = StepPlan(layout_run, machine).predict()
            rows.append((prediction.label, prediction, figures))
    return rows


def tables(model: str, ranks: int, rows, cores: int) -> tuple[str, dict]:
    timing, memory = [], []
    errors = []
    for label, q, m in rows:
        measured_ms, predicted_ms = m["step_s"] * 1e3, q.step_s * 1e3
        error = (predicted_ms - measured_ms) / measured_ms
        errors.append(abs(error))
        counted = m["bytes_per_step"]
        predicted_bytes = q.traffic.wire() - q.traffic.wire("pp-tied")  # compare counts ctx's communicators
        timing.append([label, f"{predicted_ms:,.1f}", f"{measured_ms:,.1f}", f"{100 * error:+.0f}%",
                       f"{predicted_bytes:,}", f"{counted:,.0f}", "exact" if abs(predicted_bytes - counted) < 0.5 else "DIFF"])
        peak_p = q.memory.activation_peak / 2**20
        state_p = q.memory.param_state / 2**20
        memory.append([label, f"{state_p:.2f}", f"{m['param_state_mb_per_rank']:.2f}", f"{peak_p:.2f}",
                       f"{m['activation_peak_mb_per_rank']:.2f}",
                       f"{100 * (peak_p - m['activation_peak_mb_per_rank']) / m['activation_peak_mb_per_rank']:+.0f}%"])
    measured_best = min(rows, key=lambda r: r[2]["step_s"])[0]
    predicted_order = [r[0] for r in sorted(rows, key=lambda r: r[1].step_s)]
    top2 = measured_best in predicted_order[:2]
    over = " (oversubscribed)" if ranks > cores else ""
    text = format_table(["layout dp x pp x tp", "predicted ms", "measured ms", "error", "predicted B/step",
                         "counted B/step", "bytes"], timing, f"{model}, {ranks} ranks{over}: step time and traffic")
    text += "\n" + format_table(["layout", "params+opt MB pred", "measured", "step peak MB pred", "measured", "error"],
                                memory, f"{model}, {ranks} ranks: memory per rank (max over ranks)")
    text += (f"\nmeasured best {measured_best}; predicted order {', '.join(predicted_order)}; "
             f"measured best in predicted top 2: {'yes' if top2 else 'NO'}")
    return text, {"model": model, "ranks": ranks, "oversubscribed": ranks > cores, "errors": errors, "top2": top2,
                  "bytes_exact": all(t[-1] == "exact" for t in timing),
                  "memory_errors": [float(r[-1].rstrip("%")) / 100 for r in memory]}


def against_compare(job_path: str, compare_json: str, machine_path: str) -> str:
    """Predictions beside a ``hpcpar compare`` run made elsewhere (the two-node cluster, say): serial."""
    from hpcpar.plan.machine import load_machine

    with open(compare_json) as f:
        measured = json.load(f)
    job, machine, rows = load_job(job_path), load_machine(machine_path), []
    for m in measured["results"]:
        q = StepPlan(layout_job(job, tuple(m["layout"]), measured["steps"]), machine).predict()
        wire = q.traffic.wire() - q.traffic.wire("pp-tied")
        rows.append([q.label, f"{q.step_s * 1e3:,.1f}", f"{m['step_s'] * 1e3:,.1f}",
                     f"{100 * (q.step_s - m['step_s']) / m['step_s']:+.0f}%", f"{100 * q.comm_share:.0f}%",
                     f"{100 * m['comm_share']:.0f}%", "exact" if abs(wire - m["bytes_per_step"]) < 0.5 else "DIFF"])
    return format_table(["layout", "predicted ms", "measured ms", "error", "comm pred", "comm measured", "bytes"], rows,
                        f"{job_path} on {machine.name} ({machine.ranks_per_node} ranks per node) against {compare_json}")


def main(argv) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--out", default=os.path.join("runs", "plan-validation"))
    parser.add_argument("--models", default="0,1,2", help="which held-out models (indices)")
    parser.add_argument("--against", nargs=3, metavar=("JOB", "COMPARE_JSON", "MACHINE"),
                        help="only print predictions beside an earlier hpcpar compare run (serial)")
    args = parser.parse_args(argv)
    if args.against:
        print(against_compare(*args.against))
        return 0
    world = MPI.COMM_WORLD
    machine, comments = calibrate(world)  # its model_factor: the calibration GPT, 4 layers of width 128, one rank
    if world.Get_rank() == 0:
        os.makedirs(args.out, exist_ok=True)
        write_machine(machine, comments, os.path.join(args.out, "machine.toml"))
        print(f"calibrated: {comments['name']}; model factor {machine.compute['fp32'].model_factor:.3f} from the "
              f"calibration GPT (4 layers, width 128)", flush=True)
    wait_idle(world.Ibarrier())
    cores = host.usable_cpus()
    summaries, texts = [], []
    for name, text in [HELD_OUT[int(i)] for i in args.models.split(",")]:
        job = job_from(text, name)
        for ranks in (2, 4):
            if ranks > world.Get_size():
                continue
            rows = run_layouts(job, machine, world, ranks, args.steps)
            if world.Get_rank() == 0:
                table_text, summary = tables(name, ranks, rows, cores)
                print(table_text + "\n", flush=True)
                texts.append(table_text)
                summaries.append(summary)
    if world.Get_rank() == 0:
        print(summary_text(summaries, cores))
        with open(os.path.join(args.out, "validation.json"), "w") as f:
            json.dump(summaries, f, indent=1)
    return 0


def summary_text(summaries, cores: int) -> str:
    lines = [f"summary ({cores} cores):"]
    for over in (False, True):
        chosen = [s for s in summaries if s["oversubscribed"] == over]
        if not chosen:
            continue
        errors = [e for s in chosen for e in s["errors"]]
        memory = [e for s in chosen for e in s["memory_errors"]]
        lines.append(f"  ranks {'>' if over else '<='} cores: step-time error mean {100 * statistics.fmean(errors):.1f} %, "
                     f"max {100 * max(errors):.1f} % over {len(errors)} layouts; memory (step peak) worst "
                     f"under-prediction {100 * min(min(memory), 0):.1f} %; bytes exact: "
                     f"{all(s['bytes_exact'] for s in chosen)}; measured best in predicted top 2: "
                     f"{sum(s['top2'] for s in chosen)}/{len(chosen)}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
