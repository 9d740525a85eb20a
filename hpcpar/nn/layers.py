"""Layers: thin Modules over the ops of ``hpcpar.autograd.ops``.

A layer creates its parameters NaN-filled with an initialisation rule attached; the values
come from ``init.initialize(model, seed)``, which names each stream by the parameter's full
dotted name (see ``hpcpar.nn.init``). The models call it; a model assembled by hand must call
it too (a forgotten call shows up as NaN at once, not as silently symmetric weights).
"""
from __future__ import annotations

import numpy as np

from ..autograd import Parameter, Tensor
from ..autograd import ops
from ..autograd.ops.nn_functional import scale_from_uniform
from ..autograd.ops.sequence_chunks import ChunkLayout, SequencePlace
from . import init
from .dropout_keys import DropoutKey, active_dropout_key, draw_dtype, keyed_uniform
from .module import Module


def new_parameter(shape, rule, dtype=np.float32, xp=np) -> Parameter:
    """A NaN-filled parameter that ``init.initialize`` will fill by ``rule``."""
    param = Parameter(xp.full(shape, np.nan, dtype=dtype))
    param.init = rule
    return param


class Linear(Module):
    """``y = x @ weight + bias`` with weight of shape (in_features, out_features)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, dtype=np.float32, xp=np):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = new_parameter((in_features, out_features), init.fan_in_uniform(in_features), dtype, xp)
        self.bias = new_parameter((out_features,), init.fan_in_uniform(in_features), dtype, xp) if bias else None

    def forward(self, x):
        return ops.linear(x, self.weight, self.bias)

    def extra_repr(self):
        return f"{self.in_features}, {self.out_features}, bias={self.bias is not None}"


class Embedding(Module):
    """Rows of ``weight`` (num_embeddings, embedding_dim) picked by integer ids."""

    def __init__(self, num_embeddings: int, embedding_dim: int, dtype=np.float32, xp=np):
        super().__init__()
        self.weight = new_parameter((num_embeddings, embedding_dim), init.normal(1.0), dtype, xp)

    def forward(self, ids):
        return ops.embedding(self.weight, ids)

    def extra_repr(self):
        return f"{self.weight.shape[0]}, {self.weight.shape[1]}"


class LayerNorm(Module):
    def __init__(self, dim: int, eps: float = 1e-5, bias: bool = True, dtype=np.float32, xp=np):
        super().__init__()
        self.eps = eps
        self.weight = new_parameter((dim,), init.ones, dtype, xp)
        self.bias = new_parameter((dim,), init.zeros, dtype, xp) if bias else None

    def forward(self, x):
        return ops.layer_norm(x, self.weight, self.bias, self.eps)

    def extra_repr(self):
        return f"{self.weight.shape[0]}, eps={self.eps}"


def _key_for(layer) -> DropoutKey:
    key = active_dropout_key()
    if key is None:
        raise RuntimeError(f"{type(layer).__name__} in training mode draws the masks of a dropout key: run the forward "
                           "inside `with hpcpar.nn.dropout_key(DropoutKey(step, first_sample))` (the training loop "
                           "does; a GPT's own forward takes one per call when none is set)")
    return key


class Dropout(Module):
    """Zeroes a fraction ``p`` of activations in training, with keyed masks (``dropout_keys``).

    Sample ``i`` of the batch is global sample ``key.first_sample + i`` of the active key's step;
    its mask comes from the stream of (``seed``, step, ``site``), so it is the same whichever
    rank, replica, stage or micro-batch draws it. Models set ``seed`` (theirs) and ``site``
    (one number per dropout layer) when they build.
    """

    def __init__(self, p: float, seed: int = 0, site: int = 0):
        super().__init__()
        if not 0.0 <= p < 1.0:
            raise ValueError(f"dropout probability must be in [0, 1), got {p}")
        self.p, self.seed, self.site = p, seed, site
        # Where axis 1 of the input sits in the sequence (cp chunks, tp slices: ``sequence_chunks``):
        # the rank draws its positions of the whole sequence's masks, so they are one process's.
        self.place = SequencePlace()

    def forward(self, x):
        if not self.training or self.p == 0.0:
            return x
        return ops.dropout(x, self.p, mask=self.drawer(x.shape, x.dtype, x.xp))

    def drawer(self, shape, dtype, xp):
        """A function of no arguments that draws this call's scales (0 or 1/(1-p)) for an input of
        ``shape``, from the active key as it is now: the op calls it in forward and again in
        backward, so the scales are never kept (the same draws both times)."""
        key = _key_for(self)
        batch, length = shape[0], (shape[1] if len(shape) > 1 else 1)  # axis 1: positions in the sample
        per_sample = (self.place.total(length),) + tuple(shape[2:])
        samples, words = range(key.first_sample, key.first_sample + batch), (self.seed, key.step, self.site)
        ranges = list(self.place.ranges(length))

        def draw():
            runs = [keyed_uniform(words, per_sample, samples, run, draw_dtype(dtype), xp) for run in ranges]
            uniform = runs[0] if len(runs) == 1 else xp.concatenate(runs, axis=1)
            return scale_from_uniform(uniform.reshape(shape), self.p, dtype)

        return draw

    def extra_repr(self):
        return f"p={self.p}"


class HeadDropout(Module):
    """Attention-probability dropout with one keyed stream per attention head.

    Heads are what tensor parallelism splits, so this is the dropout of a sharded region: a
    tp rank draws the masks of its own heads only. Head ``g``'s (T, T) mask of a sample comes
    from the stream of (``seed``, step, ``site``, g) at the sample's place (``dropout_keys``):
    it depends on the global head and sample, not on the layout, so a tp = 4 model drops
    exactly what the unsharded model drops. (Megatron seeds one generator per tp rank instead;
    its masks change whenever tp does.)
    """

    def __init__(self, p: float, heads: range, seed: int = 0, site: int = 0):
        super().__init__()
        if not 0.0 <= p < 1.0:
            raise ValueError(f"dropout probability must be in [0, 1), got {p}")
        self.p, self.heads, self.seed, self.site = p, heads, seed, site
        self.chunks = ChunkLayout()  # the query rows this rank holds under context parallelism

    def forward(self, batch: int, steps: int, dtype, xp):
        """The (B, local heads, T', T) scales (0 or 1/(1-p)) for ``ops.attention`` (T' = T) or
        ``ops.ring_attention`` (T': this rank's query rows, its cp chunks), or None when off.
        ``steps``: the query rows held here."""
        draw = self.drawer(batch, steps, dtype, xp)
        return None if draw is None else draw()

    def drawer(self, batch: int, steps: int, dtype, xp):
        """``forward``'s scales as a function of no arguments (None when off), keyed by the active
        key as it is now: ``ops.attention`` draws them in forward and again in backward."""
        if not self.training or self.p == 0.0:
            return None
        key = _key_for(self)
        samples, step, total = range(key.first_sample, key.first_sample + batch), key.step, steps * self.chunks.size
        ranges = list(self.chunks.ranges(total))

        def draw():
            keep = xp.empty((batch, len(self.heads), steps, total), dtype=draw_dtype(dtype))
            for local, head in enumerate(self.heads):
                row = 0
                for run in ranges:
                    keep[:, local, row:row + len(run)] = keyed_uniform((self.seed, step, self.site, head), (total, total),
                                                                       samples, None if len(run) == total else run,
                                                                       keep.dtype, xp)
                    row += len(run)
            # 16-bit models: float32 scales, as dropout_scale gives them (1/(1-p) unrounded)
            return scale_from_uniform(keep, self.p, dtype)

        return draw

    def extra_repr(self):
        return f"p={self.p}, heads={self.heads.start}..{self.heads.stop - 1}"


class Conv2d(Module):
    """NCHW convolution with weight of shape (out_channels, in_channels, k, k)."""

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int, stride: int = 1, padding: int = 0,
                 bias: bool = True, dtype=np.float32, xp=np):
        super().__init__()
        self.stride, self.padding = stride, padding
        fan_in = in_channels * kernel_size * kernel_size
        self.weight = new_parameter((out_channels, in_channels, kernel_size, kernel_size),
                                    init.fan_in_uniform(fan_in), dtype, xp)
        self.bias = new_parameter((out_channels,), init.fan_in_uniform(fan_in), dtype, xp) if bias else None

    def forward(self, x):
        return ops.conv2d(x, self.weight, self.bias, stride=self.stride, padding=self.padding)

    def extra_repr(self):
        out_c, in_c, k, _ = self.weight.shape
        return f"{in_c}, {out_c}, kernel_size={k}, stride={self.stride}, padding={self.padding}"


class _Pool2d(Module):
    def __init__(self, kernel_size: int, stride: int | None = None):
        super().__init__()
        self.kernel_size, self.stride = kernel_size, stride

    def extra_repr(self):
        return f"kernel_size={self.kernel_size}, stride={self.stride}"


class MaxPool2d(_Pool2d):
    def forward(self, x):
        return ops.max_pool2d(x, self.kernel_size, self.stride)


class AvgPool2d(_Pool2d):
    def forward(self, x):
        return ops.avg_pool2d(x, self.kernel_size, self.stride)


class Flatten(Module):
    """(N, d1, d2, ...) -> (N, d1 * d2 * ...)."""

    def forward(self, x: Tensor):
        return ops.reshape(x, (x.shape[0], int(np.prod(x.shape[1:]))))


class ReLU(Module):
    def forward(self, x):
        return ops.relu(x)


class GELU(Module):
    def forward(self, x):
        return ops.gelu(x)
