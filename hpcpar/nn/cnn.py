"""A small CNN for the 8x8 digits of scikit-learn's ``load_digits``."""
from __future__ import annotations

import numpy as np

from ..autograd import Tensor, ops
from ..backend import array_module, resolve_device
from . import init
from .layers import Conv2d, Flatten, Linear, MaxPool2d, ReLU
from .module import Module, ModuleList


class DigitsCNN(Module):
    """(N, 1, 8, 8) -> conv3x3 -> relu -> maxpool2 -> conv3x3 -> relu -> maxpool2 -> linear -> (N, classes).

    ``layers()`` is the flat list a pipeline can cut; applied in turn they are ``forward``.
    """

    def __init__(self, channels: tuple[int, int] = (16, 32), num_classes: int = 10, seed: int = 0,
                 dtype=np.float32, device: str = "cpu"):
        super().__init__()
        xp = array_module(resolve_device(device))
        c1, c2 = channels
        self.net = ModuleList([
            Conv2d(1, c1, 3, padding=1, dtype=dtype, xp=xp), ReLU(), MaxPool2d(2),  # -> (N, c1, 4, 4)
            Conv2d(c1, c2, 3, padding=1, dtype=dtype, xp=xp), ReLU(), MaxPool2d(2),  # -> (N, c2, 2, 2)
            Flatten(),  # -> (N, 4 c2)
            Linear(4 * c2, num_classes, dtype=dtype, xp=xp),
        ])
        init.initialize(self, seed)

    def layers(self) -> list:
        return list(self.net)

    def forward(self, images):
        x = images
        for layer in self.layers():
            x = layer(x)
        return x

    def loss_from_logits(self, logits, labels):
        """Mean cross entropy of (N, classes) logits against integer labels (N,)."""
        return ops.cross_entropy(logits, labels.data if isinstance(labels, Tensor) else labels)

    def loss(self, images, labels):
        return self.loss_from_logits(self.forward(images), labels)
