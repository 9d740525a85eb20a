"""``hpcpar plot``: PNG figures from a training metrics file or a ``hpcpar compare`` result.

    hpcpar plot runs/demo/metrics.jsonl            # -> runs/demo/metrics.png (loss, throughput)
    hpcpar plot runs/compare-gpt-dp/compare.json   # -> compare.png (throughput, shares, memory)

matplotlib is optional (``pip install 'hpcpar[plot]'``); without it the functions say so and
return None.
"""
from __future__ import annotations

import json
import os


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("hpcpar plot: matplotlib is not installed (pip install 'hpcpar[plot]'); no figure written")
        return None
    return plt


def plot_metrics(path: str, out: str | None = None) -> str | None:
    """Loss (train and validation) and throughput against step."""
    plt = _pyplot()
    if plt is None:
        return None
    with open(path) as f:
        records = [json.loads(line) for line in f if line.strip()]
    train = [r for r in records if "loss" in r]
    val = [r for r in records if "val_loss" in r]
    if not train:
        raise ValueError(f"{path}: no training records (lines with 'loss')")
    fig, (ax_loss, ax_speed) = plt.subplots(1, 2, figsize=(11, 4))
    ax_loss.plot([r["step"] for r in train], [r["loss"] for r in train], label="train")
    if val:
        ax_loss.plot([r["step"] for r in val], [r["val_loss"] for r in val], "o-", label="validation")
    ax_loss.set(xlabel="step", ylabel="loss (nats)", title="loss")
    ax_loss.legend()
    ax_speed.plot([r["step"] for r in train], [r["tokens_per_s"] for r in train], color="tab:green")
    ax_speed.set(xlabel="step", ylabel="tokens (or images) / s", title="throughput")
    fig.tight_layout()
    out = out or os.path.splitext(path)[0] + ".png"
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def plot_compare(path: str, out: str | None = None) -> str | None:
    """Throughput per layout, with the communication and bubble shares and memory per rank."""
    plt = _pyplot()
    if plt is None:
        return None
    with open(path) as f:
        data = json.load(f)
    results = data["results"]
    names = [r["label"] for r in results]
    fig, (ax_speed, ax_share, ax_mem) = plt.subplots(1, 3, figsize=(15, 4.5))
    ax_speed.barh(names, [r["speedup"] for r in results], color="tab:blue")
    ax_speed.axvline(1.0, color="grey", linewidth=0.8)
    ax_speed.set(xlabel="speed-up over one rank", title=f"throughput ({data['world']} ranks)")
    comm = [100 * r["comm_share"] for r in results]
    bubble = [100 * r["bubble_share"] for r in results]
    ax_share.barh(names, comm, label="communication", color="tab:orange")
    ax_share.barh(names, bubble, left=comm, label="pipeline bubble", color="tab:red")
    ax_share.set(xlabel="% of step time", title="where the time goes")
    ax_share.legend()
    ax_mem.barh(names, [r["param_state_mb_per_rank"] for r in results], label="params + optimizer", color="tab:green")
    ax_mem.barh(names, [r["activation_peak_mb_per_rank"] for r in results],
                left=[r["param_state_mb_per_rank"] for r in results], label="activations (peak)", color="tab:olive")
    ax_mem.set(xlabel="MB per rank", title="memory")
    ax_mem.legend()
    for ax in (ax_share, ax_mem):
        ax.set_yticklabels([])
    fig.tight_layout()
    out = out or os.path.splitext(path)[0] + ".png"
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def main(argv: list[str]) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="hpcpar plot")
    parser.add_argument("path", help="a metrics .jsonl file or a compare.json")
    parser.add_argument("--out", default=None, help="PNG path (default: next to the input)")
    args = parser.parse_args(argv)
    if not os.path.exists(args.path):
        print(f"hpcpar plot: error: {args.path} does not exist")
        return 2
    chart = (plot_metrics if args.path.endswith(".jsonl") else plot_compare)(args.path, args.out)
    if chart:
        print(f"wrote {chart}")
    return 0
