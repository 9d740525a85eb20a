"""hpcpar: data, pipeline, tensor and context parallel training of neural networks over MPI.

    import hpcpar
    ctx = hpcpar.init(pp=2, tp=2)        # dp fills the rest of the world

Importing hpcpar changes nothing in the process; ``init`` applies the process-wide settings
(glibc's allocator, BLAS threads: see hpcpar.host; with several ranks, an uncaught exception
aborts the job: hpcpar.runtime.failfast) and reports them in ``ctx.host``.
"""
__version__ = "0.1.0"


def init(dp=None, pp=1, tp=1, device="auto", **kwargs):
    """Build the ParallelContext (see hpcpar.runtime.context.init). MPI starts on first use."""
    from .runtime.context import init as _init

    return _init(dp=dp, pp=pp, tp=tp, device=device, **kwargs)
