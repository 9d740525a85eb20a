"""The grid as a table of axes (hpcpar.runtime.grid): the fourth axis, cp, is one entry in a table.

``THREE`` is the dp x pp x tp table of before: at cp = 1 the grid's coordinates, labels, groups
and tables are those of ``THREE`` (a ``suffix`` axis is spelt only above 1); at cp > 1 the cp
peers are adjacent after tp. ``EP`` is an axis nothing uses (limit 1): not spelt at all.
"""

import pytest

from hpcpar import compare
from hpcpar.checkpoint.manifest import AXES, layout_words
from hpcpar.runtime.grid import GRID, Axis, AxisTable, LayoutError
from hpcpar.train.config import ParallelSection

THREE = AxisTable(GRID.axes[:3], rank_order=("pp", "dp", "tp"), fill="dp")
EP = Axis("ep", "expert", "expert", "expert-parallel ranks", limit=1)
WITH_EP = AxisTable(GRID.axes + (EP,), rank_order=GRID.rank_order + ("ep",), fill="dp")


def test_cp_of_size_one_changes_no_group_or_label_and_an_unused_axis_is_not_spelt():
    for world in (1, 2, 4, 8):
        assert [m.sizes for m in THREE.factorisations(world)] == [
            m.sizes[:3] for m in GRID.factorisations(world) if m.size("cp") == 1]
        for mesh in THREE.factorisations(world):
            four = GRID.mesh(*mesh.sizes)
            assert four.label() == mesh.label() and four.words() == mesh.words() and four.world_size == world
            assert WITH_EP.mesh(*mesh.sizes).label() == mesh.label()
            for rank in range(world):
                pp, dp, tp = mesh.coordinates(rank)
                assert four.coordinates(rank) == (pp, dp, 0, tp) and four.coordinate(rank, "cp") == 0
                assert WITH_EP.mesh(*mesh.sizes).coordinates(rank) == four.coordinates(rank)
            for name in THREE.names:
                assert four.groups(name) == mesh.groups(name)
            assert four.groups("cp") == [[rank] for rank in range(world)]
            assert four.format() == mesh.format()  # no row for cp at 1
    assert GRID.resolve(8, pp=2, tp=2).sizes == (2, 2, 2, 1)
    with pytest.raises(LayoutError, match="ep must be at most 1, got 2"):
        WITH_EP.resolve(8, ep=2)
    with pytest.raises(LayoutError, match="dp x pp x tp = 3 x 1 x 1 = 3 does not equal the world size 4"):
        GRID.resolve(4, dp=3)  # cp at 1 is left out of the message
    with pytest.raises(LayoutError, match=r"not divisible by pp x tp = 3 x 1 = 3; launch a multiple of 3 "
                                          r"ranks or change pp/tp"):
        GRID.resolve(4, pp=3)
    with pytest.raises(LayoutError, match=r"not divisible by pp x tp x cp = 1 x 1 x 3 = 3"):
        GRID.resolve(4, cp=3)
    with pytest.raises(LayoutError, match=r"dp x pp x tp x cp = 1 x 1 x 1 x 2 = 2 does not equal the world size 4"):
        GRID.resolve(4, dp=1, cp=2)


def test_cp_peers_are_adjacent_after_tp_and_spelt_by_name():
    mesh = GRID.mesh(dp=2, tp=2, cp=2)
    assert mesh.label() == "2x1x2-cp2" and mesh.words() == "dp 2 x pp 1 x tp 2 x cp 2"
    assert mesh.groups("tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert mesh.groups("cp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert mesh.groups("dp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert mesh.groups("dp", "cp") == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert "cp (chunk)" in mesh.format().splitlines()[3] and mesh.coordinates(6) == (0, 1, 1, 0)


def test_groups_of_a_product_of_axes_agree_on_the_other_axes():
    mesh = GRID.mesh(dp=2, pp=2, tp=2)
    assert mesh.groups("dp", "tp") == [[0, 1, 2, 3], [4, 5, 6, 7]]  # one per stage
    assert mesh.groups("tp", "pp") == [[0, 1, 4, 5], [2, 3, 6, 7]]  # one per replica
    assert mesh.groups("dp", "pp", "tp") == [list(range(8))]
    with pytest.raises(ValueError, match="axis must be one of"):
        mesh.groups("world")


def test_the_job_keys_compare_and_the_labels_come_from_the_table():
    assert list(ParallelSection.__dataclass_fields__)[:len(GRID.spelt)] == list(GRID.spelt) == ["dp", "pp", "tp", "cp"]
    assert WITH_EP.spelt == GRID.spelt
    assert AXES == GRID.spelt  # the checkpoint tools' copy of the order (they load without MPI)
    assert layout_words({"cp": 2, "dp": 1, "pp": 1, "tp": 2, "world": 4}) == "dp 1 x pp 1 x tp 2 x cp 2"
    assert ParallelSection(pp=2, tp=2).grid_sizes() == {"dp": None, "pp": 2, "tp": 2, "cp": 1}
    assert ParallelSection(dp=2, pp=2).grid_ranks() == 4 and ParallelSection(pp=2).grid_ranks() is None
    assert compare.factorisations(4) == [(4, 1, 1, 1), (1, 4, 1, 1), (1, 1, 4, 1), (1, 1, 1, 4), (1, 1, 2, 2),
                                         (1, 2, 1, 2), (1, 2, 2, 1), (2, 1, 1, 2), (2, 1, 2, 1), (2, 2, 1, 1)]
    assert [compare.label(layout) for layout in [(1, 1, 1), (1, 4, 1), (2, 1, 2), (1, 1, 1, 4), (2, 1, 1, 2)]] == [
        "1x1x1 one rank", "1x4x1 pure pipeline", "2x1x2 hybrid", "1x1x1-cp4 pure context", "2x1x1-cp2 hybrid"]


@pytest.mark.mpi(min_size=1)
def test_contexts_of_a_table_with_a_fourth_axis(world):
    """At every layout of the world (run at 1, 2 and 4 ranks): the coordinates, the communicator
    of each axis and of a product, the labels and the grid table."""
    from mpi4py import MPI

    from hpcpar.runtime.context import build
    from hpcpar.runtime.process import setup

    rank = world.Get_rank()
    for mesh in WITH_EP.factorisations(world.Get_size()):
        ctx = build(setup(world, "cpu"), mesh)
        assert (ctx.pp_rank, ctx.dp_rank, ctx.cp_rank, ctx.tp_rank) == mesh.coordinates(rank)
        assert (ctx.ep_rank, ctx.ep_size, ctx.ep.size, ctx.ep.rank) == (0, 1, 1, 0)
        shown = {name: size for name, size in GRID.mesh(*mesh.shape).by_name().items() if name != "cp" or size > 1}
        assert ctx.layout == {**shown, "world": world.Get_size()}  # what checkpoints record: cp only above 1
        assert ctx.dp_cp is (ctx.dp if mesh.size("cp") == 1 else ctx.across("dp", "cp"))
        for name in WITH_EP.names:
            assert getattr(ctx, name).size == mesh.size(name)
            assert getattr(ctx, name).allgather_object(rank) == next(g for g in mesh.groups(name) if rank in g)
        both = ctx.across("tp", "dp")
        assert both is ctx.across("dp", "tp") and both.name == "dp*tp"
        assert both.allgather_object(rank) == next(g for g in mesh.groups("dp", "tp") if rank in g)
        dp_cp = {"dp*cp"} if mesh.size("cp") > 1 else set()
        assert ctx.across("ep") is ctx.ep and set(ctx.communicators()) == {"world", *WITH_EP.names, "dp*tp", *dp_cp}
        assert ctx.grid_table() == mesh.format() and "ep (expert)" not in ctx.grid_table()
        assert ctx.mesh.label() == GRID.mesh(*mesh.shape).label()
        assert ctx.pp_prev == (None if ctx.pp_rank == 0 else ctx.pp_rank - 1)
        assert set(ctx.crossing_axes) <= set(WITH_EP.names)
        with pytest.raises(AttributeError):
            ctx.moe_size
        ctx.close()
        assert both.mpi == MPI.COMM_NULL and ctx.ep.mpi == MPI.COMM_NULL
