"""The dp x pp x tp grid: coordinates, communicator membership, neighbours, layout errors."""
import os
import itertools

import pytest

import hpcpar
from hpcpar.runtime import LayoutError, format_grid, resolve_layout
from hpcpar.runtime.context import coordinates


def factorisations(n):
    return [(dp, pp, tp) for dp, pp, tp in itertools.product(range(1, n + 1), repeat=3) if dp * pp * tp == n]


def test_coordinates_put_tp_fastest_then_cp_dp_and_pp():
    # The 8-rank example of the ParallelContext docstring.
    assert [coordinates(r, 2, 2, 2) for r in range(8)] == [
        (0, 0, 0, 0), (0, 0, 0, 1), (0, 1, 0, 0), (0, 1, 0, 1), (1, 0, 0, 0), (1, 0, 0, 1), (1, 1, 0, 0), (1, 1, 0, 1)]
    assert "tp (shard)    0  1  0  1  0  1  0  1" in format_grid(2, 2, 2)


@pytest.mark.parametrize("world, kwargs, message", [
    (6, dict(pp=4), "world size 6 is not divisible by pp x tp = 4 x 1 = 4"),
    (4, dict(pp=3, tp=1), "not divisible by pp x tp = 3 x 1 = 3"),
    (8, dict(dp=3, pp=2, tp=1), "dp x pp x tp = 3 x 2 x 1 = 6 does not equal the world size 8"),
    (4, dict(tp=0), "tp must be a positive integer"),
])
def test_wrong_layouts_name_the_numbers(world, kwargs, message):
    with pytest.raises(LayoutError, match=message.replace("x", r"x").replace("(", r"\(")):
        resolve_layout(world, **kwargs)


def test_dp_fills_the_world_by_default():
    assert resolve_layout(8, pp=2, tp=2) == (2, 2, 2, 1)
    assert resolve_layout(4) == (4, 1, 1, 1)
    assert resolve_layout(8, tp=2, cp=2) == (2, 1, 2, 2)


@pytest.mark.mpi(min_size=1)
def test_grid_for_every_factorisation(world):
    size, rank = world.Get_size(), world.Get_rank()
    for dp, pp, tp in factorisations(size):
        ctx = hpcpar.init(dp=dp, pp=pp, tp=tp, device="cpu")
        assert (ctx.pp_rank, ctx.dp_rank, ctx.cp_rank, ctx.tp_rank) == coordinates(rank, dp, pp, tp)
        assert (ctx.dp.size, ctx.pp.size, ctx.tp.size) == (dp, pp, tp)
        assert (ctx.dp.rank, ctx.pp.rank, ctx.tp.rank) == (ctx.dp_rank, ctx.pp_rank, ctx.tp_rank)
        # Members of each group: same coordinates on the other two axes.
        for comm, axis in ((ctx.tp, 3), (ctx.dp, 1), (ctx.pp, 0)):
            members = comm.allgather_object(rank)
            mine = coordinates(rank, dp, pp, tp)
            expected = [r for r in range(size)
                        if all(coordinates(r, dp, pp, tp)[a] == mine[a] for a in range(4) if a != axis)]
            assert members == expected, (dp, pp, tp, comm.name)
        assert ctx.pp_prev == (None if ctx.pp_rank == 0 else ctx.pp_rank - 1)
        assert ctx.pp_next == (None if ctx.pp_rank == pp - 1 else ctx.pp_rank + 1)
        assert ctx.is_first_stage == (ctx.pp_rank == 0) and ctx.is_last_stage == (ctx.pp_rank == pp - 1)
        assert 0 <= ctx.node_rank < ctx.node_size


@pytest.mark.mpi(min_size=2)
def test_init_rejects_a_layout_on_every_rank_without_waiting(world):
    with pytest.raises(LayoutError, match=f"world size {world.Get_size()} is not divisible"):
        hpcpar.init(pp=world.Get_size() + 1)


def test_ranks_on_one_node_share_its_cores_among_their_blas_threads(monkeypatch):
    from threadpoolctl import threadpool_info, threadpool_limits

    from hpcpar import host

    before = {pool["internal_api"]: pool["num_threads"] for pool in threadpool_info() if pool["user_api"] == "blas"}
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert host.share_cores(64) is None  # the user chose: left alone
    for name in host.BLAS_THREAD_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    try:
        cores = len(os.sched_getaffinity(0))
        assert host.share_cores(4 * cores) == 1  # more ranks than cores: one thread each
        assert all(pool["num_threads"] == 1 for pool in threadpool_info() if pool["user_api"] == "blas")
        assert host.blas_threads().endswith(" 1")
    finally:
        threadpool_limits(limits=max(before.values(), default=1), user_api="blas")


@pytest.mark.mpi(min_size=2)
def test_closing_contexts_returns_their_communicator_ids(world):
    """MPICH has 2048 communicator ids per process and a context with its shared-memory
    windows takes about eight: 400 contexts, each used and closed, would not fit unclosed."""
    import numpy as np
    from mpi4py import MPI

    from hpcpar.runtime.context import open_contexts
    from hpcpar.runtime.shm import shared_zeros

    for _ in range(400):
        ctx = hpcpar.init(dp=world.Get_size(), shm=True)
        buffer = shared_zeros(ctx.dp, 1 << 15, np.float32)  # 128 KiB: the shared-memory path's windows
        buffer[...] = 1.0
        ctx.dp.allreduce(buffer, out=buffer)
        assert buffer[0] == world.Get_size()
        ctx.close()
        ctx.close()  # a second close does nothing
    assert ctx.dp.mpi == MPI.COMM_NULL and ctx.grid == MPI.COMM_NULL and ctx not in open_contexts()


# Rounds of the test below: before contexts adopted what strategies derive, MPICH ran out of
# communicator ids in round 254 of them (at 2 and 4 ranks: about 8 ids left behind per round).
ROUNDS = 300


@pytest.mark.mpi(min_size=2)
def test_closing_a_context_frees_what_its_strategies_derived(world):
    """A pipeline splits a communicator per group of tied weights (the GPT's embedding and head at
    pp > 1); a parameter server duplicates the world, splits it into workers and servers and
    builds the workers' context on their half. Each context adopts them and ``close`` frees
    them, so ROUNDS rounds run (without, MPICH runs out of communicator ids first); the handles
    show it directly: MPI_Comm_free sets them to COMM_NULL."""
    import numpy as np
    from mpi4py import MPI

    from hpcpar.runtime.context import open_contexts
    from hpcpar.nn.gpt import GPT, GPTConfig
    from hpcpar.optim import SGD
    from hpcpar.parallel.pipeline import PipelineParallel
    from hpcpar.parallel.ps import ParameterServer

    size = world.Get_size()
    config = GPTConfig(vocab_size=16, block_size=4, n_layer=max(1, size - 2), n_head=2, n_embd=8)
    model = GPT(config, dtype=np.float64)  # layers: embedding, blocks, head: at least one per stage at pp = size
    for _ in range(ROUNDS):
        pipe_ctx, ps_ctx = hpcpar.init(pp=size), hpcpar.init()
        tied = [comm for comm, _, _ in PipelineParallel(model, pipe_ctx, micro_batches=1)._tied]
        ps = ParameterServer(model.named_parameters(), ps_ctx, SGD, servers=1, lr=0.1)
        # Only the first and last stages hold the tied embedding: the middle ones are outside its split.
        assert len(tied) == (pipe_ctx.is_first_stage or pipe_ctx.is_last_stage)
        derived = tied + [ps.comm, ps.ctx.dp if ps.is_worker else ps.server_comm]
        assert all(comm.mpi != MPI.COMM_NULL for comm in derived)
        pipe_ctx.close()
        ps_ctx.close()
        assert all(comm.mpi == MPI.COMM_NULL for comm in derived)
        assert not ps.is_worker or (ps.ctx.closed and ps.ctx not in open_contexts())  # the workers' context too
    with pytest.raises(RuntimeError, match="is closed"):
        ps_ctx.adopt(ps.comm)
