"""``hpcpar plot``: PNG figures from a training metrics file or a ``hpcpar compare`` result.

    hpcpar plot runs/demo/metrics.jsonl            # -> runs/demo/metrics.png (loss, throughput, learning rate;
                                                   #    an MoE model's load per expert and block)
    hpcpar plot runs/compare-gpt-dp/compare.json   # -> compare.png (throughput, where the time goes, memory)

A metrics file may hold several runs (a job run twice into one file) and the segments of one
run (resumed from a checkpoint): each is drawn as its own line. A segment starts at a
``{"event": "start"}`` record, which ``hpcpar train`` writes with the job's name, layout and
throughput unit, or, in files without such records, wherever the step number goes back.

matplotlib is optional (``pip install 'hpcpar[plot]'``); without it the functions say so and
return None.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

from . import log
from .checkpoint.manifest import layout_words
from .runtime.failfast import UsageError
from .paths import input_problem, output_problem

logger = log.get_logger(__name__)


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        logger.warning("hpcpar plot: matplotlib is not installed (pip install 'hpcpar[plot]'); no figure written")
        return None
    return plt


# ----------------------------------------------------------------------------------------
# Reading metrics
# ----------------------------------------------------------------------------------------
@dataclass
class Segment:
    """One stretch of training without a restart: its start record (if any) and its records."""

    start: dict | None = None
    train: list = field(default_factory=list)  # records with "loss"
    val: list = field(default_factory=list)  # records with "val_loss"

    @property
    def first_step(self) -> int:
        return self.train[0]["step"] if self.train else (self.start or {}).get("step", 0)


def read_metrics(path: str) -> list[dict]:
    """The records of a JSONL metrics file; a line that is not a JSON object raises ValueError naming it."""
    records = []
    with open(path) as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                raise ValueError(f"{path}, line {number}: not JSON ({error.msg} at column {error.colno}): "
                                 f"{line.strip()[:60]!r}") from None
            if not isinstance(record, dict) or ("step" not in record and record.get("event") != "start"):
                raise ValueError(f"{path}, line {number}: not a metrics record (a JSON object with a step)")
            records.append(record)
    return records


def split_segments(records: list[dict]) -> list[Segment]:
    """Runs and resumed segments: a new one at each start record or where the step goes back."""
    segments: list[Segment] = []
    for record in records:
        current = segments[-1] if segments else None
        restarted = (current is not None and "loss" in record and current.train
                     and record["step"] <= current.train[-1]["step"])
        if record.get("event") == "start" or current is None or restarted:
            current = Segment(start=record if record.get("event") == "start" else None)
            segments.append(current)
        if "loss" in record:
            current.train.append(record)
        if "val_loss" in record:
            current.val.append(record)
    return [s for s in segments if s.train or s.val]


def throughput_unit(segments: list[Segment]) -> str:
    """"tokens" or "images": from a start record, else from the records (only image jobs report accuracy)."""
    for segment in reversed(segments):
        if segment.start and segment.start.get("unit"):
            return segment.start["unit"]
    return "images" if any("val_accuracy" in r for s in segments for r in s.val) else "tokens"


def title_of(path: str, segments: list[Segment]) -> str:
    """The job's name and layout, from the latest start record (the file's name without one)."""
    start = next((s.start for s in reversed(segments) if s.start), None)
    if start is None:
        return os.path.basename(path)
    layout = start.get("layout", {})
    text = start.get("job", os.path.basename(path))
    if layout:
        text += f": {layout_words(layout)} on {layout.get('world', '?')} ranks"
    return text


def _label(number: int, segment: Segment, count: int) -> str:
    if count == 1:
        return "train"
    resumed = segment.start.get("resumed_from") if segment.start else segment.first_step > 1
    return f"segment {number}" + (f" (resumed at step {segment.first_step})" if resumed else "")


# ----------------------------------------------------------------------------------------
# Figures
# ----------------------------------------------------------------------------------------
def plot_metrics(path: str, out: str | None = None) -> str | None:
    """Loss (train and validation), throughput and learning rate against step, one line per segment;
    for an MoE model, below them, each MoE block's load per expert over the steps."""
    segments = split_segments(read_metrics(path))
    if not any(s.train for s in segments):
        raise ValueError(f"{path}: no training records (lines with 'loss')")
    plt = _pyplot()
    if plt is None:
        return None
    unit = throughput_unit(segments)
    moe = [r for s in segments for r in s.train if "moe" in r]
    blocks = moe[-1]["moe"]["blocks"] if moe else []
    rows = 1 + -(-len(blocks) // 3)  # the expert-load panels below, three to a row
    fig = plt.figure(figsize=(15, 4 * rows))
    ax_loss, ax_speed, ax_lr = (fig.add_subplot(rows, 3, i) for i in (1, 2, 3))
    for number, segment in enumerate(segments, 1):
        label = _label(number, segment, len(segments))
        steps = [r["step"] for r in segment.train]
        line, = ax_loss.plot(steps, [r["loss"] for r in segment.train], label=label)
        if segment.val:
            ax_loss.plot([r["step"] for r in segment.val], [r["val_loss"] for r in segment.val], "o--",
                         color=line.get_color(), label=f"{label}: validation" if len(segments) > 1 else "validation")
        ax_speed.plot(steps, [r["tokens_per_s"] for r in segment.train], color=line.get_color(), label=label)
        if all("lr" in r for r in segment.train):
            ax_lr.plot(steps, [r["lr"] for r in segment.train], color=line.get_color(), label=label)
    ax_loss.set(xlabel="step", ylabel="loss (nats)", title="loss")
    ax_loss.legend()
    ax_speed.set(xlabel="step", ylabel=f"{unit} / s", title="throughput")
    ax_lr.set(xlabel="step", ylabel="learning rate", title="learning rate")
    ax_lr.ticklabel_format(axis="y", style="sci", scilimits=(-3, 3))
    for number, block in enumerate(blocks):
        draw_expert_load(fig.add_subplot(rows, 3, 4 + number), moe, number, block)
    fig.suptitle(title_of(path, segments))
    fig.tight_layout()
    return _save(plt, fig, out or default_out(path))


def draw_expert_load(ax, records: list[dict], row: int, block: int) -> None:
    """An MoE block's expert load: each expert's share of its routed tokens in each record (stacked to
    100 %), the even share dashed; records from the metrics file's ``moe`` entries."""
    experts = records[-1]["moe"]["experts"]
    steps = [r["step"] for r in records]
    shares = []
    for expert in range(experts):
        shares.append([100 * r["moe"]["tokens"][row][expert] / max(sum(r["moe"]["tokens"][row]), 1) for r in records])
    ax.stackplot(steps, shares, labels=[f"expert {e}" for e in range(experts)], step="pre")  # a record covers the steps before it
    for level in range(1, experts):
        ax.axhline(100 * level / experts, color="white", linewidth=0.6, linestyle="--")
    ax.set(xlabel="step", ylabel="% of routed tokens", ylim=(0, 100), title=f"block {block}: load per expert")
    if row == 0:
        ax.legend(fontsize="x-small", ncol=2, loc="upper right")


def default_out(path: str) -> str:
    return os.path.splitext(path)[0] + ".png"


def _save(plt, fig, out: str) -> str:
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def read_compare(path: str) -> dict:
    """The result of ``hpcpar compare``; ValueError naming the file when it is not one."""
    with open(path) as f:
        try:
            data = json.load(f)
        except json.JSONDecodeError as error:
            raise ValueError(f"{path}: not JSON ({error})") from None
    if not isinstance(data, dict) or not isinstance(data.get("results"), list):
        raise ValueError(f"{path}: not the compare.json of `hpcpar compare` (no list of results)")
    return data


def plot_compare(path: str, out: str | None = None) -> str | None:
    """Throughput per layout, where each layout's step goes (compute + communication + idle = 100 %), memory."""
    data = read_compare(path)
    plt = _pyplot()
    if plt is None:
        return None
    results = data["results"]
    names = [r["label"] for r in results]
    fig, (ax_speed, ax_share, ax_mem) = plt.subplots(1, 3, figsize=(15, 4.5))
    ax_speed.barh(names, [r["speedup"] for r in results], color="tab:blue")
    ax_speed.axvline(1.0, color="grey", linewidth=0.8)
    ax_speed.set(xlabel="speed-up over one rank", title=f"throughput ({data['world']} ranks)")
    left = [0.0] * len(results)
    for key, text, color in (("compute_share", "compute", "tab:green"), ("comm_share", "communication", "tab:orange"),
                             ("bubble_share", "idle (pipeline bubble)", "tab:red")):
        shares = [100 * r.get(key, 1.0 - r["comm_share"] - r["bubble_share"]) for r in results]
        ax_share.barh(names, shares, left=left, label=text, color=color)
        left = [a + b for a, b in zip(left, shares)]
    ax_share.set(xlabel="% of step time (mean over ranks)", title="where the time goes", xlim=(0, 100))
    ax_share.legend(loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=3, fontsize="small", frameon=False)
    ax_mem.barh(names, [r["param_state_mb_per_rank"] for r in results], label="params + optimizer", color="tab:green")
    ax_mem.barh(names, [r["activation_peak_mb_per_rank"] for r in results],
                left=[r["param_state_mb_per_rank"] for r in results], label="activations (peak)", color="tab:olive")
    ax_mem.set(xlabel="MB per rank", title="memory")
    ax_mem.legend()
    for ax in (ax_share, ax_mem):
        ax.set_yticklabels([])
    fig.suptitle(f"hpcpar compare: {data.get('job', os.path.basename(path))}")
    fig.tight_layout()
    return _save(plt, fig, out or default_out(path))


def add_arguments(parser) -> None:
    parser.add_argument("path", help="a metrics .jsonl file (train.metrics of a job) or a compare.json")
    parser.add_argument("--out", default=None, help="PNG path, made with its folders (default: the input's path with .png)")
    parser.set_defaults(func=run)


def path_problem(path: str, out: str) -> str | None:
    """What is wrong with the input or the PNG, before anything is read or drawn (unchecked, a folder as the
    input raises a traceback, a named pipe blocks the read, a missing folder of --out fails after drawing)."""
    if problem := input_problem(path):
        return f"{path} {problem}; give a metrics .jsonl or a compare.json"
    if not out.lower().endswith(".png"):  # matplotlib would write OUT.png and the line would name OUT
        return f"--out {out}: not a .png file name; give one such as {os.path.splitext(out)[0]}.png"
    if problem := output_problem(out):
        return f"--out {out} {problem}"
    return None


def run(args) -> int:
    if log.world_rank() != 0:  # serial: started by mpiexec, rank 0 alone draws
        return 0
    problem = path_problem(args.path, args.out or default_out(args.path))
    if problem:
        raise UsageError(f"hpcpar plot: error: {problem}")
    try:
        chart = (plot_metrics if args.path.endswith(".jsonl") else plot_compare)(args.path, args.out)
    except (ValueError, KeyError) as error:
        text = f"{args.path}: no {error} in the results (is it a compare.json?)" if isinstance(error, KeyError) else error
        raise UsageError(f"hpcpar plot: error: {text}") from None
    if chart:
        print(f"wrote {chart}")
    return 0
