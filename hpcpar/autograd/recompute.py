"""Activation recomputation (checkpointing): keep a region's inputs, not its graph; rerun it in backward.

    y = recompute(block, x, params=block.parameters(), context=replay_dropout_key())

runs ``block(x)`` without recording a graph, so none of the activations inside it stay alive;
the op it leaves in the graph keeps ``x``'s array only. Its backward puts back what the first
run's randomness depended on, runs ``block`` again on ``x`` with the graph on, and runs that
graph's backward with the gradient of ``y``: the parameters inside get the gradients they get
without recomputation (the same ops on the same values), ``x`` its gradient. This is
``torch.utils.checkpoint`` (the reentrant variant) and Megatron-LM's ``CheckpointFunction``; how
it meets tensor parallelism and zero-bubble pipelines is in docs/architecture.md (``autograd``).
"""
from __future__ import annotations

import contextlib

import numpy as np

from .function import Function, enable_grad, is_grad_enabled, no_grad


def recompute(function, *inputs, params=(), random=(), context=None):
    """``function(*inputs)`` (one Tensor out), keeping only ``inputs`` for backward.

    ``params`` matters only when no input needs a gradient: the output still does if a parameter
    inside the region does. ``random`` lists the random sources the region draws from, NumPy
    Generators or objects with ``get_state()`` and ``set_state(state)`` (NumPy's RandomState):
    the rerun starts them where the forward did and leaves them where they were. ``context`` is
    for state the region reads that is gone by backward without being random: a context manager,
    made when the forward runs, that the rerun runs inside (the GPT's is
    ``nn.dropout_keys.replay_dropout_key()``, the dropout key then in force)."""
    if not is_grad_enabled():
        return function(*inputs)
    return Recompute.run(function, inputs, params, random, context)


def _state(source):
    if isinstance(source, np.random.Generator):
        return source.bit_generator.state
    if callable(getattr(source, "get_state", None)) and callable(getattr(source, "set_state", None)):
        return source.get_state()
    raise TypeError(f"recompute: cannot save the state of the random source {source!r}: dropout inside a "
                    "recomputed region needs a NumPy Generator or an object with get_state() and set_state()")


def _restore(states) -> None:
    for source, state in states:
        if isinstance(source, np.random.Generator):
            source.bit_generator.state = state
        else:
            source.set_state(state)


class Recompute(Function):
    """The graph's op for a recomputed region: its parents are the region's inputs, ``inputs`` their arrays."""

    op = "recompute"

    @classmethod
    def run(cls, function, inputs, params, random, context=None):
        from .tensor import Tensor

        if not all(isinstance(x, Tensor) for x in inputs):
            raise TypeError("recompute: the inputs of a recomputed region must be Tensors")
        fn = cls()
        fn.function, fn.random = function, tuple(random)
        fn.context = context if context is not None else contextlib.nullcontext()
        fn.states = [(source, _state(source)) for source in fn.random]  # before the region draws
        data = fn.forward(*inputs)
        out = Tensor(data)
        if any(x.requires_grad for x in inputs) or any(p.requires_grad for p in params):
            # The rerun needs the inputs' arrays, and the graph links non-leaf inputs without them.
            fn.inputs = tuple(x.data for x in inputs)
            fn.attach(inputs, out)
        return out

    def forward(self, *inputs):
        """The region without a graph; returns the output's array."""
        with no_grad():
            out = self.function(*inputs)
        if not hasattr(out, "data") or not hasattr(out, "requires_grad"):
            raise TypeError(f"recompute: the region must return one Tensor, got {type(out).__name__}")
        return out.data

    def backward(self, grad):
        from .tensor import Tensor

        leaves = [Tensor(array, requires_grad=x.requires_grad) for array, x in zip(self.inputs, self.parents)]
        now = [(source, _state(source)) for source, _ in self.states]
        _restore(self.states)
        try:
            with self.context, enable_grad():
                out = self.function(*leaves)
        finally:
            _restore(now)  # the stream goes on from where the forward passes left it
        if out.requires_grad:
            out.backward(grad)  # parameters inside accumulate (or defer) their gradients here
        return tuple(leaf.grad if leaf.requires_grad else None for leaf in leaves)
