"""The NCCL communicator on CPUs: NCCL's calls simulated over MPI by a double on the transfer
guard's device arrays, which checks every buffer's stream order (tests/nccl_double.py).

Run at 1, 2 and 4 ranks: results and counters equal the MPI communicator's, point-to-point
calls are grouped, and a planted missing event (producer or consumer side) is caught.
"""
import numpy as np
import pytest

import nccl_double
from hpcpar import guard
from hpcpar.runtime import Communicator
from hpcpar.runtime.nccl import NcclCommunicator, choose_backend, describe_backend
from hpcpar.parallel.pipeline.schedules import RECVS, SENDS, SCHEDULES, interleaved_fit, make_schedule

xp = guard.xp
mpi = pytest.mark.mpi(min_size=1)


@pytest.fixture
def nccl(world):
    return NcclCommunicator(world, "world", runtime=nccl_double.runtime())


@pytest.fixture
def reference(world):
    return Communicator(world, "world")


def rank_data(rank, shape=(6, 5), dtype=np.float64):
    return np.random.default_rng(100 + rank).standard_normal(shape).astype(dtype)


def host(array):
    return guard.asnumpy(array)  # checks that the current stream is ordered after the array's producer


def run_collectives(comm, on_device: bool, dtype):
    """The same calls on either communicator; the results on the host."""
    move = xp.asarray if on_device else (lambda a: a)
    n, r = comm.size, comm.rank
    x = move(rank_data(r, (2 * n, 3), dtype))
    results = [comm.allreduce(x, op) for op in ("sum", "mean", "max", "min")]
    inplace = move(rank_data(r, (4,), dtype))
    results.append(comm.allreduce(inplace, out=inplace))
    results.append(comm.allreduce(x.T, "sum"))  # a non-contiguous view
    results.append(comm.iallreduce(x, "sum").wait())
    results.append(comm.reduce_scatter(x, "sum"))
    results.append(comm.reduce_scatter(x, "mean"))
    results.append(comm.allgather(x))
    flat = move(np.zeros(n * x.size, dtype))
    results.append(comm.allgather(x, out=flat))
    for root in range(n):
        y = move(rank_data(r, (3,), dtype))
        results.append(comm.broadcast(y, root=root))
    return [host(a) if on_device else a for a in results]


@mpi
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_collectives_equal_the_mpi_communicators(nccl, reference, dtype):
    before = nccl_double.calls["allReduce"]
    for got, want in zip(run_collectives(nccl, True, dtype), run_collectives(reference, False, dtype)):
        np.testing.assert_array_equal(got, want)
    assert nccl_double.calls["allReduce"] - before == 7  # NCCL did the work, not an MPI fallback


@mpi
def test_counters_equal_the_mpi_communicators(nccl, reference):
    nccl.stats.reset()
    reference.stats.reset()
    run_collectives(nccl, True, np.float32)
    run_collectives(reference, False, np.float32)
    def counts(stats):
        return {op: (c["calls"], c["bytes"], c["wire_bytes"]) for op, c in stats.as_dict().items()}

    assert counts(nccl.stats) == counts(reference.stats)


@mpi
def test_watchdog_numbers_collectives_alike(nccl, reference):
    if nccl.watchdog is None:
        pytest.skip("HPCPAR_STALL_S=0")
    before = nccl.watchdog.collectives_called
    run_collectives(nccl, True, np.float64)
    # NCCL's and MPI's wrappers of one MPI communicator share its watchdog: the same numbering
    assert nccl.watchdog is reference.watchdog and nccl.watchdog.collectives_called - before == 7 + 4 + nccl.size


@mpi
def test_float16_moves_natively(nccl, reference):
    x = rank_data(nccl.rank, (5,), np.float16)
    got = host(nccl.allreduce(xp.asarray(x)))
    assert got.dtype == np.float16
    everyone = np.stack([rank_data(r, (5,), np.float16) for r in range(nccl.size)])
    np.testing.assert_allclose(got, everyone.astype(np.float32).sum(0), rtol=2e-3, atol=2e-3)
    y = xp.asarray(x)
    nccl.broadcast(y, root=0)
    np.testing.assert_array_equal(host(y), rank_data(0, (5,), np.float16))


@mpi
def test_host_buffers_stay_on_mpi(nccl):
    before = sum(nccl_double.calls.values())
    out = nccl.allreduce(rank_data(nccl.rank, (3,)))
    assert isinstance(out, np.ndarray) and sum(nccl_double.calls.values()) == before


@mpi
def test_point_to_point_in_both_directions_is_grouped(nccl):
    """Every rank sends to both neighbours and receives from both at once (the pipeline's steady
    state): ungrouped, NCCL's sends would wait for each other; grouped, one group per rank."""
    if nccl.size == 1:
        pytest.skip("needs a peer")
    right, left = (nccl.rank + 1) % nccl.size, (nccl.rank - 1) % nccl.size
    groups = nccl_double.groups
    big = (1 << 14,)  # above any eager limit: a send completes only when its receive runs
    from_left, from_right = xp.empty(big), xp.empty(big)
    handles = [nccl.isend(xp.asarray(rank_data(nccl.rank, big)), right, tag=1),
               nccl.isend(xp.asarray(rank_data(nccl.rank, big) * 2), left, tag=2),
               nccl.irecv(from_left, left, tag=1), nccl.irecv(from_right, right, tag=2)]
    # Looking at a queued call (as the pipeline does after each action) issues nothing.
    assert not any(handle.test(start_queued=False) for handle in handles)
    assert nccl_double.groups == groups
    for handle in reversed(handles):
        handle.wait()
    assert nccl_double.groups - groups == 1
    np.testing.assert_array_equal(host(from_left), rank_data(left, big))
    np.testing.assert_array_equal(host(from_right), rank_data(right, big) * 2)
    assert nccl.stats.calls("send") == 2 and nccl.stats.calls("recv") == 2


@mpi
def test_blocking_send_recv_pairs(nccl):
    if nccl.size == 1:
        pytest.skip("needs a peer")
    if nccl.rank % 2 == 0 and nccl.rank + 1 < nccl.size:
        nccl.send(xp.asarray(rank_data(nccl.rank, (4,))), dest=nccl.rank + 1)
    elif nccl.rank % 2 == 1:
        got = nccl.recv(xp.empty(4), source=nccl.rank - 1)
        np.testing.assert_array_equal(host(got), rank_data(nccl.rank - 1, (4,)))


@mpi
def test_a_buffer_written_on_another_stream_needs_its_event(nccl):
    side = guard.Stream(non_blocking=True)
    x = xp.asarray(rank_data(nccl.rank, (4,)))
    side.wait_event(guard.get_current_stream().record())  # the side stream may read x
    with side:
        y = x * 2  # written on the side stream, which the current stream never waited for
    with pytest.raises(guard.StreamOrderError):
        nccl.allreduce(y)  # raised on every rank before any communication: nobody waits
    event = guard.Event()
    event.record(side)
    guard.get_current_stream().wait_event(event)  # the fix: the producer's event, waited on
    np.testing.assert_allclose(host(nccl.allreduce(y)), sum(rank_data(r, (4,)) * 2 for r in range(nccl.size)),
                               rtol=1e-14)


@mpi
def test_a_planted_missing_producer_event_is_caught(nccl, monkeypatch):
    monkeypatch.setattr(NcclCommunicator, "_after_producer", lambda self: guard.Event())  # never recorded
    x = xp.asarray(rank_data(nccl.rank, (4,))) + 1  # fresh work on the current stream
    with pytest.raises(guard.StreamOrderError):
        nccl.allreduce(x)


@mpi
def test_a_planted_missing_event_before_a_send_is_caught(nccl, monkeypatch):
    """Every rank sends to itself (NCCL allows it in a group), so no rank waits for another."""
    x = xp.asarray(rank_data(nccl.rank, (4,))) + 1
    received = xp.empty(4)
    handles = [nccl.isend(x, nccl.rank), nccl.irecv(received, nccl.rank)]
    for handle in handles:
        handle.wait()
    np.testing.assert_array_equal(host(received), rank_data(nccl.rank, (4,)) + 1)
    monkeypatch.setattr(NcclCommunicator, "_after_producer", lambda self: guard.Event())  # never recorded
    y = x * 2  # fresh work on the current stream that the send's stream is not ordered after
    send = nccl.isend(y, nccl.rank)
    with pytest.raises(guard.StreamOrderError):
        send.wait()


@mpi
def test_a_planted_missing_consumer_wait_is_caught(nccl, monkeypatch):
    monkeypatch.setattr(NcclCommunicator, "_hand_over", lambda self, done: None)
    result = nccl.allreduce(xp.asarray(rank_data(nccl.rank, (4,))))
    with pytest.raises(guard.StreamOrderError):
        result + 1  # written by the communication stream, read on the current one without its event


@mpi
def test_closing_a_context_destroys_its_nccl_communicators(world):
    """Each context (a layout of hpcpar compare) destroys the NCCL communicators it built when it
    closes, after their queued calls went out: 300 rounds leave nothing behind (the double's
    communicators hold an MPI duplicate each, which MPICH runs out of in about 250 rounds)."""
    from hpcpar.runtime.context import init

    destroyed = nccl_double.calls["destroy"]
    for _ in range(300):
        ctx = init(dp=world.Get_size(), device="guard", backend="nccl", runtime=nccl_double.runtime(), shm=False)
        if ctx.world_size > 1:  # a send queued for its group, matched by the neighbour's receive
            right, left = (ctx.rank + 1) % ctx.world_size, (ctx.rank - 1) % ctx.world_size
            sent = ctx.dp.isend(xp.asarray(rank_data(ctx.rank, (4,))), right)
            got = ctx.dp.irecv(xp.empty(4), left)
            assert not sent.test(start_queued=False)
        ctx.close()
        if ctx.world_size > 1:
            np.testing.assert_array_equal(host(got.wait()), rank_data(left, (4,)))
    assert nccl_double.calls["destroy"] - destroyed == 300 * len({id(c) for c in (ctx.dp, ctx.pp, ctx.tp, ctx.cp)})


@mpi
def test_init_builds_nccl_communicators_for_the_axes(world):
    from hpcpar.runtime.context import init

    ctx = init(dp=world.Get_size(), device="guard", backend="nccl", runtime=nccl_double.runtime(), shm=False)
    assert ctx.backend == "nccl"
    assert all(isinstance(c, NcclCommunicator) for c in (ctx.dp, ctx.pp, ctx.tp))
    assert type(ctx.world) is Communicator and type(ctx.node) is Communicator
    assert describe_backend(ctx.dp, ctx.device) == "NCCL (own stream, events)"
    x = xp.asarray(rank_data(ctx.rank, (3,)))
    np.testing.assert_allclose(host(ctx.dp.allreduce(x)), sum(rank_data(r, (3,)) for r in range(ctx.world_size)),
                               rtol=1e-14)


def test_backend_choice():
    assert choose_backend("auto", "cpu", cuda_aware=False, have_nccl=True) == "mpi"
    assert choose_backend("auto", "cuda", cuda_aware=True, have_nccl=True) == "nccl"
    assert choose_backend("auto", "cuda", cuda_aware=True, have_nccl=False) == "mpi"
    assert choose_backend("mpi", "cuda", cuda_aware=False, have_nccl=True) == "mpi"
    assert choose_backend("nccl", "guard", cuda_aware=False, have_nccl=True) == "nccl"
    with pytest.raises(RuntimeError, match="needs train.device"):
        choose_backend("nccl", "cpu", cuda_aware=False, have_nccl=True)
    with pytest.raises(RuntimeError, match="CuPy built with NCCL"):
        choose_backend("nccl", "cuda", cuda_aware=False, have_nccl=False)
    with pytest.raises(ValueError, match="one of"):
        choose_backend("gloo", "cpu", cuda_aware=False)


def test_ranks_sharing_a_gpu_take_mpi_under_auto_and_are_refused_nccl():
    """NCCL refuses two ranks on one GPU (ncclCommInitRank fails): with more ranks on a node than
    GPUs, auto takes MPI and an explicit nccl is one line naming the counts."""
    shared = dict(cuda_aware=True, have_nccl=True, ranks_per_node=4, gpus=2)
    assert choose_backend("auto", "cuda", **shared) == "mpi"
    assert choose_backend("auto", "cuda", **{**shared, "ranks_per_node": 2}) == "nccl"
    with pytest.raises(RuntimeError, match="needs a GPU per rank, but 4 ranks on this node share 2 GPUs; launch at "
                                           "most 2 ranks per node"):
        choose_backend("nccl", "cuda", **shared)
    assert choose_backend("nccl", "guard", **shared) == "nccl"  # the guard's pretend GPUs are not counted


def pair_orders(schedule, p):
    """{(sender rank, receiver rank): (what the sender sends in order, what the receiver receives in order)}."""
    orders = {}
    for rank, actions in enumerate(schedule):
        for a in actions:
            if a.kind in SENDS:
                orders.setdefault((rank, a.peer_stage % p), ([], []))[0].append((SENDS[a.kind], a.microbatch, a.stage))
            elif a.kind in RECVS:
                orders.setdefault((a.peer_stage % p, rank), ([], []))[1].append((RECVS[a.kind], a.microbatch,
                                                                                 a.peer_stage))
    return orders


@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_every_schedule_posts_a_rank_pairs_messages_in_one_order(name):
    """NCCL matches by order, not by tag: between two ranks the receiver must receive in the order
    the sender sends, across all channels (interleaving puts several on one pair)."""
    for p in (2, 3, 4):
        for m in (1, 2, 4, 8):
            chunks = 2 if name == "interleaved" else 1
            if name == "interleaved" and interleaved_fit(p, m) is not None:
                continue
            for (sender, receiver), (sent, received) in pair_orders(make_schedule(name, p, m, chunks), p).items():
                assert sent == received, f"{name} p={p} m={m}: rank {sender} -> {receiver}"


@mpi
def test_info_describes_each_communicators_backend(world):
    from mpi4py import MPI

    staged = Communicator(MPI.COMM_SELF, "dp", cuda_aware=False)
    aware = Communicator(MPI.COMM_SELF, "dp", cuda_aware=True, device_nonblocking=False)
    assert describe_backend(staged, "cpu") == "MPI"
    assert describe_backend(staged, "cuda") == "MPI, device buffers staged through pinned host buffers"
    assert describe_backend(aware, "cuda") == "CUDA-aware MPI (blocking collectives on device buffers)"
