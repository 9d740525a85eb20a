"""Optimizers, learning-rate schedules, gradient clipping and the precisions a run computes in."""
from .adam import Adam, AdamW
from .amp import DynamicLossScaler, MixedPrecision
from .clip import clip_grad_norm
from .optimizer import Optimizer
from .precisions import (PRECISIONS, FullPrecision, MasterWeights, Precision, check_precision, precision_dtype,
                         precision_named)
from .schedule import WarmupCosine
from .sgd import SGD

__all__ = ["Adam", "AdamW", "DynamicLossScaler", "FullPrecision", "MasterWeights", "MixedPrecision", "Optimizer",
           "PRECISIONS", "Precision", "SGD", "WarmupCosine", "check_precision", "clip_grad_norm", "precision_dtype",
           "precision_named"]
