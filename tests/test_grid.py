"""The grid as a table of axes (hpcpar.runtime.grid): a fourth axis is one entry in a table.

"cp" below is an axis nothing uses (limit 1): a table with it builds contexts with a cp
communicator of one rank and a cp coordinate of 0, and whose coordinates, labels and other
communicators are those of the dp x pp x tp grid (an axis that cannot vary is not spelt).
"""
from dataclasses import replace

import pytest

from hpcpar import compare
from hpcpar.runtime.grid import GRID, Axis, AxisTable, LayoutError
from hpcpar.train.config import ParallelSection

CP = Axis("cp", "slice", "context", "context-parallel slices of the sequence", limit=1)
WITH_CP = AxisTable(GRID.axes + (CP,), rank_order=("pp", "dp", "cp", "tp"), fill="dp")
USED_CP = AxisTable(GRID.axes + (replace(CP, limit=None),), rank_order=WITH_CP.rank_order, fill="dp")


def test_a_fourth_axis_of_size_one_changes_no_coordinate_group_or_label():
    for world in (1, 2, 4, 8):
        assert [m.sizes + (1,) for m in GRID.factorisations(world)] == [m.sizes for m in WITH_CP.factorisations(world)]
        for mesh in GRID.factorisations(world):
            four = WITH_CP.mesh(*mesh.sizes)
            assert four.label() == mesh.label() and four.words() == mesh.words() and four.world_size == world
            assert USED_CP.mesh(*mesh.sizes).label() == mesh.label() + "x1"
            for rank in range(world):
                assert four.coordinates(rank) == mesh.coordinates(rank) and four.coordinate(rank, "cp") == 0
                assert USED_CP.mesh(*mesh.sizes).coordinates(rank) == mesh.coordinates(rank)[:2] + (0,) + \
                    mesh.coordinates(rank)[2:]
            for name in GRID.names:
                assert four.groups(name) == mesh.groups(name)
            assert four.groups("cp") == [[rank] for rank in range(world)]
            assert four.format() == mesh.format()  # no row for an axis that cannot vary
            zeros = f"{'cp (slice)':<13}" + " ".join([f"{0:>2}"] * world)
            assert USED_CP.mesh(*mesh.sizes).format() == mesh.format().replace("\ntp (shard)", f"\n{zeros}\ntp (shard)")
    assert WITH_CP.resolve(8, pp=2, tp=2).sizes == (2, 2, 2, 1)
    with pytest.raises(LayoutError, match="cp must be at most 1, got 2"):
        WITH_CP.resolve(8, cp=2)
    with pytest.raises(LayoutError, match="dp x pp x tp = 3 x 1 x 1 = 3 does not equal the world size 4"):
        WITH_CP.resolve(4, dp=3)
    with pytest.raises(LayoutError, match=r"not divisible by pp x tp = 3 x 1 = 3; launch a multiple of 3 ranks or "
                                          r"change pp/tp"):
        WITH_CP.resolve(4, pp=3)
    with pytest.raises(LayoutError, match="not divisible by pp x tp x cp = 3 x 1 x 1 = 3"):
        USED_CP.resolve(4, pp=3)


def test_groups_of_a_product_of_axes_agree_on_the_other_axes():
    mesh = GRID.mesh(dp=2, pp=2, tp=2)
    assert mesh.groups("dp", "tp") == [[0, 1, 2, 3], [4, 5, 6, 7]]  # one per stage
    assert mesh.groups("tp", "pp") == [[0, 1, 4, 5], [2, 3, 6, 7]]  # one per replica
    assert mesh.groups("dp", "pp", "tp") == [list(range(8))]
    with pytest.raises(ValueError, match="axis must be one of"):
        mesh.groups("world")


def test_the_job_keys_compare_and_the_labels_come_from_the_table():
    assert list(ParallelSection.__dataclass_fields__)[:len(GRID.spelt)] == list(GRID.spelt) == ["dp", "pp", "tp"]
    assert WITH_CP.spelt == GRID.spelt and USED_CP.spelt == GRID.spelt + ("cp",)
    assert ParallelSection(pp=2, tp=2).grid_sizes() == {"dp": None, "pp": 2, "tp": 2}
    assert ParallelSection(dp=2, pp=2).grid_ranks() == 4 and ParallelSection(pp=2).grid_ranks() is None
    assert compare.factorisations(4) == [(4, 1, 1), (1, 4, 1), (1, 1, 4), (1, 2, 2), (2, 1, 2), (2, 2, 1)]
    assert [compare.label(layout) for layout in [(1, 1, 1), (1, 4, 1), (2, 1, 2)]] == [
        "1x1x1 one rank", "1x4x1 pure pipeline", "2x1x2 hybrid"]


@pytest.mark.mpi(min_size=1)
def test_contexts_of_a_table_with_a_fourth_axis(world):
    """At every layout of the world (run at 1, 2 and 4 ranks): the coordinates, the communicator
    of each axis and of a product, the labels and the grid table."""
    from mpi4py import MPI

    from hpcpar.runtime.context import build
    from hpcpar.runtime.process import setup

    rank = world.Get_rank()
    for mesh in WITH_CP.factorisations(world.Get_size()):
        ctx = build(setup(world, "cpu"), mesh)
        assert (ctx.pp_rank, ctx.dp_rank, ctx.tp_rank) == mesh.coordinates(rank)
        assert (ctx.cp_rank, ctx.cp_size, ctx.cp.size, ctx.cp.rank) == (0, 1, 1, 0)
        assert ctx.layout == {**GRID.mesh(*mesh.shape).by_name(), "world": world.Get_size()}
        for name in WITH_CP.names:
            assert getattr(ctx, name).size == mesh.size(name)
            assert getattr(ctx, name).allgather_object(rank) == next(g for g in mesh.groups(name) if rank in g)
        both = ctx.across("tp", "dp")
        assert both is ctx.across("dp", "tp") and both.name == "dp*tp"
        assert both.allgather_object(rank) == next(g for g in mesh.groups("dp", "tp") if rank in g)
        assert ctx.across("cp") is ctx.cp and set(ctx.communicators()) == {"world", *WITH_CP.names, "dp*tp"}
        assert ctx.grid_table() == mesh.format() and "cp (slice)" not in ctx.grid_table()
        assert ctx.mesh.label() == GRID.mesh(*mesh.shape).label() == "x".join(map(str, mesh.sizes[:3]))
        assert ctx.pp_prev == (None if ctx.pp_rank == 0 else ctx.pp_rank - 1)
        assert set(ctx.crossing_axes) <= set(WITH_CP.names)
        with pytest.raises(AttributeError):
            ctx.ep_size
        ctx.close()
        assert both.mpi == MPI.COMM_NULL and ctx.cp.mpi == MPI.COMM_NULL
