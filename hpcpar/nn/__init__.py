"""Modules, layers and models (GPT, a digits CNN) on the hpcpar autograd."""
from . import init
from .cnn import DigitsCNN
from .dropout_keys import DropoutKey, active_dropout_key, dropout_key, offset_dropout_key, replay_dropout_key
from .gpt import GPT, Block, CausalSelfAttention, GPTConfig, GPTEmbedding, GPTHead, MLP
from .layers import GELU, AvgPool2d, Conv2d, Dropout, Embedding, Flatten, HeadDropout, LayerNorm, Linear, MaxPool2d, ReLU
from .module import IncompatibleKeys, Module, ModuleList, Sequential

__all__ = [
    "AvgPool2d", "Block", "CausalSelfAttention", "Conv2d", "DigitsCNN", "Dropout", "DropoutKey", "Embedding", "Flatten", "GELU",
    "GPT", "GPTConfig", "GPTEmbedding", "GPTHead", "HeadDropout", "IncompatibleKeys", "LayerNorm", "Linear", "MLP", "MaxPool2d",
    "Module", "ModuleList", "ReLU", "Sequential", "active_dropout_key", "dropout_key", "init", "offset_dropout_key",
    "replay_dropout_key",
]
