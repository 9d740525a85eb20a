"""Optimizers, learning-rate schedules, gradient clipping and mixed precision."""
from .adam import Adam, AdamW
from .amp import DynamicLossScaler, MixedPrecision, precision_dtype
from .clip import clip_grad_norm
from .optimizer import Optimizer
from .schedule import WarmupCosine
from .sgd import SGD

__all__ = ["Adam", "AdamW", "DynamicLossScaler", "MixedPrecision", "Optimizer", "SGD", "WarmupCosine",
           "clip_grad_norm", "precision_dtype"]
