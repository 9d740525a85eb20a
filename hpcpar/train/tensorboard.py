"""TensorBoard event files of a run's metrics (``train.tensorboard = "DIR"``), through tensorboardX.

An optional extra (``pip install 'hpcpar[tensorboard]'``): rank 0 writes every metrics record
it appends to the JSONL file as scalars too, ``train/loss``, ``train/tokens_per_s``,
``train/lr``, ``val/val_loss``, ... against the step; ``tensorboard --logdir DIR`` shows them.
"""
from __future__ import annotations

import importlib.util

EXTRA = "pip install 'hpcpar[tensorboard]'"


def available() -> bool:
    return importlib.util.find_spec("tensorboardX") is not None


class TensorBoardWriter:
    """Scalars of metrics records, one event file per run in ``folder``."""

    def __init__(self, folder: str):
        from tensorboardX import SummaryWriter

        self.writer = SummaryWriter(logdir=folder)

    def record(self, entry: dict) -> None:
        if "step" not in entry or "event" in entry:
            return
        group = "val" if any(key.startswith("val_") for key in entry) else "train"
        for key, value in entry.items():
            if key not in ("step", "time") and isinstance(value, (int, float)) and not isinstance(value, bool):
                self.writer.add_scalar(f"{group}/{key}", value, entry["step"])

    def close(self) -> None:
        self.writer.close()
