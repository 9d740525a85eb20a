"""Parallel training: data (DDP, ZeRO-1, compression), pipeline, sequence-parallel grads, asynchronous modes."""
from .compression import FP16Compression, NoCompression, PowerSGDCompression, TopKCompression, make_compressor
from .data import DistributedDataParallel

__all__ = ["DistributedDataParallel", "FP16Compression", "NoCompression", "PowerSGDCompression", "TopKCompression",
           "make_compressor"]
