"""How the replicas agree: one ``Strategy`` per way, picked from the job by ``strategy_class``.

| strategy | chosen when | module |
|---|---|---|
| ``AllReduce`` | mode = "allreduce", pp = 1 | allreduce.py (DDP or ZeRO-1, tp in the model) |
| ``Pipeline`` | mode = "allreduce", pp > 1 | pipeline.py (PipelineParallel, DDP or ZeRO-1 around it) |
| ``ParameterServerStrategy`` | mode = "ps" | ps.py |
| ``LocalSGDStrategy`` | mode = "local_sgd" | local_sgd.py |

A new way to agree is a new module with a ``Strategy`` subclass (base.py) and a line in
``STRATEGIES`` (plus its name among the job schema's ``parallel.mode`` choices).
"""
from __future__ import annotations

from .allreduce import AllReduce
from .base import Strategy
from .local_sgd import LocalSGDStrategy
from .pipeline import Pipeline
from .ps import ParameterServerStrategy

STRATEGIES = {"allreduce": AllReduce, "pipeline": Pipeline, "ps": ParameterServerStrategy,
              "local_sgd": LocalSGDStrategy}


def strategy_name(job) -> str:
    """The strategy a job runs: its ``parallel.mode``, and ``pipeline`` for all-reduce with pp > 1."""
    mode = job.parallel.mode
    return "pipeline" if mode == "allreduce" and job.parallel.pp > 1 else mode


def strategy_class(job) -> type[Strategy]:
    """The ``Strategy`` subclass of ``job``: what the loop and validation ask before one is built."""
    return STRATEGIES[strategy_name(job)]


def make_strategy(job, ctx, model, data=None, precision=None) -> Strategy:
    """The strategy of ``job`` on ``ctx`` for ``model``. ``data``: the train batches of ``ctx`` (a
    pipeline cuts balanced stages on a sample of them; None for a strategy with ``own_context``);
    ``precision``: the job's ``Precision`` (None: ``job.precision``). Collective."""
    return strategy_class(job)(job, ctx, model, job.precision if precision is None else precision, data)


__all__ = ["AllReduce", "LocalSGDStrategy", "ParameterServerStrategy", "Pipeline", "STRATEGIES", "Strategy",
           "make_strategy", "strategy_class", "strategy_name"]
