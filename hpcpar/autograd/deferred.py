"""Backward in two passes, for zero-bubble pipeline schedules: input gradients now, weights later.

    with deferred_weight_grads() as weights:
        out.backward(grad)      # all gradients but the deferred weights': the previous stage waits for these
    ...                         # other work, e.g. the next micro-batch's forward
    weights.compute()           # the weight gradients, accumulated into the parameters

An op defers when its class lists ``weight_inputs`` (Linear: weight and bias, the GEMM that is
half of a backward) and those inputs are leaves (parameters): in the first pass it computes its
other gradients only, and the pass keeps it together with its output gradient; ``compute`` runs
its backward again for the weight inputs alone. Ops whose backward consumes what it saved
(LayerNorm) or whose weight gradient is cheap compute everything in the first pass.

A parameter's hooks fire when ``compute`` accumulates into it (once per deferring op).
"""
from __future__ import annotations

import contextlib

_active = None  # the WeightGradients collecting during a backward pass, or None


def active():
    return _active


class WeightGradients:
    """The weight-gradient work one backward pass left for later."""

    def __init__(self):
        self._pending: list = []  # (op, its output gradient, the input indices it deferred)

    def deferrable(self, fn) -> tuple:
        """Indices of ``fn``'s inputs whose gradient waits for ``compute``."""
        return tuple(i for i in fn.weight_inputs if i < len(fn.parents)
                     and fn.parents[i].requires_grad and fn.parents[i].is_leaf)

    def record(self, fn, grad, inputs: tuple) -> None:
        self._pending.append((fn, grad, inputs))

    def __len__(self) -> int:
        return len(self._pending)

    def compute(self) -> None:
        """Run the deferred weight gradients and accumulate them into their parameters."""
        pending, self._pending = self._pending, []
        for fn, grad, inputs in pending:
            fn.grad_inputs = frozenset(inputs)
            grads = fn.backward(grad)
            for i in inputs:
                fn.parents[i]._accumulate(grads[i])


@contextlib.contextmanager
def deferred_weight_grads():
    """Backward passes inside this block leave the deferrable weight gradients to ``compute()``."""
    global _active
    previous, _active = _active, WeightGradients()
    try:
        yield _active
    finally:
        _active = previous
