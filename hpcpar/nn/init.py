"""Layout-independent, deterministic parameter initialisation.

Every parameter is generated at its full shape, on the host, in float64, from its own stream
``numpy.random.default_rng([seed, stable_hash(name)])`` where ``name`` is its dotted name in
the model. Its values therefore depend only on (seed, name, shape, rule): not on the order in
which layers were created, not on which other parameters exist, not on the dtype or device,
and not on how the model is split. A tensor-parallel layer generates the full tensor with
``generate`` and keeps its slice; a pipeline stage keeps the parameters of its layers; both
hold exactly the numbers of the single-process model.

Layers attach a rule to each parameter they create (``param.init = normal(0.02)``);
``initialize(model, seed)`` (called by the models' constructors) fills them in.
"""
from __future__ import annotations

import math
import zlib

import numpy as np

from ..backend import to_device


def stable_hash(name: str) -> int:
    """A hash of ``name`` that is the same in every process and Python version (CRC-32)."""
    return zlib.crc32(name.encode("utf-8"))


def parameter_rng(seed: int, name: str) -> np.random.Generator:
    return np.random.default_rng([seed, stable_hash(name)])


# ----- rules: callables (rng, shape) -> float64 host array ------------------------------
def normal(std: float, mean: float = 0.0):
    def rule(rng, shape):
        return rng.normal(mean, std, size=shape)

    rule.__qualname__ = f"normal(std={std})"
    return rule


def uniform(bound: float):
    def rule(rng, shape):
        return rng.uniform(-bound, bound, size=shape)

    rule.__qualname__ = f"uniform(bound={bound})"
    return rule


def constant(value: float):
    def rule(rng, shape):
        return np.full(shape, value, dtype=np.float64)

    rule.__qualname__ = f"constant({value})"
    return rule


zeros = constant(0.0)
ones = constant(1.0)


def fan_in_uniform(fan_in: int):
    """PyTorch's default for Linear and Conv2d: U(-1/sqrt(fan_in), 1/sqrt(fan_in))."""
    return uniform(1.0 / math.sqrt(fan_in))


# ----- generation -------------------------------------------------------------------------
def generate(seed: int, name: str, shape, rule) -> np.ndarray:
    """The full float64 values of parameter ``name`` (what ``initialize`` writes, before the cast)."""
    return np.asarray(rule(parameter_rng(seed, name), tuple(shape)), dtype=np.float64)


def initialize(module, seed: int) -> None:
    """Fill every parameter of ``module`` that carries an ``init`` rule from its own stream.

    Names are relative to ``module``: call it on the root model so they are the full names.
    """
    for name, param in module.named_parameters():
        rule = getattr(param, "init", None)
        if rule is None:
            continue
        # A tensor-parallel shard draws the whole tensor and keeps its block, so every layout
        # starts from the same model.
        full_shape = param.shape if param.global_shape is None else param.global_shape
        values = generate(seed, name, full_shape, rule)
        start = (0,) * len(full_shape) if param.global_start is None else param.global_start
        values = values[tuple(slice(s, s + n) for s, n in zip(start, param.shape))]
        param.data[...] = to_device(values.astype(param.dtype), param.xp)
