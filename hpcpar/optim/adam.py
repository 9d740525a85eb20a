"""Adam (L2 weight decay) and AdamW (decoupled weight decay), with bias correction."""
from __future__ import annotations

import math

from ..autograd import fused
from ..backend import get_array_module
from .groups import DecayRuns, decay_decoupled, with_l2
from .optimizer import Optimizer


class Adam(Optimizer):
    """Adam as in PyTorch; ``decoupled=True`` is AdamW.

    Per step t (counted per parameter, kept in the state dict)::

        g = grad + wd p              (Adam)      p *= 1 - lr wd    (AdamW)
        m = b1 m + (1 - b1) g        v = b2 v + (1 - b2) g^2
        p -= lr / (1 - b1^t) * m / (sqrt(v / (1 - b2^t)) + eps)

    The update runs in place in the parameter's dtype: one native pass per parameter where
    ``autograd.fused`` is built (NumPy's results bit for bit), else NumPy through one scratch
    array per parameter shape, so a step allocates nothing after the first.
    """

    hyperparameters = ("lr", "beta1", "beta2", "eps", "weight_decay")

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, decoupled: bool = False, no_decay=()):
        super().__init__(params, no_decay=no_decay, lr=lr, beta1=betas[0], beta2=betas[1], eps=eps,
                         weight_decay=weight_decay)
        if not (self.beta1 < 1 and self.beta2 < 1):
            raise ValueError(f"{type(self).__name__}: betas must be in [0, 1), got {betas}")
        self.decoupled = decoupled
        self._scratch: dict = {}

    def update(self, param, grad, state, weight_decay):
        xp = get_array_module(param)
        if not state:
            state["step"] = 0
            state["exp_avg"] = xp.zeros_like(param)
            state["exp_avg_sq"] = xp.zeros_like(param)
        state["step"] += 1
        m, v = state["exp_avg"], state["exp_avg_sq"]
        tmp = self._scratch.get((param.shape, param.dtype))
        if tmp is None or get_array_module(tmp) is not xp:
            tmp = self._scratch[(param.shape, param.dtype)] = xp.empty_like(param)

        decay = None
        if self.decoupled and weight_decay and not isinstance(weight_decay, DecayRuns):
            decay = 1.0 - self.lr * weight_decay  # fused into the step below
        elif self.decoupled:
            decay_decoupled(param, weight_decay, self.lr)  # per-run rates of a flat buffer, or none
        else:
            grad = with_l2(grad, param, weight_decay)
        # lr / bc1 * m / (sqrt(v) / sqrt(bc2) + eps)  ==  lr sqrt(bc2) / bc1 * m / (sqrt(v) + eps sqrt(bc2))
        bias_correction1 = 1.0 - self.beta1 ** state["step"]
        bias_correction2_sqrt = math.sqrt(1.0 - self.beta2 ** state["step"])
        fused.adam_step(param, grad, m, v, tmp, decay, self.beta1, self.beta2, self.eps * bias_correction2_sqrt,
                        self.lr * bias_correction2_sqrt / bias_correction1)


class AdamW(Adam):
    """Adam with decoupled weight decay (Loshchilov & Hutter): ``p *= 1 - lr wd`` each step."""

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.01, no_decay=()):
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, decoupled=True,
                         no_decay=no_decay)
