"""Mixed precision: float16/bfloat16 compute, float32 master weights, dynamic loss scaling.

    model = GPT(config, dtype=np.float16)
    amp = MixedPrecision(model)                            # float32 master copy + DynamicLossScaler
    optimizer = AdamW(amp.named_master_parameters(), lr=3e-4)
    for ids, targets in batches:
        loss = model.loss(ids, targets)                    # float32, whatever the compute dtype
        amp.backward(loss)                                 # backward seeded with the loss scale
        amp.unscale_grads()                                # only needed before clipping:
        clip_grad_norm(amp.master_parameters(), 1.0)
        amp.step(optimizer, loss=loss)                     # skips on an inf/NaN loss or gradient

What each op computes in is ``hpcpar.autograd.precision``'s policy; why a step is skipped, how
the scale works and how DDP, pipelines and ZeRO-1 combine with it: docs/architecture.md (optim).
"""
from __future__ import annotations

import numpy as np

from ..autograd import Parameter
from ..backend import to_device
from .finite import GRADIENTS, StepHealth, check_step
from .optimizer import named_parameter_list


class DynamicLossScaler:
    """Backs the scale off after an overflow; grows it after ``growth_interval`` clean steps in a row."""

    def __init__(self, init_scale: float = 2.0 ** 16, growth_factor: float = 2.0, backoff_factor: float = 0.5,
                 growth_interval: int = 2000):
        if init_scale <= 0 or growth_factor <= 1 or not 0 < backoff_factor < 1 or growth_interval < 1:
            raise ValueError(f"DynamicLossScaler needs init_scale > 0, growth_factor > 1, 0 < backoff_factor < 1, "
                             f"growth_interval >= 1; got {init_scale}, {growth_factor}, {backoff_factor}, "
                             f"{growth_interval}")
        self.scale = float(init_scale)
        self.growth_factor, self.backoff_factor = float(growth_factor), float(backoff_factor)
        self.growth_interval = int(growth_interval)
        self.clean_steps = 0  # steps without overflow since the scale last changed

    def update(self, found_inf: bool) -> None:
        if found_inf:
            self.scale *= self.backoff_factor
            self.clean_steps = 0
            return
        self.clean_steps += 1
        if self.clean_steps == self.growth_interval:
            self.scale *= self.growth_factor
            self.clean_steps = 0

    def state_dict(self) -> dict:
        return {"scale": self.scale, "growth_factor": self.growth_factor, "backoff_factor": self.backoff_factor,
                "growth_interval": self.growth_interval, "clean_steps": self.clean_steps}

    def load_state_dict(self, state: dict) -> None:
        self.scale, self.clean_steps = float(state["scale"]), int(state["clean_steps"])
        self.growth_factor, self.backoff_factor = float(state["growth_factor"]), float(state["backoff_factor"])
        self.growth_interval = int(state["growth_interval"])


def scaled_backward(loss, scale: float) -> None:
    """``loss.backward()`` with every gradient multiplied by ``scale`` (the seed of backward)."""
    xp = loss.xp
    # Overflow is the expected signal of a too large scale, detected before the step; not a warning.
    with np.errstate(over="ignore", invalid="ignore"):
        loss.backward(xp.full(loss.shape, scale, dtype=np.float64).astype(loss.dtype))


_DEFAULT_SCALER = object()


class MixedPrecision:
    """Master weights in ``master_dtype`` for a model (or named parameters) computing in low precision.

    ``scaler`` defaults to a fresh ``DynamicLossScaler()``; ``None`` disables scaling (bfloat16 has
    float32's range and needs none; a non-finite step is still skipped and counted). The scale
    enters as the seed gradient of backward: gradients that overflow the compute dtype (float16:
    65504) become inf, the step is skipped and the scale backs off.
    """

    def __init__(self, model_or_params, scaler=_DEFAULT_SCALER, master_dtype=np.float32):
        params = model_or_params.named_parameters() if hasattr(model_or_params, "named_parameters") else model_or_params
        named = named_parameter_list(params)
        self.scaler = DynamicLossScaler() if scaler is _DEFAULT_SCALER else scaler
        self.master_dtype = np.dtype(master_dtype)
        self.model_params = [param for _, param in named]
        self.master = [(name, Parameter(param.data.astype(self.master_dtype), name=name)) for name, param in named]
        for param, (_, master) in zip(self.model_params, self.master):  # a shard's master is the same shard
            master.global_shape, master.global_start = param.global_shape, param.global_start
            master.expert_parallel = param.expert_parallel
        self._model_of = {id(master): param for (_, master), param in zip(self.master, self.model_params)}
        self._unscaled = False
        self.skipped_steps = 0  # steps skipped for a non-finite loss or gradient

    @property
    def scale(self) -> float:
        return self.scaler.scale if self.scaler is not None else 1.0

    def named_master_parameters(self) -> list:
        """What the optimizer is built on: ``[(name, float32 Parameter)]``."""
        return list(self.master)

    def master_parameters(self) -> list:
        return [param for _, param in self.master]

    def model_parameter(self, master):
        """The model's low-precision parameter that ``master`` is the master copy of (a parameter
        with no master here is its own: ZeRO-3's, whose masters are its shard)."""
        return self._model_of.get(id(master), master)

    def backward(self, loss) -> None:
        """``loss.backward()`` with every gradient multiplied by the current scale."""
        scaled_backward(loss, self.scale)

    def unscale_grads(self) -> None:
        """Master grads = model grads / scale, in ``master_dtype`` (once per step)."""
        if self._unscaled:
            return
        inverse = 1.0 / self.scale
        for param, (_, master) in zip(self.model_params, self.master):
            if param.grad is None:
                master.grad = None
                continue
            master.grad = param.grad.astype(self.master_dtype)
            master.grad *= inverse
        self._unscaled = True

    def check(self, loss=None, norm=None, allreduce_max=None, grads=None) -> StepHealth:
        """The step's health (``optim.finite.check_step``) from the master gradients, unscaled here
        (``grads``: other (name, gradient) pairs to read, as ZeRO-2's shard); a non-finite gradient
        with a finite loss under a loss scaler is its overflow."""
        self.unscale_grads()
        grads = ((name, m.grad) for name, m in self.master) if grads is None else grads
        health = check_step(loss, grads, norm, allreduce_max)
        if self.scaler is not None and health.nonfinite == GRADIENTS:
            return StepHealth(GRADIENTS, overflow=True, parameter=health.parameter)
        return health

    def step(self, optimizer, allreduce_max=None, loss=None, norm=None, grads=None, **step_options) -> StepHealth:
        """Step ``optimizer`` on the master weights and copy them into the model, or skip the step.

        Skipped when ``check(loss, norm, allreduce_max)`` finds a non-finite loss or gradient on
        any rank. Updates the scaler (a skip backs it off), counts skips in ``skipped_steps`` (with or without
        a scaler), and clears the model's and master's gradients either way; returns the step's
        health. ``norm``: the global gradient norm when the step clipped (no second pass over
        the gradients). ``grads``: what ``check`` reads instead of the masters' gradients.
        ``step_options`` go to ``optimizer.step`` (ZeRO's ``reduce=False`` once its shard
        gradient is in place).
        """
        health = self.check(loss, norm, allreduce_max, grads)
        if not health.taken:
            self.skipped_steps += 1
        else:
            optimizer.step(**step_options)
            self.copy_to_model()
        if self.scaler is not None:
            self.scaler.update(not health.taken)
        for param, (_, master) in zip(self.model_params, self.master):
            param.grad = master.grad = None
        if not health.taken and hasattr(optimizer, "zero_grad"):  # ZeRO-1's reduced shard, when it was reduced
            optimizer.zero_grad()
        self._unscaled = False
        return health

    def copy_to_model(self) -> None:
        """The master weights, cast to the compute dtype, into the model (after a step or a load)."""
        for param, (_, master) in zip(self.model_params, self.master):
            param.data[...] = master.data.astype(param.dtype)

    def master_bytes(self) -> int:
        """Bytes of the master weights, held beside the model's 16-bit parameters."""
        return sum(master.data.nbytes for _, master in self.master)

    def metrics(self) -> dict:
        """What a training log reports: the steps skipped so far (for a non-finite loss or gradient)."""
        return {"skipped_steps": self.skipped_steps}

    def state_dict(self) -> dict:
        """The master weights (the true weights of a mixed-precision run) and the scaler."""
        return {"master": {name: master.data for name, master in self.master},
                "scaler": self.scaler.state_dict() if self.scaler is not None else {},
                "skipped_steps": self.skipped_steps}

    def load_state_dict(self, state: dict) -> None:
        for param, (name, master) in zip(self.model_params, self.master):
            value = state["master"][name]
            if tuple(value.shape) != master.shape:
                raise ValueError(f"MixedPrecision.load_state_dict: {name!r} has shape {tuple(value.shape)} "
                                 f"but the model has {master.shape}")
            master.data[...] = to_device(value, master.xp)
        self.copy_to_model()
        if self.scaler is not None:
            self.scaler.load_state_dict(state["scaler"])
        self.skipped_steps = int(state.get("skipped_steps", 0))
