"""A compressor's error feedback comes back from a checkpoint only when it fits this rank's buckets.

Two layouts of one dp size share the key's place (``dp2.pp0.tp0`` in dp 2 x pp 2 and in dp 2 x tp 2),
so the key alone cannot tell them apart: a top-k run resumed from dp 2 x pp 2 into dp 2 x tp 2
took the other layout's residuals and failed in its first step (operands could not be broadcast
together). The load now takes the state only when the names and shapes are exactly those the
compressor carries for its own buckets, and otherwise starts afresh and says so.
"""
import logging
from types import SimpleNamespace

import numpy as np

from hpcpar.parallel.compression import PowerSGDCompression, TopKCompression
from hpcpar.parallel.compression_state import CompressionState
from hpcpar.state import Saved


def ctx():
    return SimpleNamespace(dp_size=2, dp_rank=0, pp_rank=0, tp_rank=0, xp=np)


def bucket(index, *shapes):
    params = [SimpleNamespace(shape=s) for s in shapes]
    return SimpleNamespace(index=index, params=params, flat=np.zeros(sum(int(np.prod(s)) for s in shapes)))


def saved_by(compressor_name, shapes):
    return Saved({f"compression/{compressor_name}/{name}/dp2.pp0.tp0/{'x'.join(map(str, shape))}"
                  for name, shape in shapes.items()}, {})


def test_topk_takes_back_its_own_residuals():
    buckets = [bucket(0, (8, 4)), bucket(1, (16,))]
    state = CompressionState(TopKCompression(0.1), ctx(), buckets)
    plan = state.load_plan(saved_by("topk", {"residual.0": (32,), "residual.1": (16,)}))
    assert sorted(read.key.split("/")[2] for read in plan.reads) == ["residual.0", "residual.1"]


def test_topk_residuals_of_other_buckets_are_not_taken(caplog):
    """Saved by dp 2 x pp 2 (other buckets, the same place in the key): nothing is read, the compressor
    starts afresh, with a warning."""
    compressor = TopKCompression(0.1)
    state = CompressionState(compressor, ctx(), [bucket(0, (8, 4)), bucket(1, (16,))])
    plan = state.load_plan(saved_by("topk", {"residual.0": (40,), "residual.1": (16,)}))
    assert plan.reads == []
    with caplog.at_level(logging.WARNING):
        for finish in plan.finish:
            finish()
    assert compressor.state_arrays() == {}
    assert "saved in another layout or with other buckets: it starts afresh" in caplog.text


def test_powersgd_state_shapes_are_its_matrices_errors_and_qs():
    compressor = PowerSGDCompression(rank=2)
    shapes = compressor.state_shapes([bucket(3, (16, 8), (8,), (2, 2))])
    assert shapes == {"error.3.0": (16, 8), "q.3.0": (8, 2)}  # (8,) is a vector, (2, 2) too small to compress
    assert CompressionState(compressor, ctx(), [bucket(3, (16, 8), (8,))]).load_plan(
        saved_by("powersgd", {"error.3.0": (16, 8), "q.3.0": (8, 2)})).reads
