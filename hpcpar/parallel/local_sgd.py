"""Local SGD: every dp rank takes H optimizer steps on its own data, then the parameters are averaged.

    optimizer = SGD(model.named_parameters(), lr=0.1)
    local = LocalSGD(model, ctx, optimizer, local_steps=4)   # broadcasts dp rank 0's parameters
    for step in range(steps):
        model.loss(*my_batch(step)).backward()                # no DDP: gradients stay local
        local.step()                                          # optimizer step; every 4th: average over dp
    local.shutdown()                                          # average once more if steps are pending

Communication is one all-reduce (mean) of all parameters, flattened, over ``ctx.dp`` every H steps
where DDP makes one gradient all-reduce per step, so traffic falls by H. With
``average_optimizer_state=True`` the optimizer's state arrays (momentum buffers, Adam's moments)
are averaged in the same call; integer step counts are equal on every rank anyway. When H = 1
equals DDP: docs/architecture.md, "Local SGD"; mixed precision: ``LocalSGD``.
"""
from __future__ import annotations

import numpy as np

from ..autograd import Parameter
from ..backend import get_array_module
from ..optim.clip import clip_grad_norm
from ..optim.finite import FINITE, StepHealth


class LocalSGD:
    """Wraps a model and its (ordinary, local) optimizer; ``step()`` after each backward.

    Mixed precision: with ``amp`` (a ``MixedPrecision`` of the model, the optimizer built on its
    float32 masters) each local step unscales, clips and steps the masters, and an overflow skips
    this replica's step only: replicas step on their own until they average. The average is of
    the masters, copied back into the low-precision model.
    """

    def __init__(self, model, ctx, optimizer, local_steps: int = 4, average_optimizer_state: bool = False,
                 max_grad_norm: float = 0.0, broadcast_parameters: bool = True, amp=None):
        if not isinstance(local_steps, int) or local_steps < 1:
            raise ValueError(f"LocalSGD: local_steps (H) must be an integer >= 1, got {local_steps!r}")
        if ctx.pp_size > 1 or ctx.tp_size > 1:
            raise ValueError(f"LocalSGD runs data parallel only; the context has pp = {ctx.pp_size}, "
                             f"tp = {ctx.tp_size}: build it with init(pp=1, tp=1)")
        self.model = model
        self.ctx = ctx
        self.comm = ctx.dp
        self.optimizer = optimizer
        self.local_steps = local_steps
        self.average_optimizer_state = average_optimizer_state
        self.max_grad_norm = float(max_grad_norm)
        self.amp = amp
        named = amp.named_master_parameters() if amp is not None else model.named_parameters()
        self.params = [p for _, p in named if p.requires_grad]  # what steps and is averaged
        self.steps_since_average = 0
        self.averages = 0  # parameter averages done so far
        self._checked_state_layout = None
        if broadcast_parameters and self.comm.size > 1:
            flat = self._pack([p.data for p in self.params])
            self.comm.broadcast(flat, root=0)
            self._unpack(flat, [p.data for p in self.params])
            if amp is not None:
                amp.copy_to_model()

    def __call__(self, *args, **kwargs):
        return self.model(*args, **kwargs)

    def step(self, loss=None) -> StepHealth:
        """One local optimizer step (gradients cleared); every ``local_steps``-th, average over dp.

        Under ``amp`` (a ``MixedPrecision`` or ``FullPrecision``) a non-finite ``loss`` (this
        replica's, when given) or gradient skips this replica's step only; returns the step's
        health (``optim.finite``). The step still counts toward the next average.
        """
        if self.amp is not None:
            self.amp.unscale_grads()  # the masters' gradients, for clipping
        norm = None
        if self.max_grad_norm:
            norm = clip_grad_norm(self.params, self.max_grad_norm)  # this rank's own gradient: there is no other
        health = FINITE
        if self.amp is not None:
            health = self.amp.step(self.optimizer, loss=loss, norm=norm)
        else:
            self.optimizer.step()
        self.optimizer.zero_grad()
        self.steps_since_average += 1
        if self.steps_since_average >= self.local_steps:  # more only after a resume with a smaller H
            self.average()
        return health

    def average(self) -> None:
        """All-reduce mean of the parameters (and optimizer state, if asked) over ``ctx.dp``: one call."""
        arrays = [p.data for p in self.params]
        if self.average_optimizer_state:
            arrays += self._state_arrays()
        if self.comm.size > 1:
            self._mean(arrays, arrays)
            if self.amp is not None:
                self.amp.copy_to_model()
        self.steps_since_average = 0
        self.averages += 1

    def averaged(self, named) -> list:
        """``named`` (name, parameter) pairs with the parameters this averages replaced by new ones
        holding their dp mean, this replica's own left as they are: the model a checkpoint taken
        between averages saves. One all-reduce, as ``average``'s."""
        arrays = [p.data for p in self.params]
        means = [get_array_module(a).empty_like(a) for a in arrays]
        self._mean(arrays, means)
        mean_of = {id(p): mean for p, mean in zip(self.params, means)}
        return [(name, Parameter(mean_of[id(p)], name=name) if id(p) in mean_of else p) for name, p in named]

    def shutdown(self) -> None:
        """Average the steps taken since the last average, so every replica ends with the same model."""
        if self.steps_since_average:
            self.average()

    def _state_arrays(self) -> list:
        """The optimizer's state arrays in a fixed order, checked once to agree across the dp ranks."""
        arrays, layout = [], []
        for name in self.optimizer.names:
            for key, value in sorted(self.optimizer.state[name].items()):
                if np.ndim(value) > 0:
                    arrays.append(value)
                    layout.append((name, key, tuple(value.shape), str(value.dtype)))
        layout = tuple(layout)
        if layout != self._checked_state_layout and self.comm.size > 1:
            everyone = self.comm.allgather_object(layout)
            if any(other != layout for other in everyone):
                counts = [len(other) for other in everyone]
                raise RuntimeError(f"LocalSGD(average_optimizer_state=True): the dp ranks hold different optimizer "
                                   f"state (arrays per rank: {counts}); every rank must have stepped every parameter")
            self._checked_state_layout = layout
        return arrays

    def _mean(self, arrays: list, out: list) -> None:
        """The dp mean of ``arrays`` into ``out`` (the same arrays, or new ones like them): one
        all-reduce of them all, flattened."""
        flat = self._pack(arrays)  # a new array
        if self.comm.size > 1:
            self.comm.allreduce(flat, "mean", out=flat)
        self._unpack(flat, out)

    @staticmethod
    def _pack(arrays):
        xp = get_array_module(arrays[0])
        dtype = np.result_type(*[a.dtype for a in arrays])
        return xp.concatenate([a.reshape(-1).astype(dtype, copy=False) for a in arrays])

    @staticmethod
    def _unpack(flat, arrays) -> None:
        offset = 0
        for a in arrays:
            a[...] = flat[offset: offset + a.size].reshape(a.shape)
            offset += a.size
