"""``train.on_nonfinite``: what a run does after a step that was not finite, or a loss spike.

Every precision skips a step whose loss or gradient norm is not finite (``optim.finite``), so
the weights stay finite; the policy then decides on each rank, and the loop agrees the decision
over the world in the all-reduce it makes after every step anyway (``lifecycle.after_step``):

    stop    end the run (exit 3) naming the step and what was not finite; nothing saved after it
    skip    train on; ``train.max_skipped`` skipped steps in a row end the run as ``stop``
    rewind  reload the newest checkpoint (every committed one is finite) and skip the failed
            steps' data; ``train.max_rewinds`` rewinds, then ``stop``; ``train.spike_zscore``
            also rewinds on a loss spike

An fp16 scaler's overflow is its expected skip under every policy; the counts travel in
checkpoints. More: docs/architecture.md, "Diverging runs".
"""
from __future__ import annotations

from collections import deque

import numpy as np

from ..optim.finite import StepHealth, nonfinite_message

CONTINUE, REWIND, STOP = 0, 1, 2  # agreed as the maximum over the ranks: a stop anywhere stops everyone


class RunDiverged(Exception):
    """The run stops for a non-finite step (``train.on_nonfinite``): one line, exit 3 on every rank."""

    exit_code = 3


class NonFinitePolicy:
    """The run's counts of skipped steps and rewinds, and the decision after each step."""

    def __init__(self, train):
        self.policy, self.max_skipped, self.max_rewinds = train.on_nonfinite, train.max_skipped, train.max_rewinds
        self.spike_zscore = train.spike_zscore if train.on_nonfinite == "rewind" else None
        self.losses = deque(maxlen=train.spike_window)  # the recent dp-mean losses (with a spike trigger)
        self.in_row = 0  # steps skipped in a row
        self.skipped = 0  # steps skipped for a non-finite loss or gradient, in all
        self.rewinds = 0
        self.why = ""  # what the last decision other than CONTINUE was about (this rank's words)

    @property
    def watches_spikes(self) -> bool:
        return self.spike_zscore is not None

    def decide(self, health: StepHealth, mean_loss: float | None = None) -> int:
        """CONTINUE, REWIND or STOP after a step of ``health`` (this rank's); ``mean_loss``: the
        step's dp-mean loss, given when the spike trigger watches it."""
        if health.taken:
            self.in_row = 0
            return self._after_finite(mean_loss)
        self.in_row += 1
        self.skipped += 1
        self.why = nonfinite_message(health)
        if self.in_row > self.max_skipped:
            self.why += f"; {self.in_row} steps skipped in a row (train.max_skipped = {self.max_skipped})"
            return REWIND if self.policy == "rewind" else STOP
        if health.overflow or self.policy == "skip":
            return CONTINUE
        return REWIND if self.policy == "rewind" else STOP

    def _after_finite(self, mean_loss: float | None) -> int:
        if not self.watches_spikes or mean_loss is None:
            return CONTINUE
        window = self.losses
        if len(window) == window.maxlen:
            mean = float(np.mean(window))
            spread = float(np.std(window))
            if spread > 0 and (mean_loss - mean) / spread > self.spike_zscore:
                self.why = (f"a loss spike: {mean_loss:.4g} is {(mean_loss - mean) / spread:.1f} standard "
                            f"deviations above the mean {mean:.4g} of the last {len(window)} "
                            f"(train.spike_zscore = {self.spike_zscore:g})")
                return REWIND
        window.append(mean_loss)
        return CONTINUE

    def may_rewind(self) -> bool:
        return self.rewinds < self.max_rewinds

    def rewound(self) -> None:
        """After a rewind's load (which brought back the checkpoint's counts and spike window): count it."""
        self.rewinds += 1
        self.in_row = 0

    # ----- in checkpoints (``Run.checkpoint_extra``) ------------------------------------
    def state_dict(self) -> dict:
        return {"skipped": self.skipped, "in_row": self.in_row, "rewinds": self.rewinds,
                "losses": list(self.losses)}  # JSON: finite floats only (a non-finite loss never enters)

    def load_state_dict(self, state: dict) -> None:
        self.skipped, self.in_row = int(state["skipped"]), int(state["in_row"])
        self.rewinds = max(self.rewinds, int(state["rewinds"]))  # a rewind's load never un-counts rewinds
        self.losses.clear()
        self.losses.extend(float(v) for v in state["losses"])
