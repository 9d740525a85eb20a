"""What rank 0 tells the user during training: step lines, the metrics file, peak memory."""
from __future__ import annotations

import json
import os
import resource
import sys


def peak_memory_mb() -> float:
    """This process's peak resident memory (plus the CuPy pool's peak on a GPU)."""
    host = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # KiB on Linux
    try:
        import cupy

        return host + cupy.get_default_memory_pool().total_bytes() / 2**20
    except Exception:  # noqa: BLE001 - no CuPy, no GPU
        return host


class Logger:
    """Rank 0's console and JSONL output."""

    def __init__(self, job, ctx, total_steps: int):
        self.rank0 = ctx.rank == 0
        self.total = total_steps
        self.unit = "tok" if job.model.kind == "gpt" else "img"
        self.tty = sys.stdout.isatty()
        self.path = job.train.metrics
        if self.rank0 and self.path:
            os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)

    def record(self, entry: dict) -> None:
        if self.rank0 and self.path:
            with open(self.path, "a") as f:
                f.write(json.dumps(entry) + "\n")

    def line(self, text: str) -> None:
        if self.rank0:
            print(text, flush=True)

    def step(self, entry: dict) -> None:
        """One step's record: to the metrics file and as a progress line."""
        self.record(entry)
        self.progress(entry["step"], f"step {entry['step']:>5}/{self.total}  loss {entry['loss']:.4f}  "
                                     f"lr {entry['lr']:.2e}  {entry['tokens_per_s']:,.0f} {self.unit}/s  step "
                                     f"{1e3 * entry['step_s']:.0f} ms = compute {1e3 * entry['compute_s']:.0f} + "
                                     f"comm {1e3 * entry['comm_s']:.0f} + idle {1e3 * entry['idle_s']:.0f}  "
                                     f"mem {max(entry['peak_mem_mb']):.0f} MB")

    def progress(self, step: int, text: str) -> None:
        if not self.rank0:
            return
        if self.tty:
            done = int(30 * step / self.total)
            print(f"\r[{'#' * done}{'.' * (30 - done)}] {text}", end="", flush=True)
            if step >= self.total:
                print(flush=True)
        else:
            print(text, flush=True)
