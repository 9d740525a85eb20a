"""Optimizer base: a list of parameters, in-place updates, state as plain arrays and scalars.

Parameters are passed as ``model.named_parameters()`` (then the state dict is keyed by
parameter name, which is what sharded checkpoints and resharding need), as a plain iterable of
Parameters (keyed ``"0"``, ``"1"``, ...), or as PyTorch-style groups that set their own
``weight_decay``; ``no_decay`` patterns exempt parameters by name (``groups.py``).
"""
from __future__ import annotations

from abc import abstractmethod

import numpy as np

from ..autograd import Tensor
from ..backend import to_device
from ..state import Checkpointable, LoadPlan, Piece, Read, Saved, global_slab, weight_decay_scalars
from .groups import DecayRuns, decay_overrides, flatten_groups


def named_parameter_list(params) -> list[tuple[str, Tensor]]:
    """``[(name, param)]`` from named pairs or from bare parameters (named by position)."""
    items = list(params)
    named = [item if isinstance(item, tuple) else (str(i), item) for i, item in enumerate(items)]
    for name, param in named:
        if not isinstance(param, Tensor) or not param.requires_grad:
            raise TypeError(f"optimizer parameter {name!r} must be a Tensor that requires grad, got {param!r}")
    names = [name for name, _ in named]
    if len(set(names)) != len(names) or len({id(p) for _, p in named}) != len(named):
        raise ValueError("optimizer got the same parameter or name twice")
    return named


class Optimizer(Checkpointable):
    """Subclasses list their ``hyperparameters`` (float attributes, ``lr`` first) and define ``update``.

    A parameter's weight decay is the optimizer's ``weight_decay`` unless its group or a
    ``no_decay`` pattern sets another (``decay_overrides``); ``update`` gets the one of the
    parameter it updates.

    In a checkpoint each state array is a piece of ``optim/<param>/<key>`` at its parameter's
    place in the global tensor (a tensor-parallel shard's state is a shard too); step counts
    and each parameter's weight decay (``weight_decay/<param>``) are scalars.
    """

    hyperparameters: tuple[str, ...] = ("lr",)

    def __init__(self, params, no_decay=(), **hyperparameters):
        items, given = flatten_groups(params)
        named = named_parameter_list(items)
        self.names = [name for name, _ in named]
        self.params = [param for _, param in named]
        for key in self.hyperparameters:
            value = float(hyperparameters[key])
            if value < 0:
                raise ValueError(f"{type(self).__name__}: {key} must be >= 0, got {value}")
            setattr(self, key, value)
        if (given or no_decay) and "weight_decay" not in self.hyperparameters:
            raise ValueError(f"{type(self).__name__} has no weight decay for groups or no_decay to set")
        self.decay_overrides: dict = decay_overrides(self.names, given, no_decay)
        # Per-parameter state: arrays (in the parameter's dtype, on its device) and int counts.
        self.state: dict[str, dict] = {name: {} for name in self.names}

    @abstractmethod
    def update(self, param, grad, state: dict, weight_decay) -> None:
        """Update the array ``param`` in place from ``grad``, keeping what it needs in ``state``;
        ``weight_decay``: this parameter's (a float, or ``DecayRuns`` along a flat parameter)."""

    def step(self) -> None:
        """One update of every parameter that has a gradient (the others are left alone)."""
        for name, param in zip(self.names, self.params):
            if param.grad is not None:
                self.update(param.data, param.grad, self.state[name], self.weight_decay_of(name))

    def weight_decay_of(self, name: str):
        return self.decay_overrides.get(name, getattr(self, "weight_decay", 0.0))

    def set_weight_decay(self, name: str, value) -> None:
        """The weight decay of one parameter: a float, or ``DecayRuns`` (ZeRO-1's shard)."""
        if name not in self.state:
            raise KeyError(f"{type(self).__name__}: no parameter {name!r}")
        self.decay_overrides[name] = value if isinstance(value, DecayRuns) else float(value)

    def named_weight_decays(self) -> dict:
        """{parameter name: weight decay}, what checkpoints save (floats only)."""
        decays = {name: self.weight_decay_of(name) for name in self.names}
        return {name: value for name, value in decays.items() if not isinstance(value, DecayRuns)}

    def load_weight_decays(self, decays: dict) -> None:
        """Set the weight decay of the parameters named in ``decays`` (a checkpoint's groups)."""
        for name, value in decays.items():
            if name in self.state:
                self.set_weight_decay(name, value)

    def zero_grad(self) -> None:
        for param in self.params:
            param.grad = None

    def state_dict(self) -> dict:
        """``{"hyperparameters": {name: float}, "state": {param name: {key: array or int}}}``.

        The arrays are the live state (no copy), as in ``Module.state_dict``.
        """
        return {
            "hyperparameters": {key: getattr(self, key) for key in self.hyperparameters},
            "state": {name: dict(state) for name, state in self.state.items() if state},
            "weight_decays": self.named_weight_decays(),
        }

    def load_state_dict(self, state_dict: dict) -> None:
        unknown = [name for name in state_dict["state"] if name not in self.state]
        if unknown:
            raise KeyError(f"{type(self).__name__}.load_state_dict: state for unknown parameters {unknown}; "
                           f"this optimizer has {self.names}")
        for key in self.hyperparameters:
            setattr(self, key, float(state_dict["hyperparameters"][key]))
        self.load_weight_decays(state_dict.get("weight_decays", {}))
        for name, param in zip(self.names, self.params):
            loaded = {}
            for key, value in state_dict["state"].get(name, {}).items():
                if np.ndim(value) == 0:
                    loaded[key] = int(value)
                    continue
                if tuple(value.shape) != param.shape:
                    raise ValueError(f"{type(self).__name__}.load_state_dict: {name}/{key} has shape "
                                     f"{tuple(value.shape)} but the parameter has shape {param.shape}")
                loaded[key] = to_device(value, param.xp).astype(param.dtype, copy=True)
            self.state[name] = loaded

    # ----- the checkpoint protocol (hpcpar.state) -------------------------------------
    def checkpoint_pieces(self) -> tuple[list[Piece], dict]:
        pieces, scalars = [], {}
        for name, param in zip(self.names, self.params):
            shape, slab = global_slab(param)
            for key, value in self.state[name].items():
                if np.ndim(value) == 0:
                    scalars[f"optim/{name}/{key}"] = int(value)
                else:
                    pieces.append(Piece(f"optim/{name}/{key}", shape, slab, value))
        return pieces, scalars | weight_decay_scalars(self.named_weight_decays())

    def load_plan(self, saved: Saved) -> LoadPlan:
        """Each parameter's saved state and weight decay, replacing the current ones when the load completes."""
        staged, reads, scalars = {}, [], saved.scalars
        for name, param in zip(self.names, self.params):
            shape, slab = global_slab(param)
            state = staged[name] = {}
            now, local, dtype = self.state.get(name, {}), tuple(param.shape), param.dtype
            for key in saved.state_keys(name):
                full = f"optim/{name}/{key}"
                if full in scalars:
                    state[key] = int(scalars[full])
                    continue

                def assign(values, state=state, key=key, param=param):
                    state[key] = to_device(values, param.xp).astype(param.dtype, copy=False)  # values are its own
                # The current array, if any, may be filled in place once the load can no longer fail.
                current = now.get(key)
                if isinstance(current, np.ndarray) and current.shape == local and current.dtype == dtype:
                    state[key] = current
                else:
                    current = None
                reads.append(Read(full, shape, slab, assign, dtype, current))
        decays = saved.weight_decays()

        def finish():
            self.state.update(staged)
            self.load_weight_decays(decays)
        return LoadPlan(reads, [finish])
