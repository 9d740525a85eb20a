"""Parallel strategies: data (DDP, ZeRO-1, compression, sampler), pipeline, tensor."""
from .compression import FP16Compression, NoCompression, PowerSGDCompression, TopKCompression, make_compressor
from .data import DistributedDataParallel
from .sampler import DistributedSampler, reduce_metric

__all__ = ["DistributedDataParallel", "DistributedSampler", "FP16Compression", "NoCompression",
           "PowerSGDCompression", "TopKCompression", "make_compressor", "reduce_metric"]
