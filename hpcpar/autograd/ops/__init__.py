"""The differentiable ops, grouped by family; ``Tensor``'s operators call these by name.

Every op is a small ``Function`` (forward and backward side by side) plus a function that
applies it. Inputs may be Tensors, arrays or Python numbers (constants of the tensor's dtype).
"""
from .arithmetic import add, div, matmul, mul, neg, pow, sub
from .conv import avg_pool2d, conv2d, max_pool2d
from .elementwise import exp, gelu, log, masked_fill, relu, sqrt, tanh, where
from .nn_functional import (attention, cross_entropy, dropout, embedding, layer_norm, linear, log_softmax,
                            softmax)
from .reduction import max, mean, sum
from .shape import concatenate, getitem, reshape, split, transpose

__all__ = [
    "add", "sub", "mul", "div", "neg", "pow", "matmul",
    "sum", "mean", "max",
    "reshape", "transpose", "getitem", "concatenate", "split",
    "where", "masked_fill", "exp", "log", "sqrt", "tanh", "relu", "gelu",
    "softmax", "log_softmax", "cross_entropy", "embedding", "layer_norm", "dropout", "linear", "attention",
    "conv2d", "max_pool2d", "avg_pool2d",
]
