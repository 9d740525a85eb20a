"""A small NumPy/CuPy autograd: Tensor, Function, and the ops in ``ops``."""
from .function import Function, is_grad_enabled, no_grad, unbroadcast
from .tensor import Parameter, Tensor

__all__ = ["Function", "Parameter", "Tensor", "is_grad_enabled", "no_grad", "unbroadcast"]
