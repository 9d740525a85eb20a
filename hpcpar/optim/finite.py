"""Whether a step's loss and gradients are finite: what a precision checks before it steps.

    health = check_step(loss, grads, norm=norm, agree=world_max)   # one all-reduce of one number
    if health.taken: optimizer.step()

The check reads the loss and the gradient norm: the global one when the step clipped, else
this rank's part of it (one pass over the gradients). A norm is inf or NaN when an element is,
and also when the gradients are too large to square: then Adam's second moment would hold inf
while the weights stayed finite, and no checkpoint after it could be committed. ``agree``
makes the verdict the same on every rank, so that every rank takes or skips the step alike.
What a run then does about a non-finite step is the loop's policy (``train.on_nonfinite``).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from ..backend import get_array_module, to_host
from .clip import sum_of_squares

LOSS, GRADIENTS = "loss", "gradients"
_CODES = {0.0: None, 1.0: GRADIENTS, 2.0: LOSS}  # the larger wins the agreement: a bad loss is named first


@dataclass(frozen=True)
class StepHealth:
    """A step's verdict: ``nonfinite`` names what was not finite (None: the step was taken);
    ``overflow``: a loss scaler's overflow (fp16 gradients beyond its range: the scale backs
    off, an expected skip); ``parameter``: the first parameter here with a non-finite gradient."""

    nonfinite: str | None = None
    overflow: bool = False
    parameter: str | None = None

    @property
    def taken(self) -> bool:
        return self.nonfinite is None


FINITE = StepHealth()


def check_step(loss, named_grads, norm: float | None = None, agree=None) -> StepHealth:
    """The health of a step from its ``loss`` and ``named_grads`` ((name, gradient array) pairs),
    agreed by ``agree`` (``value -> its maximum over the ranks deciding together``; None: this
    rank's own). ``norm``: the global gradient norm when the step computed one (clipping)."""
    named_grads = [(name, grad) for name, grad in named_grads if grad is not None]
    loss_ok, squares_ok = finite_flags(loss, [grad for _, grad in named_grads] if norm is None else [])
    grads_ok = math.isfinite(norm) if norm is not None else squares_ok
    local = 0.0 if loss_ok and grads_ok else 2.0 if not loss_ok else 1.0
    verdict = _CODES[float(agree(local)) if agree is not None else local]
    if verdict is None:
        return FINITE
    return StepHealth(verdict, parameter=first_nonfinite(named_grads))


def finite_flags(loss, grads) -> tuple[bool, bool]:
    """(whether ``loss`` is finite, whether the sum of the squares of ``grads`` is): one
    device-to-host transfer for both. ``loss``: a number, a 0-d array or a Tensor (or None)."""
    loss = loss.data if hasattr(loss, "backward") else loss  # a Tensor's array
    on_device = [a for a in (loss if hasattr(loss, "dtype") else None, sum_of_squares(grads)) if a is not None]
    flags = []
    if on_device:
        xp = get_array_module(*on_device)
        flags = [bool(f) for f in to_host(xp.stack([xp.isfinite(a).all() for a in on_device])).tolist()]
    loss_ok = flags.pop(0) if hasattr(loss, "dtype") else (loss is None or math.isfinite(loss))
    return loss_ok, (flags.pop(0) if flags else True)


def first_nonfinite(named_grads) -> str | None:
    """The first name whose gradient holds inf or NaN (on a failed step only: a pass per array)."""
    for name, grad in named_grads:
        if not bool(to_host(get_array_module(grad).isfinite(grad).all())):
            return name
    return None


def nonfinite_message(health: StepHealth) -> str:
    """``health`` as words: "the loss is not finite" and the like."""
    what = "the loss is" if health.nonfinite == LOSS else "the gradient norm is"
    where = f"; first non-finite gradient: {health.parameter}" if health.parameter else ""
    return f"{what} not finite (inf or NaN){where}"

