"""The precisions a run computes in (``train.precision``), each decoded once into a ``Precision``.

A ``Precision`` says what the model computes in, whether the optimizer steps float32 masters
beside it (fp16, bf16) and how the loss is scaled (fp16 only: bfloat16 has float32's range);
``masters(named)`` makes the ``MasterWeights`` a strategy steps: ``MixedPrecision`` (amp.py) or
``FullPrecision``, the model's own parameters. Both implement the ``MasterWeights`` protocol, so
no update, strategy or loop branches on the precision.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np

from ..backend import check_dtype
from .amp import DynamicLossScaler, MixedPrecision
from .finite import StepHealth, check_step


def precision_dtype(name: str):
    """The compute dtype of a precision name; bf16 needs ``ml_dtypes`` on CPUs (an ImportError names it)."""
    if name == "bf16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    dtypes = {"fp32": np.float32, "fp64": np.float64, "fp16": np.float16}
    if name not in dtypes:
        raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, got {name!r}")
    return np.dtype(dtypes[name])


@dataclass(frozen=True)
class Precision:
    """How a run computes: ``name`` (fp32 | fp64 | fp16 | bf16), the bytes of an element of the
    model, the dtype of the masters the optimizer steps (None: the model's own parameters), the
    loss scaler (``"dynamic"`` or None) and the package its arrays need on CPUs."""

    name: str
    itemsize: int
    master_dtype: np.dtype | None = None
    loss_scaler: str | None = None
    package: str | None = None

    @property
    def mixed(self) -> bool:
        """Whether the optimizer steps masters of another dtype than the model's (fp16, bf16)."""
        return self.master_dtype is not None

    @property
    def compute_dtype(self) -> np.dtype:
        """The model's dtype; bf16 imports ``ml_dtypes`` (ImportError without it)."""
        return precision_dtype(self.name)

    @property
    def master_itemsize(self) -> int:
        """Bytes of an element of the weights the optimizer steps."""
        return self.master_dtype.itemsize if self.mixed else self.itemsize

    def scaler(self):
        """A fresh loss scaler (None: the loss is not scaled)."""
        return DynamicLossScaler() if self.loss_scaler == "dynamic" else None

    def masters(self, named) -> MasterWeights:
        """The weights the optimizer steps for the (name, parameter) pairs ``named``."""
        if not self.mixed:
            return FullPrecision(named)
        return MixedPrecision(named, scaler=self.scaler(), master_dtype=self.master_dtype)


PRECISIONS = {
    "fp32": Precision("fp32", 4),
    "fp16": Precision("fp16", 2, master_dtype=np.dtype(np.float32), loss_scaler="dynamic"),
    "bf16": Precision("bf16", 2, master_dtype=np.dtype(np.float32), package="ml_dtypes"),
    "fp64": Precision("fp64", 8),
}


def precision_named(name: str) -> Precision:
    """The ``Precision`` of a name (ValueError for another name)."""
    if name not in PRECISIONS:
        raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, got {name!r}")
    return PRECISIONS[name]


def check_precision(device: str, precision: Precision) -> None:
    """Raise DeviceError when ``precision``'s arrays cannot live on ``device`` (bfloat16 on a CuPy without it)."""
    if device in ("cuda", "guard"):
        check_dtype(device, precision.compute_dtype)


class MasterWeights(Protocol):
    """The weights an optimizer steps and how a step reaches them: ``MixedPrecision`` (masters in
    another dtype, the loss scaled) or ``FullPrecision``; either skips a non-finite step."""

    scaler: DynamicLossScaler | None
    scale: float  # what the loss, and so every gradient backward makes, is multiplied by

    def named_master_parameters(self) -> list: ...
    def model_parameter(self, master): ...
    def backward(self, loss) -> None: ...
    def unscale_grads(self) -> None: ...
    def step(self, optimizer, allreduce_max=None, loss=None, norm=None, grads=None, **step_options) -> StepHealth: ...
    def copy_to_model(self) -> None: ...
    def master_bytes(self) -> int: ...
    def metrics(self) -> dict: ...


class FullPrecision:
    """``MasterWeights`` when the model's parameters are the ones the optimizer steps.

    No overflow to recover from, but a diverging run: ``step`` checks the loss and the gradients
    (``optim.finite``: the clipping norm when there is one, one all-reduce of one number to agree)
    and skips a non-finite step, which the loop's ``train.on_nonfinite`` then acts on.
    """

    scaler = None
    scale = 1.0  # gradients are never scaled

    def __init__(self, named):
        self.named = list(named)

    def named_master_parameters(self) -> list:
        return list(self.named)

    def model_parameter(self, master):
        return master

    def backward(self, loss) -> None:
        loss.backward()

    def unscale_grads(self) -> None:
        pass

    def step(self, optimizer, allreduce_max=None, loss=None, norm=None, grads=None, **step_options) -> StepHealth:
        """``optimizer.step(**step_options)`` unless the loss or a gradient is not finite on a rank
        (agreed by ``allreduce_max``; ``norm``: the clipping norm; ``grads``: the (name, gradient)
        pairs to read instead of the parameters' own, as ZeRO-2's shard); the step's health."""
        grads = ((name, p.grad) for name, p in self.named) if grads is None else grads
        health = check_step(loss, grads, norm, allreduce_max)
        if health.taken:
            optimizer.step(**step_options)
        elif hasattr(optimizer, "zero_grad"):  # ZeRO-1's reduced shard, when it was reduced
            optimizer.zero_grad()
        return health

    def copy_to_model(self) -> None:
        pass

    def master_bytes(self) -> int:
        return 0  # no copy beside the model's parameters

    def metrics(self) -> dict:
        return {}  # nothing is skipped
