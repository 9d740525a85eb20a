"""Tensor: an array plus the op that made it; backward is an iterative topological pass."""
from __future__ import annotations

import numpy as np

from ..backend import get_array_module
from . import deferred, precision
from .function import Function, GraphNode


class Tensor:
    """An ``xp`` array that records the ops applied to it when it requires a gradient.

    ``grad`` of a leaf accumulates over backward calls until zeroed (as in PyTorch); the
    gradients of intermediate tensors live only during ``backward``.

    A shard of a larger tensor (a tensor-parallel parameter) carries the whole tensor's
    ``global_shape`` and the index of its first element there, ``global_start``; a whole tensor
    has None for both. Initialisation, the gradient norm and checkpoints read them. An MoE
    block's experts split over an ep group (axis 0) are ``expert_parallel``: their gradients are
    averaged over the ranks that hold the same experts, not over dp (``parallel.experts``).
    """

    __array_priority__ = 100  # ndarray <op> Tensor defers to Tensor's reflected operators
    global_shape: tuple | None = None
    global_start: tuple | None = None
    expert_parallel: bool = False

    def __init__(self, data, requires_grad: bool = False, name: str | None = None):
        if isinstance(data, Tensor):
            raise TypeError("Tensor(data) expects an array, got a Tensor (use .detach())")
        xp = get_array_module(data)
        self.data = data if isinstance(data, xp.ndarray) else xp.asarray(data)
        self.grad = None
        self.requires_grad = requires_grad
        self.name = name
        self._node: GraphNode | None = None  # a non-leaf's place in the graph (Function.attach)
        self._grad_hooks: list = []

    # ----- construction -------------------------------------------------------------
    @staticmethod
    def constant(value, like: "Tensor | None" = None) -> "Tensor":
        """A non-differentiable tensor of ``like``'s dtype and array library."""
        if like is None:
            return Tensor(np.asarray(value))
        xp = like.xp
        number = isinstance(value, (bool, int, float, np.generic))
        # a number is filled in on the device (a kernel argument), not copied there
        array = xp.full((), value, dtype=np.result_type(value)) if number else xp.asarray(value)
        floating = like.dtype.kind in "fc" or precision.is_low(like.dtype)  # int tensor * 0.5 must not truncate 0.5
        if floating and (array.dtype.kind in "fc" or array.dtype.kind in "iub" and array.ndim == 0):
            # A number next to a 16-bit tensor stays float32 (the op rounds its result once, as a GPU's
            # float32 "opmath" does); arrays take the tensor's dtype.
            dtype = precision.accumulation_dtype(like.dtype) if array.ndim == 0 else like.dtype
            array = array.astype(dtype, copy=False)
        return Tensor(array)

    # ----- array facts --------------------------------------------------------------
    @property
    def xp(self):
        return get_array_module(self.data)

    @property
    def shape(self) -> tuple:
        return self.data.shape

    @property
    def dtype(self):
        return self.data.dtype

    @property
    def ndim(self) -> int:
        return self.data.ndim

    @property
    def size(self) -> int:
        return self.data.size

    @property
    def _fn(self) -> Function | None:
        """The op that made this tensor, until its backward has run."""
        return None if self._node is None else self._node._fn

    @property
    def is_leaf(self) -> bool:
        return self._fn is None

    def __len__(self) -> int:
        return len(self.data)

    def __repr__(self) -> str:
        label = f", name={self.name!r}" if self.name else ""
        return f"Tensor(shape={self.shape}, dtype={self.dtype}, requires_grad={self.requires_grad}{label})"

    def numpy(self) -> np.ndarray:
        from ..backend import to_host

        return to_host(self.data)

    def item(self) -> float:
        """The one element as a Python number: an explicit device-to-host copy on a GPU."""
        from ..backend import to_host

        return to_host(self.data.reshape(-1)[:1])[0].item() if self.data.size == 1 else self._not_scalar("item")

    def _not_scalar(self, what):
        raise ValueError(f"{what}() needs a tensor with one element, got shape {self.shape}")

    def detach(self) -> "Tensor":
        """The same array, cut from the graph."""
        return Tensor(self.data)

    def zero_grad(self) -> None:
        self.grad = None

    # ----- hooks --------------------------------------------------------------------
    def register_grad_hook(self, hook) -> None:
        """Call ``hook(tensor)`` the moment this leaf's ``grad`` is final in a backward pass.

        Data parallelism starts a bucket's all-reduce from here, while backward goes on.
        """
        if not self.is_leaf:
            raise ValueError("grad hooks are for leaf tensors (parameters and stage inputs)")
        self._grad_hooks.append(hook)

    # ----- backward -----------------------------------------------------------------
    def backward(self, grad=None) -> None:
        """Accumulate d(self)/d(leaf) into every leaf that requires a gradient.

        A non-scalar output needs an explicit upstream ``grad`` (pipeline stages pass the
        gradient received from the next stage).
        """
        grad = self._output_gradient(grad)
        if self.is_leaf:
            self._accumulate(grad)
            return
        root = self._node
        order = _topological_order(root)
        pending = _consumer_counts(order)
        grads = {id(root): grad}
        weights = deferred.active()  # zero-bubble pipelines: weight gradients left for later
        later: set[int] = set()  # leaves some op will accumulate into when the deferred work runs
        for node in reversed(order):
            fn = node._fn
            node_grad = grads.pop(id(node), None)
            deferring = weights.deferrable(fn) if weights is not None and node_grad is not None else ()
            if node_grad is None:  # no path from the output delivered a gradient here
                parent_grads = (None,) * len(fn.parents)
            else:
                if deferring:
                    fn.grad_inputs = frozenset(range(len(fn.parents))) - frozenset(deferring)
                    weights.record(fn, node_grad, deferring)
                    later.update(id(fn.parents[i]) for i in deferring)
                parent_grads = fn.backward(node_grad)
                if not isinstance(parent_grads, tuple):
                    parent_grads = (parent_grads,)
            for parent, parent_grad in zip(fn.parents, parent_grads):
                if not parent.requires_grad:
                    continue
                key = id(parent)
                if parent_grad is not None:
                    parent_grad = precision.like(parent_grad, parent.dtype)  # a float32 loss's grad -> bf16 logits
                    previous = grads.get(key)
                    grads[key] = parent_grad if previous is None else previous + parent_grad
                pending[key] -= 1
                if pending[key] == 0 and parent.is_leaf:
                    leaf_grad = grads.pop(key, None)
                    if leaf_grad is None and key in later:
                        continue  # its whole gradient comes with the deferred work
                    if leaf_grad is None:  # every consumer returned None: a zero gradient
                        leaf_grad = parent.xp.zeros_like(parent.data)
                    parent._accumulate(leaf_grad)
            # The graph is single-use: release what this op saved as soon as it is spent.
            node._fn = None

    def _output_gradient(self, grad):
        """``backward``'s ``grad`` as an array of this tensor's shape and dtype (ones for a scalar)."""
        if not self.requires_grad:
            raise RuntimeError("backward() on a tensor that does not require grad (was it made under no_grad()?)")
        if grad is None:
            if self.data.size != 1:
                raise ValueError(
                    f"backward() of a non-scalar tensor of shape {self.shape} needs an explicit grad of that shape")
            grad = self.xp.ones_like(self.data)
        elif isinstance(grad, Tensor):
            grad = grad.data
        grad = precision.like(grad, self.data.dtype)
        if tuple(grad.shape) != self.shape:
            raise ValueError(f"backward(): grad has shape {tuple(grad.shape)} but the tensor has shape {self.shape}")
        return grad

    def _accumulate(self, grad) -> None:
        if grad.dtype != self.data.dtype:
            grad = grad.astype(self.data.dtype)
        if grad.shape != self.shape:
            raise RuntimeError(f"internal: gradient of shape {grad.shape} for a tensor of shape {self.shape}")
        # The first stored gradient is copied: a backward may hand one array to several
        # leaves (add passes its gradient through), and optimizers scale grads in place.
        self.grad = grad.copy() if self.grad is None else self.grad + grad
        for hook in self._grad_hooks:
            hook(self)

    # ----- operators (the ops live in hpcpar.autograd.ops) --------------------------
    def __add__(self, other): return _ops().add(self, other)
    def __radd__(self, other): return _ops().add(other, self)
    def __sub__(self, other): return _ops().sub(self, other)
    def __rsub__(self, other): return _ops().sub(other, self)
    def __mul__(self, other): return _ops().mul(self, other)
    def __rmul__(self, other): return _ops().mul(other, self)
    def __truediv__(self, other): return _ops().div(self, other)
    def __rtruediv__(self, other): return _ops().div(other, self)
    def __neg__(self): return _ops().neg(self)
    def __pow__(self, exponent): return _ops().pow(self, exponent)
    def __matmul__(self, other): return _ops().matmul(self, other)
    def __rmatmul__(self, other): return _ops().matmul(other, self)
    def __getitem__(self, index): return _ops().getitem(self, index)

    def sum(self, axis=None, keepdims=False): return _ops().sum(self, axis, keepdims)
    def mean(self, axis=None, keepdims=False): return _ops().mean(self, axis, keepdims)
    def max(self, axis=None, keepdims=False): return _ops().max(self, axis, keepdims)
    def reshape(self, *shape): return _ops().reshape(self, shape[0] if len(shape) == 1 and isinstance(shape[0], (tuple, list)) else shape)
    def transpose(self, *axes): return _ops().transpose(self, axes[0] if len(axes) == 1 and isinstance(axes[0], (tuple, list)) else (axes or None))
    def exp(self): return _ops().exp(self)
    def log(self): return _ops().log(self)
    def sqrt(self): return _ops().sqrt(self)
    def tanh(self): return _ops().tanh(self)
    def relu(self): return _ops().relu(self)

    @property
    def T(self): return self.transpose()


class Parameter(Tensor):
    """A leaf tensor that a Module registers and an optimizer updates."""

    def __init__(self, data, name: str | None = None):
        super().__init__(data, requires_grad=True, name=name)


def _topological_order(root: GraphNode) -> list:
    """The graph nodes reachable from ``root``, each after all the ops it consumes (no recursion)."""
    order, visited = [], set()
    stack = [(root, False)]
    while stack:
        node, expanded = stack.pop()
        if node._fn is None:
            continue
        if expanded:
            order.append(node)
            continue
        if id(node) in visited:
            continue
        visited.add(id(node))
        stack.append((node, True))
        for parent in node._fn.parents:
            if parent._fn is not None and id(parent) not in visited:
                stack.append((parent, False))
    return order


def _consumer_counts(order: list) -> dict[int, int]:
    """{id(tensor): how many graph edges deliver a gradient to it} over the nodes ``order``: a
    leaf's gradient is final (and its hooks fire) when backward has counted that many down."""
    pending: dict[int, int] = {}
    for node in order:
        for parent in node._fn.parents:
            if parent.requires_grad:
                pending[id(parent)] = pending.get(id(parent), 0) + 1
    return pending


def _ops():
    from . import ops

    return ops
