"""What one training step actually sends, from the communicators' counters (to check ``traffic``).

    counts = counted_step(job, comm)   # collective over comm; {communicator: {op: (calls, bytes, wire)}} on rank 0

Runs one untimed step, resets the counters, runs one more (``train_step`` and ``finish_step``,
as ``hpcpar compare`` times them) and sums the counters over the ranks.
"""
from __future__ import annotations

from collections import defaultdict

from ..runtime.context import init
from ..train.build import build
from ..train.loop import context_options, step_masks


def _rank_counts(communicators) -> dict:
    out: dict = defaultdict(dict)
    for name, comm in communicators:
        for op, count in comm.stats.ops.items():
            if count.calls:
                out[name][op] = (count.calls, count.bytes, count.wire_bytes)
    return dict(out)


def counted_step(job, comm) -> dict | None:
    """{communicator: {op: (calls, bytes, wire)}} of one step, summed over ``comm``'s ranks (on its rank 0)."""
    ctx = init(**job.parallel.grid_sizes(), comm=comm, **context_options(job))
    run = build(job, ctx)
    strategy = run.strategy
    communicators = list(ctx.communicators().items()) + [(c.name, c) for c in strategy.derived_communicators()]
    for step in range(2):
        if step == 1:
            for _, c in communicators:
                c.stats.reset()
        inputs, targets = run.train_data.batch_at(step)
        with step_masks(run, step):
            loss = strategy.train_step(inputs, targets)
            strategy.finish_step(job.optimizer.grad_clip, loss)
    mine = _rank_counts(communicators)
    everyone = ctx.world.mpi.gather(mine, root=0)
    ctx.close()  # and the pipeline's tied communicators with it: a caller measures layout after layout
    if everyone is None:  # not rank 0
        return None
    total: dict = defaultdict(lambda: defaultdict(lambda: [0, 0, 0]))
    for counts in everyone:
        for name, ops in counts.items():
            for op, values in ops.items():
                for k in range(3):
                    total[name][op][k] += values[k]
    return {name: {op: tuple(v) for op, v in ops.items()} for name, ops in total.items()}
