"""SGD with momentum, Nesterov momentum and L2 weight decay (PyTorch's formulation)."""
from __future__ import annotations

from .groups import with_l2
from .optimizer import Optimizer


class SGD(Optimizer):
    """``d = g + wd p``; with momentum ``b = mu b + d`` (``b = d`` on the first step) and
    ``d = b`` (or ``d + mu b`` for Nesterov); then ``p -= lr d``."""

    hyperparameters = ("lr", "momentum", "weight_decay")

    def __init__(self, params, lr: float, momentum: float = 0.0, nesterov: bool = False, weight_decay: float = 0.0,
                 no_decay=()):
        super().__init__(params, no_decay=no_decay, lr=lr, momentum=momentum, weight_decay=weight_decay)
        if nesterov and momentum == 0:
            raise ValueError("SGD: nesterov=True needs momentum > 0")
        self.nesterov = nesterov

    def update(self, param, grad, state, weight_decay):
        direction = with_l2(grad, param, weight_decay)
        if self.momentum:
            buffer = state.get("momentum_buffer")
            if buffer is None:
                buffer = state["momentum_buffer"] = direction.copy()
            else:
                buffer *= self.momentum
                buffer += direction
            direction = direction + self.momentum * buffer if self.nesterov else buffer
        param -= self.lr * direction
