"""Learning-rate schedule: linear warm-up, then cosine decay to ``min_lr``."""
from __future__ import annotations

import math


class WarmupCosine:
    """Sets ``optimizer.lr`` for step 0 now and for the next step at each ``step()``.

    ``lr(s) = base_lr (s + 1) / warmup_steps`` for ``s < warmup_steps``, then a half cosine
    from ``base_lr`` to ``min_lr`` that reaches it at ``total_steps`` and stays there.
    ``base_lr`` is the optimizer's lr when the schedule is made.
    """

    def __init__(self, optimizer, warmup_steps: int, total_steps: int, min_lr: float = 0.0):
        if not 0 <= warmup_steps <= total_steps or total_steps < 1:
            raise ValueError(f"WarmupCosine needs 0 <= warmup_steps <= total_steps and total_steps >= 1, "
                             f"got warmup_steps={warmup_steps}, total_steps={total_steps}")
        self.optimizer = optimizer
        self.base_lr = float(optimizer.lr)
        if not 0 <= min_lr <= self.base_lr:
            raise ValueError(f"WarmupCosine: min_lr must be in [0, base_lr={self.base_lr}], got {min_lr}")
        self.warmup_steps, self.total_steps, self.min_lr = int(warmup_steps), int(total_steps), float(min_lr)
        self.step_count = 0
        optimizer.lr = self.lr_at(0)

    def lr_at(self, step: int) -> float:
        if step < self.warmup_steps:
            return self.base_lr * (step + 1) / self.warmup_steps
        if step >= self.total_steps:
            return self.min_lr
        progress = (step - self.warmup_steps) / (self.total_steps - self.warmup_steps)
        return self.min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (self.base_lr - self.min_lr)

    def step(self) -> float:
        """Advance after an optimizer step; returns the lr now set for the next one."""
        self.step_count += 1
        self.optimizer.lr = self.lr_at(self.step_count)
        return self.optimizer.lr

    def state_dict(self) -> dict:
        return {"step_count": self.step_count, "base_lr": self.base_lr, "warmup_steps": self.warmup_steps,
                "total_steps": self.total_steps, "min_lr": self.min_lr}

    def load_state_dict(self, state: dict) -> None:
        self.step_count = int(state["step_count"])
        self.warmup_steps, self.total_steps = int(state["warmup_steps"]), int(state["total_steps"])
        self.base_lr, self.min_lr = float(state["base_lr"]), float(state["min_lr"])
        self.optimizer.lr = self.lr_at(self.step_count)
