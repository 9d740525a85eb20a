"""An identity op that calls back when backward reaches it.

    y = on_backward(x, hook)   # y is x; hook() runs once y's gradient is complete, before it flows on

ZeRO-3 (``parallel.zero_params``) puts one at a unit's output, to gather the unit's parameters
before its backward reads them, and one at its input, to free them once that backward is done:
every op of the unit consumes the input and feeds the output, so backward reaches the output's
hook before any of them and the input's after all of them. A tensor that needs no gradient gets
no graph, so its hook never runs.
"""
from __future__ import annotations

from .function import Function


class BackwardHook(Function):
    op = "backward_hook"

    def forward(self, x, hook):
        self.hook = hook
        return x

    def backward(self, grad):
        self.hook()
        return (grad,)


def on_backward(x, hook):
    """``x`` with ``hook()`` called when backward reaches it."""
    return BackwardHook.apply(x, hook=hook)
