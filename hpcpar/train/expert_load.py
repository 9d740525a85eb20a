"""Expert load read from the metrics file's ``moe`` entry: the progress line's summary, the warning.

The entry (``train.moe_metrics``) holds, per MoE block, the tokens each expert was routed since
the previous record. An expert's *load* is its share of its block's routed tokens against the
even share 1/experts: 1.0 is perfect balance, ``experts`` is every token on one expert.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


def loads(moe: dict) -> np.ndarray:
    """(blocks, experts): each expert's share of its block's routed tokens over the even share."""
    tokens = np.asarray(moe["tokens"], dtype=np.float64)
    return tokens * moe["experts"] / np.maximum(tokens.sum(axis=1, keepdims=True), 1)


def summary(moe: dict) -> str:
    """The progress line's words: the busiest expert's load over every block, the dropped share
    of the routed tokens (mean over blocks), and the auxiliary losses summed over blocks."""
    dropped = float(np.mean(moe["dropped"])) if moe["dropped"] else 0.0
    return (f"experts {loads(moe).max():.2f}x  drop {dropped:.1%}  "
            f"aux {moe['aux_loss']:.3g} z {moe['z_loss']:.3g}")


def scalars(moe: dict) -> dict:
    """TensorBoard's flat numbers of the entry: the busiest load and dropped share per block, the losses."""
    out = {"moe/aux_loss": moe["aux_loss"], "moe/z_loss": moe["z_loss"]}
    for block, load, dropped in zip(moe["blocks"], loads(moe).max(axis=1), moe["dropped"]):
        out[f"moe/block{block}/max_load"] = float(load)
        out[f"moe/block{block}/dropped"] = float(dropped)
    return out


@dataclass
class LoadWatch:
    """Warns when one expert's load stays above ``limit`` (``model.moe.load_warning``) in every
    logged record covering ``steps`` training steps or more: once per such stretch, naming the
    block, the expert and its share; a record below the limit ends the stretch."""

    limit: float
    steps: int = 50
    since: dict = field(default_factory=dict)  # (block, expert) -> first step of its stretch above the limit
    warned: set = field(default_factory=set)

    def update(self, step: int, moe: dict) -> list[str]:
        """The warnings that ``step``'s record (covering its last ``moe["steps"]`` steps) starts."""
        first = step - moe["steps"] + 1
        shares = loads(moe)
        lines = []
        for row, block in enumerate(moe["blocks"]):
            for expert, load in enumerate(shares[row]):
                key = (block, expert)
                if load <= self.limit:
                    self.since.pop(key, None)
                    self.warned.discard(key)
                    continue
                start = self.since.setdefault(key, first)
                if step - start + 1 >= self.steps and key not in self.warned:
                    self.warned.add(key)
                    lines.append(self.line(block, expert, load, moe["experts"], start, step))
        return lines

    def line(self, block: int, expert: int, load: float, experts: int, start: int, step: int) -> str:
        return (f"expert load: block {block}'s expert {expert} took {load / experts:.0%} of the block's routed "
                f"tokens at step {step} ({load:.2f}x the even share 1/{experts}), above model.moe.load_warning = "
                f"{self.limit:g} in every record since step {start}: with ep > 1 the others wait for its rank "
                f"(raise model.moe.aux_loss_coef; model.moe.capacity_factor caps what one expert takes)")
