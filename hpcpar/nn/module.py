"""Module: parameters and submodules registered by attribute assignment.

``self.weight = Parameter(...)`` registers a parameter and ``self.attn = Attention(...)`` a
submodule, in assignment order; ``named_parameters()`` walks them in that order with dotted
names (``blocks.0.attn.qkv.weight``). Those names are the keys of ``state_dict()``, of
checkpoints and of the per-parameter initialisation streams (``hpcpar.nn.init``).
"""
from __future__ import annotations

from typing import Iterator, NamedTuple

from ..autograd import Parameter
from ..backend import to_device
from ..state import ParameterHolder


class IncompatibleKeys(NamedTuple):
    missing: list
    unexpected: list


class Module(ParameterHolder):
    """Base class of layers and models: subclasses set attributes in ``__init__`` and define ``forward``.

    A module is checkpointable (``hpcpar.state``): its parameters are ``model/<name>``.
    """

    def __init__(self):
        object.__setattr__(self, "_parameters", {})
        object.__setattr__(self, "_modules", {})
        object.__setattr__(self, "training", True)

    def __setattr__(self, name, value):
        if "_parameters" not in self.__dict__:
            raise AttributeError(f"{type(self).__name__}.__init__ must call super().__init__() before setting {name!r}")
        self._parameters.pop(name, None)
        self._modules.pop(name, None)
        if isinstance(value, Parameter):
            self._parameters[name] = value
        elif isinstance(value, Module):
            self._modules[name] = value
        object.__setattr__(self, name, value)

    def __delattr__(self, name):
        self._parameters.pop(name, None)
        self._modules.pop(name, None)
        object.__delattr__(self, name)

    def forward(self, *args, **kwargs):  # pragma: no cover - interface
        raise NotImplementedError(f"{type(self).__name__} defines no forward()")

    def __call__(self, *args, **kwargs):
        if self._around_forward is not None:
            return self._around_forward(self.forward, *args, **kwargs)
        return self.forward(*args, **kwargs)

    # What runs a call instead of ``forward`` alone: ``around(forward, *args, **kwargs)`` (ZeRO-3's
    # gather of a unit's parameters, ``parallel.zero_params``); None: ``forward`` itself.
    _around_forward = None

    def set_around_forward(self, around) -> None:
        object.__setattr__(self, "_around_forward", around)

    def layers(self) -> list:
        """The modules a forward applies one after another (a pipeline's cut points, ZeRO-3's
        units): the module itself unless a model says otherwise (the GPT, the CNN)."""
        return [self]

    # ----- traversal ------------------------------------------------------------------
    def named_modules(self, prefix: str = "") -> Iterator[tuple[str, "Module"]]:
        """This module and every submodule once, depth first in registration order (no recursion)."""
        seen = set()
        stack = [(prefix, self)]
        while stack:
            name, module = stack.pop()
            if id(module) in seen:
                continue
            seen.add(id(module))
            yield name, module
            children = [(f"{name}.{child}" if name else child, sub) for child, sub in module._modules.items()]
            stack.extend(reversed(children))

    def named_parameters(self) -> Iterator[tuple[str, Parameter]]:
        """Every parameter once (a tied weight under its first name), in registration order."""
        seen = set()
        for module_name, module in self.named_modules():
            for name, param in module._parameters.items():
                if id(param) not in seen:
                    seen.add(id(param))
                    yield (f"{module_name}.{name}" if module_name else name), param

    def parameters(self) -> list[Parameter]:
        return [p for _, p in self.named_parameters()]

    def children(self) -> list["Module"]:
        return list(self._modules.values())

    # ----- state --------------------------------------------------------------------
    def state_dict(self) -> dict:
        """``{name: array}`` of the live parameter arrays (no copy: copy them to keep a snapshot)."""
        return {name: p.data for name, p in self.named_parameters()}

    def load_state_dict(self, state: dict, strict: bool = True) -> IncompatibleKeys:
        """Copy ``state``'s arrays into the parameters in place (to this model's device).

        Shapes and dtypes must match exactly (cast with ``to(dtype)`` first); with ``strict``
        a missing or unexpected key is an error, otherwise they are returned.
        """
        params = dict(self.named_parameters())
        missing = [k for k in params if k not in state]
        unexpected = [k for k in state if k not in params]
        if strict and (missing or unexpected):
            raise KeyError(f"load_state_dict({type(self).__name__}): missing keys {missing}, unexpected keys {unexpected}")
        for name, param in params.items():
            if name not in state:
                continue
            value = state[name]
            if tuple(value.shape) != param.shape:
                raise ValueError(f"load_state_dict: {name!r} has shape {tuple(value.shape)} in the state dict "
                                 f"but {param.shape} in the model")
            if value.dtype != param.dtype:
                raise TypeError(f"load_state_dict: {name!r} has dtype {value.dtype} in the state dict but {param.dtype} "
                                f"in the model; cast the model with .to(dtype) or the array first")
            param.data[...] = to_device(value, param.xp)
        return IncompatibleKeys(missing, unexpected)

    # ----- modes and casts ----------------------------------------------------------
    def train(self, mode: bool = True) -> "Module":
        for _, module in self.named_modules():
            object.__setattr__(module, "training", mode)
        return self

    def eval(self) -> "Module":
        return self.train(False)

    def zero_grad(self) -> None:
        for p in self.parameters():
            p.grad = None

    def to(self, dtype=None, xp=None) -> "Module":
        """Cast every parameter to ``dtype`` and/or move it to array library ``xp``, in place.

        The Parameter objects stay the same (optimizers holding them see the new arrays);
        gradients are dropped.
        """
        for p in self.parameters():
            data = p.data if xp is None else to_device(p.data, xp)
            p.data = data if dtype is None else data.astype(dtype, copy=False)
            p.grad = None
        return self

    def __repr__(self) -> str:
        lines = [f"  ({name}): " + repr(m).replace("\n", "\n  ") for name, m in self._modules.items()]
        extra = self.extra_repr()
        if not lines:
            return f"{type(self).__name__}({extra})"
        return f"{type(self).__name__}({extra}\n" + "\n".join(lines) + "\n)"

    def extra_repr(self) -> str:
        return ""


class ModuleList(Module):
    """A list of submodules registered as ``"0"``, ``"1"``, ..."""

    def __init__(self, modules=()):
        super().__init__()
        for module in modules:
            self.append(module)

    def append(self, module: Module) -> "ModuleList":
        setattr(self, str(len(self._modules)), module)
        return self

    def __getitem__(self, index):
        items = list(self._modules.values())
        return ModuleList(items[index]) if isinstance(index, slice) else items[index]

    def __len__(self) -> int:
        return len(self._modules)

    def __iter__(self):
        return iter(self._modules.values())


class Sequential(ModuleList):
    """Submodules applied one after the other."""

    def forward(self, x):
        for module in self:
            x = module(x)
        return x
