"""A compressor's error feedback comes back from a checkpoint only in its layout and when it fits
this rank's buckets.

The key's place once named only the dp size and this rank's pp and tp ranks, which dp 2 x pp 2
and dp 2 x tp 2 share: a top-k run resumed from one into the other took the other layout's
residuals and failed in its first step (operands could not be broadcast together). The place
now names the layout, and the load takes the state only when the names and shapes are exactly
those the compressor carries for its own buckets; otherwise it starts afresh and says so.
"""
import logging
from types import SimpleNamespace

import numpy as np
import pytest

from hpcpar.parallel.compression import PowerSGDCompression, TopKCompression
from hpcpar.parallel.compression_state import CompressionState
from hpcpar.state import Saved


def ctx(pp=2, tp=1):
    return SimpleNamespace(dp_size=2, pp_size=pp, tp_size=tp, dp_rank=0, pp_rank=0, tp_rank=0, xp=np)


def bucket(index, *shapes):
    params = [SimpleNamespace(shape=s) for s in shapes]
    return SimpleNamespace(index=index, params=params, flat=np.zeros(sum(int(np.prod(s)) for s in shapes)))


def saved_by(compressor_name, shapes, layout="2x2x1"):
    return Saved({f"compression/{compressor_name}/{name}/{layout}.pp0.tp0/{'x'.join(map(str, shape))}"
                  for name, shape in shapes.items()}, {})


def test_topk_takes_back_its_own_residuals():
    buckets = [bucket(0, (8, 4)), bucket(1, (16,))]
    state = CompressionState(TopKCompression(0.1), ctx(), buckets)
    plan = state.load_plan(saved_by("topk", {"residual.0": (32,), "residual.1": (16,)}))
    assert sorted(read.key.split("/")[2] for read in plan.reads) == ["residual.0", "residual.1"]


@pytest.mark.parametrize("saved_shapes, layout", [({"residual.0": (40,), "residual.1": (16,)}, "2x2x1"),  # other buckets
                                                   ({"residual.0": (32,), "residual.1": (16,)}, "2x1x2")])  # other layout
def test_topk_residuals_of_other_buckets_or_layouts_are_not_taken(caplog, saved_shapes, layout):
    """Nothing is read, the compressor starts afresh, with a warning."""
    compressor = TopKCompression(0.1)
    state = CompressionState(compressor, ctx(), [bucket(0, (8, 4)), bucket(1, (16,))])
    plan = state.load_plan(saved_by("topk", saved_shapes, layout))
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


def test_bfloat16_state_is_saved_as_float32_and_read_back_exactly():
    """HDF5 has no bfloat16: top-k's residuals under bf16 failed every checkpoint of the run."""
    bfloat16 = pytest.importorskip("ml_dtypes").bfloat16
    compressor = TopKCompression(0.1)
    state = CompressionState(compressor, ctx(), [bucket(0, (8, 4))])
    residual = np.random.default_rng(0).standard_normal(32).astype(bfloat16)
    compressor.load_state_arrays({"residual.0": residual})
    (piece,), scalars = state.checkpoint_pieces()
    assert piece.array.dtype == np.float32 and scalars == {piece.key + "/bfloat16": 1}
    restored = TopKCompression(0.1)
    plan = CompressionState(restored, ctx(), [bucket(0, (8, 4))]).load_plan(Saved({piece.key}, scalars))
    (read,) = plan.reads
    read.assign(piece.array.copy())
    for finish in plan.finish:
        finish()
    values = restored.state_arrays()["residual.0"]
    assert values.dtype == bfloat16 and values.tobytes() == residual.tobytes()
