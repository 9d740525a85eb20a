"""What every strategy builds from a job the same way: the optimizer class, the compressor."""
from __future__ import annotations

from ...optim import SGD, Adam, AdamW
from ...parallel.compression import make_compressor


def optimizer_class(job):
    """(optimizer class, its options) from the job's [optimizer] section."""
    o = job.optimizer
    decay = dict(weight_decay=o.weight_decay, no_decay=o.no_decay)  # groups by parameter name
    if o.name == "sgd":
        return SGD, dict(lr=o.lr, momentum=o.momentum, **decay)
    cls = AdamW if o.name == "adamw" else Adam
    return cls, dict(lr=o.lr, betas=tuple(o.betas), **decay)


def make_gradient_compressor(parallel):
    """The compressor of ``parallel.compression`` (None: plain all-reduce)."""
    if parallel.compression == "none":
        return None
    options = {"topk": {"ratio": parallel.compression_ratio}, "powersgd": {"rank": parallel.powersgd_rank}}
    return make_compressor(parallel.compression, **options.get(parallel.compression, {}))


def state_bytes(optimizer) -> int:
    """Bytes of array state an optimizer keeps."""
    return sum(v.nbytes for s in optimizer.state.values() for v in s.values() if hasattr(v, "nbytes"))
