"""The base of every differentiable op.

An op is a small ``Function`` subclass: ``forward`` works on raw arrays and saves on
``self`` only what ``backward`` needs; ``backward`` takes the gradient of the output and
returns one gradient (or None) per tensor input. ``apply`` wires it into the graph.
"""
from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod

from ..backend import get_array_module
from . import memory, precision

_grad_enabled = True


@contextlib.contextmanager
def no_grad():
    """Inside this block ops record no graph (evaluation, optimizer updates)."""
    global _grad_enabled
    previous, _grad_enabled = _grad_enabled, False
    try:
        yield
    finally:
        _grad_enabled = previous


@contextlib.contextmanager
def enable_grad():
    """Inside this block ops record a graph again (a recomputed forward run during backward)."""
    global _grad_enabled
    previous, _grad_enabled = _grad_enabled, True
    try:
        yield
    finally:
        _grad_enabled = previous


def is_grad_enabled() -> bool:
    return _grad_enabled


def unbroadcast(grad, shape):
    """Sum ``grad`` back to ``shape``, undoing NumPy broadcasting (the one place it is undone).

    A 16-bit gradient is summed in float32 (``precision.sum``); the caller's tensor rounds it back."""
    if grad.shape == tuple(shape):
        return grad
    extra = grad.ndim - len(shape)
    if extra:
        grad = precision.sum(grad, axis=tuple(range(extra)))
    axes = tuple(i for i, n in enumerate(shape) if n == 1 and grad.shape[i] != 1)
    if axes:
        grad = precision.sum(grad, axis=axes, keepdims=True)
    return grad


class GraphNode:
    """A non-leaf tensor's place in the graph: the op that made it, and the tensor's dtype, not its array.

    Ops link to their non-leaf inputs through these (as PyTorch links ``grad_fn`` nodes), so an
    intermediate array stays alive for backward only where an op saved it on itself, not because
    the graph holds the tensor that carries it. Made once per tensor (``Function.attach``): a
    tensor several ops consume is one node, which backward's bookkeeping (by ``id``) relies on.
    """

    __slots__ = ("_fn", "dtype")
    requires_grad = True  # only tensors that require a gradient get a node
    is_leaf = False

    def __init__(self, fn: "Function", dtype):
        self._fn = fn  # set to None once the op's backward has run, releasing what it saved
        self.dtype = dtype  # of the tensor's array: backward rounds the tensor's gradient to it


class Function(ABC):
    """One op in the graph: ``parents`` are its inputs, set by ``attach``: leaf Tensors
    (parameters, stage inputs, constants: gradients accumulate and hooks fire on them) as
    themselves, non-leaf tensors as their ``GraphNode``, which keeps no array.

    ``op`` names the op in the precision policy (``precision.POLICY``), which decides the dtype of
    its output when an input is 16-bit; a Function that names none keeps the compute dtype.

    ``weight_inputs`` lists the inputs whose gradient a zero-bubble pipeline may compute later
    (``autograd.deferred``); ``grad_inputs``, set on an op by a backward split in two passes,
    narrows the gradients its ``backward`` makes to those inputs (None: all that require one).
    """

    __slots__ = ("parents", "__dict__")
    op: str | None = None
    precision_rule: str = precision.COMPUTE
    weight_inputs: tuple = ()
    grad_inputs: frozenset | None = None

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        cls.precision_rule = precision.rule(cls.op)  # an op missing from the policy fails here, at import

    @abstractmethod
    def forward(self, *arrays, **kwargs):
        """The op on raw arrays; saves on ``self`` only what ``backward`` needs."""

    @abstractmethod
    def backward(self, grad):
        """One gradient (or None) per input, from the gradient of the output."""

    @classmethod
    def apply(cls, *inputs, **kwargs):
        """Run ``forward`` on the inputs' arrays and return a Tensor that remembers this op.

        Non-Tensor inputs (Python numbers, arrays) become constants of the first tensor
        input's dtype, so float32 models stay float32 (a number next to a 16-bit tensor stays
        float32). With a 16-bit input the output gets the dtype the op's precision rule gives
        (NumPy's bfloat16 matmul, say, returns float32).
        """
        from .tensor import Tensor

        reference = next((x for x in inputs if isinstance(x, Tensor)), None)
        tensors = tuple(x if isinstance(x, Tensor) else Tensor.constant(x, like=reference) for x in inputs)
        fn = cls()
        arrays = tuple(t.data for t in tensors)
        data = fn.forward(*arrays, **kwargs)
        compute = precision.compute_dtype(arrays)
        if compute is not None:
            data = precision.enforce(cls.precision_rule, data, compute)
        out = Tensor(data)
        if _grad_enabled and any(t.requires_grad for t in tensors):
            fn.attach(tensors, out)
        return out

    def attach(self, inputs, out) -> None:
        """Record this op in the graph as the maker of ``out`` from the Tensors ``inputs``."""
        self.parents = tuple(x if x.is_leaf else x._node for x in inputs)
        out.requires_grad = True
        out._node = GraphNode(self, out.dtype)
        memory.note(self)  # activation-memory accounting, when a tally is open

    def xp(self, array):
        return get_array_module(array)
