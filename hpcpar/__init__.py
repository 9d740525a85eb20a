"""hpcpar: data, pipeline and tensor parallel training of neural networks over MPI.

    import hpcpar
    ctx = hpcpar.init(pp=2, tp=2)        # dp fills the rest of the world
"""
__version__ = "0.1.0"

from .backend import tune_host_allocator as _tune_host_allocator

_tune_host_allocator()  # before the first large array: see hpcpar.backend.tune_host_allocator


def init(dp=None, pp=1, tp=1, device="auto", **kwargs):
    """Build the ParallelContext (see hpcpar.dist.context.init). MPI starts on first use."""
    from .dist.context import init as _init

    return _init(dp=dp, pp=pp, tp=tp, device=device, **kwargs)
