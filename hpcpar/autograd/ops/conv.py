"""2-D convolution (im2col + one GEMM) and pooling over NCHW arrays.

Everything is built from "taps": the strided view of the input that kernel offset (i, j)
sees in every window. A loop over the kh * kw taps (never over the batch or the image)
does pooling and folds window gradients back; im2col copies a windows view laid out
(C, kh, kw, N, Ho, Wo), whose innermost copies run along image rows, ~4x faster than
the (N, Ho, Wo, C, kh, kw) order. ``as_strided`` exists in NumPy and CuPy alike.
"""
from __future__ import annotations

from ...backend import get_array_module
from .. import precision
from ..function import Function
from ._common import wants_grad


def _pair(value, name, minimum=1):
    pair = (value, value) if isinstance(value, int) else tuple(value)
    if len(pair) != 2 or any(int(v) != v or v < minimum for v in pair):
        raise ValueError(f"{name} must be an int >= {minimum} or a pair of them, got {value!r}")
    return int(pair[0]), int(pair[1])


def _out_size(shape, kernel, stride, op):
    (h, w), (kh, kw), (sh, sw) = shape[2:], kernel, stride
    if kh > h or kw > w:
        raise ValueError(f"{op}: kernel {kernel} is larger than the (padded) input {tuple(shape[2:])}")
    return (h - kh) // sh + 1, (w - kw) // sw + 1


def _tap(x, i, j, stride, out_hw):
    """View (N, C, Ho, Wo) of what kernel offset (i, j) sees in every window."""
    (sh, sw), (ho, wo) = stride, out_hw
    return x[:, :, i:i + sh * (ho - 1) + 1:sh, j:j + sw * (wo - 1) + 1:sw]


def _fold(tap_grad, shape, kernel, stride, out_hw, dtype, xp):
    """Zeros of ``shape`` plus every tap's gradient ``tap_grad(i, j)`` at its place (overlaps add)."""
    out = xp.zeros(shape, dtype=dtype)
    for i in range(kernel[0]):
        for j in range(kernel[1]):
            _tap(out, i, j, stride, out_hw)[...] += tap_grad(i, j)
    return out


def _check_nchw(x, op):
    if x.ndim != 4:
        raise ValueError(f"{op}: input must be NCHW (4-D), got shape {x.shape}")


class Conv2d(Function):
    op = "conv2d"

    def forward(self, x, weight, bias=None, stride=(1, 1), padding=(0, 0)):
        _check_nchw(x, "conv2d")
        if weight.ndim != 4 or weight.shape[1] != x.shape[1]:
            raise ValueError(f"conv2d: weight of shape {weight.shape} (Cout, Cin, kh, kw) does not fit "
                             f"input of shape {x.shape} (N, C, H, W)")
        if bias is not None and bias.shape != weight.shape[:1]:
            raise ValueError(f"conv2d: bias of shape {bias.shape} does not fit weight of shape {weight.shape}")
        xp = get_array_module(x)
        (ph, pw), kernel = padding, weight.shape[2:]
        padded = xp.pad(x, ((0, 0), (0, 0), (ph, ph), (pw, pw))) if ph or pw else x
        n, c = x.shape[:2]
        (ho, wo), (sh, sw), s = _out_size(padded.shape, kernel, stride, "conv2d"), stride, padded.strides
        windows = xp.lib.stride_tricks.as_strided(  # (C, kh, kw, N, Ho, Wo), no copy
            padded, shape=(c, *kernel, n, ho, wo), strides=(s[1], s[2], s[3], s[0], s[2] * sh, s[3] * sw))
        cols = windows.reshape(-1, n * ho * wo)  # im2col: the one copy, (C*kh*kw, N*Ho*Wo)
        out = precision.matmul(weight.reshape(weight.shape[0], -1), cols)  # (Cout, C*kh*kw) @ (C*kh*kw, N*Ho*Wo)
        if bias is not None:
            out += bias[:, None]
        self.cols, self.weight, self.stride, self.padding = cols, weight, stride, padding
        self.padded_shape, self.has_bias = padded.shape, bias is not None
        return xp.ascontiguousarray(out.reshape(-1, n, ho, wo).transpose(1, 0, 2, 3))  # -> (N, Cout, Ho, Wo)

    def backward(self, grad):
        xp = self.xp(grad)
        weight = self.weight
        c_out, c, kh, kw = weight.shape
        n, _, ho, wo = grad.shape
        g2 = grad.transpose(1, 0, 2, 3).reshape(c_out, -1)  # (N, Cout, Ho, Wo) -> (Cout, N*Ho*Wo)
        grad_x = None
        if wants_grad(self, 0):  # folded in (C, N, Hp, Wp) order, the order d_cols comes in
            d_cols = precision.matmul(weight.reshape(c_out, -1).T, g2, keep_float32=True).reshape(c, kh, kw, n, ho, wo)
            c_first = (c, n) + self.padded_shape[2:]
            grad_x = _fold(lambda i, j: d_cols[:, i, j], c_first, (kh, kw), self.stride, (ho, wo), d_cols.dtype, xp)
            (ph, pw), (hp, wp) = self.padding, self.padded_shape[2:]
            grad_x = xp.ascontiguousarray(grad_x[:, :, ph:hp - ph, pw:wp - pw].transpose(1, 0, 2, 3))
        grad_w = precision.matmul(g2, self.cols.T).reshape(weight.shape) if wants_grad(self, 1) else None
        if not self.has_bias:
            return grad_x, grad_w
        return grad_x, grad_w, precision.sum(g2, axis=1) if wants_grad(self, 2) else None


class MaxPool2d(Function):
    """Each window's gradient goes to its first maximum (in row-major order), as in PyTorch."""

    op = "max_pool2d"

    def forward(self, x, kernel, stride):
        _check_nchw(x, "max_pool2d")
        xp = get_array_module(x)
        self.out_hw = _out_size(x.shape, kernel, stride, "max_pool2d")
        out = _tap(x, 0, 0, stride, self.out_hw).copy()
        for tap in range(1, kernel[0] * kernel[1]):
            xp.maximum(out, _tap(x, *divmod(tap, kernel[1]), stride, self.out_hw), out=out)
        # Where the maximum sits is found in backward: forward (also used for evaluation) stays cheap.
        self.x, self.out, self.kernel, self.stride = x, out, kernel, stride
        return out

    def backward(self, grad):
        xp = self.xp(grad)
        unclaimed = xp.ones(self.out.shape, dtype=bool)  # windows whose maximum no earlier tap took

        def tap_grad(i, j):  # called for the taps in row-major order
            hit = _tap(self.x, i, j, self.stride, self.out_hw) == self.out
            hit &= unclaimed
            xp.logical_xor(unclaimed, hit, out=unclaimed)
            return grad * hit

        return (_fold(tap_grad, self.x.shape, self.kernel, self.stride, self.out_hw,
                      precision.accumulation_dtype(self.x.dtype), xp),)


class AvgPool2d(Function):
    op = "avg_pool2d"

    def forward(self, x, kernel, stride):
        _check_nchw(x, "avg_pool2d")
        self.out_hw = _out_size(x.shape, kernel, stride, "avg_pool2d")
        out = _tap(x, 0, 0, stride, self.out_hw).astype(precision.accumulation_dtype(x.dtype))  # a copy
        for tap in range(1, kernel[0] * kernel[1]):
            out += _tap(x, *divmod(tap, kernel[1]), stride, self.out_hw)
        out *= 1.0 / (kernel[0] * kernel[1])
        self.shape, self.dtype, self.kernel, self.stride = x.shape, x.dtype, kernel, stride
        return out

    def backward(self, grad):
        # Each window element's equal share, in the accumulation dtype (upcast explicitly: ml_dtypes
        # 0.7 keeps a 16-bit array times a Python float in 16 bits, where 0.6 gave float32).
        share = precision.upcast(grad) * (1.0 / (self.kernel[0] * self.kernel[1]))
        return (_fold(lambda i, j: share, self.shape, self.kernel, self.stride, self.out_hw,
                      precision.accumulation_dtype(self.dtype), self.xp(grad)),)


def conv2d(x, weight, bias=None, stride=1, padding=0):
    """Cross-correlation of NCHW ``x`` with ``weight`` (Cout, Cin, kh, kw), plus ``bias`` (Cout,)."""
    params = (x, weight) if bias is None else (x, weight, bias)
    return Conv2d.apply(*params, stride=_pair(stride, "conv2d stride"), padding=_pair(padding, "conv2d padding", minimum=0))


def max_pool2d(x, kernel, stride=None):
    """Max over ``kernel`` windows every ``stride`` (default: the kernel, non-overlapping)."""
    kernel = _pair(kernel, "max_pool2d kernel")
    return MaxPool2d.apply(x, kernel=kernel, stride=kernel if stride is None else _pair(stride, "max_pool2d stride"))


def avg_pool2d(x, kernel, stride=None):
    """Mean over ``kernel`` windows every ``stride`` (default: the kernel, non-overlapping)."""
    kernel = _pair(kernel, "avg_pool2d kernel")
    return AvgPool2d.apply(x, kernel=kernel, stride=kernel if stride is None else _pair(stride, "avg_pool2d stride"))
