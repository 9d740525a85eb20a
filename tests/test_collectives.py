"""Array collectives equal the NumPy answer on every rank (run at 1, 2 and 4 ranks)."""
import pickle

import numpy as np
import pytest

from hpcpar.runtime import Communicator, wait_all

pytestmark = pytest.mark.mpi(min_size=1)


@pytest.fixture
def comm(world):
    return Communicator(world, "world")


def rank_data(rank, shape=(6, 5), dtype=np.float64):
    """Each rank's input: deterministic, different per rank, known to every rank."""
    return np.random.default_rng(100 + rank).standard_normal(shape).astype(dtype)


def everyone(comm, shape=(6, 5), dtype=np.float64):
    return np.stack([rank_data(r, shape, dtype) for r in range(comm.size)])


@pytest.mark.parametrize("op, reduce", [("sum", np.sum), ("mean", np.mean), ("max", np.max), ("min", np.min)])
def test_allreduce_equals_numpy(comm, op, reduce):
    out = comm.allreduce(rank_data(comm.rank), op)
    np.testing.assert_allclose(out, reduce(everyone(comm), axis=0), rtol=1e-13, atol=1e-13)


def test_allreduce_in_place_and_float32(comm):
    x = rank_data(comm.rank, dtype=np.float32)
    result = comm.allreduce(x, "sum", out=x)
    assert result is x and x.dtype == np.float32
    np.testing.assert_allclose(x, everyone(comm, dtype=np.float32).sum(0), rtol=1e-5)


def test_iallreduce_handles_complete_out_of_order(comm):
    xs = [rank_data(comm.rank, (k + 1, 3)) for k in range(3)]
    handles = [comm.iallreduce(x, "mean") for x in xs]
    results = wait_all(list(reversed(handles)))[::-1]
    for k, result in enumerate(results):
        np.testing.assert_allclose(result, everyone(comm, (k + 1, 3)).mean(0), rtol=1e-13, atol=1e-14)


def test_allreduce_of_non_contiguous_input(comm):
    x = rank_data(comm.rank, (5, 6)).T  # a transposed view
    np.testing.assert_allclose(comm.allreduce(x), everyone(comm, (5, 6)).sum(0).T, rtol=1e-13)


def test_non_contiguous_output_buffer_is_rejected_clearly(comm):
    x = np.zeros((4, 6))[:, ::2]
    with pytest.raises(ValueError, match="C-contiguous"):
        comm.broadcast(x)


def test_reduce_scatter_gives_this_ranks_block(comm):
    x = rank_data(comm.rank, (2 * comm.size, 3))
    out = comm.reduce_scatter(x, "sum")
    full = everyone(comm, (2 * comm.size, 3)).sum(0)
    np.testing.assert_allclose(out, full[2 * comm.rank: 2 * comm.rank + 2], rtol=1e-13, atol=1e-14)


def test_reduce_scatter_rejects_indivisible_rows(comm):
    if comm.size == 1:
        pytest.skip("every row count divides 1")
    with pytest.raises(ValueError, match="not divisible"):
        comm.reduce_scatter(np.ones((comm.size + 1, 2)))


def test_allgather_stacks_all_ranks(comm):
    np.testing.assert_array_equal(comm.allgather(rank_data(comm.rank, (3,))), everyone(comm, (3,)))


def test_broadcast_from_every_root(comm):
    for root in range(comm.size):
        x = rank_data(comm.rank, (4,))
        comm.broadcast(x, root=root)
        np.testing.assert_array_equal(x, rank_data(root, (4,)))


def test_point_to_point_around_a_ring(comm):
    right, left = (comm.rank + 1) % comm.size, (comm.rank - 1) % comm.size
    received = np.empty((3, 2))
    recv = comm.irecv(received, source=left, tag=7)
    send = comm.isend(rank_data(comm.rank, (3, 2)), dest=right, tag=7)
    send.wait()
    np.testing.assert_array_equal(recv.wait(), rank_data(left, (3, 2)))


def test_blocking_send_recv_pairs(comm):
    if comm.size == 1:
        pytest.skip("needs a peer")
    if comm.rank % 2 == 0 and comm.rank + 1 < comm.size:
        comm.send(rank_data(comm.rank, (2,)), dest=comm.rank + 1)
    elif comm.rank % 2 == 1:
        np.testing.assert_array_equal(comm.recv(np.empty(2), source=comm.rank - 1), rank_data(comm.rank - 1, (2,)))


def test_exact_call_and_byte_counts(comm):
    comm.stats.reset()
    a, b = np.ones(10, np.float32), np.ones((comm.size, 4), np.float64)
    comm.allreduce(a)
    comm.allreduce(a, out=a)
    comm.iallreduce(b).wait()
    comm.reduce_scatter(b)
    comm.allgather(a)
    comm.broadcast(a)
    n = comm.size
    # "allreduce" is the family: the two blocking calls and the non-blocking one
    assert comm.stats.calls("allreduce") == 3 and comm.stats.bytes("allreduce") == 2 * 40 + n * 32
    assert comm.stats.calls("iallreduce") == 1 and comm.stats.bytes("iallreduce") == n * 32
    assert comm.stats.bytes("reduce_scatter") == n * 32
    assert comm.stats.bytes("allgather") == 40 and comm.stats.bytes("broadcast") == 40
    assert comm.stats.total_bytes == 2 * 40 + 2 * n * 32 + 80
    assert comm.stats.total_seconds > 0
    # on the wire under ring algorithms: all-reduce 2(n-1)/n, reduce-scatter (n-1)/n of the input,
    # all-gather (n-1) pieces, broadcast (n-1)/n of the buffer on average
    assert comm.stats.wire_bytes("allreduce") == 2 * (2 * (n - 1) * 40 // n) + 2 * (n - 1) * n * 32 // n
    assert comm.stats.wire_bytes("reduce_scatter") == (n - 1) * n * 32 // n
    assert comm.stats.wire_bytes("allgather") == (n - 1) * 40
    assert comm.stats.wire_bytes("broadcast") == (n - 1) * 40 // n
    assert comm.stats.total_wire_bytes == sum(comm.stats.wire_bytes(op) for op in
                                              ("allreduce", "reduce_scatter", "allgather", "broadcast"))
    if n == 1:
        assert comm.stats.total_wire_bytes == 0


def test_point_to_point_wire_bytes_are_the_senders(comm):
    if comm.size == 1:
        pytest.skip("needs a peer")
    comm.stats.reset()
    buf = np.zeros(6)
    if comm.rank == 0:
        comm.send(np.ones(6), dest=1)
        comm.isend(np.ones(6), dest=1).wait()
    elif comm.rank == 1:
        comm.recv(buf, source=0)
        comm.irecv(buf, source=0).wait()
    sent = 2 * 48 if comm.rank == 0 else 0
    received = 2 * 48 if comm.rank == 1 else 0
    assert comm.stats.calls("send") == (2 if comm.rank == 0 else 0) and comm.stats.wire_bytes("send") == sent
    assert comm.stats.bytes("recv") == received and comm.stats.wire_bytes("recv") == 0


def test_unknown_op_names_raise_with_the_known_names(comm):
    with pytest.raises(ValueError, match=r"unknown communication op 'alreduce'; known: .*allreduce"):
        comm.stats.calls("alreduce")
    with pytest.raises(ValueError, match="'sned'"):
        comm.stats.bytes("sned")
    assert comm.stats.calls("gather_object") >= 0  # known, even when never called


def test_object_calls_have_their_own_names(comm):
    comm.stats.reset()
    assert comm.allgather_object({"rank": comm.rank}) == [{"rank": r} for r in range(comm.size)]
    assert comm.bcast_object("hello" if comm.rank == 0 else None) == "hello"
    assert comm.allreduce_object(comm.rank) == sum(range(comm.size))
    assert set(comm.stats.ops) == {"allgather_object", "bcast_object", "allreduce_object"}
    n, hello = comm.size, len(pickle.dumps("hello"))
    assert comm.stats.wire_bytes("bcast_object") == (n - 1) * hello // n  # the root's object, on every rank


def test_unknown_reduce_op_is_named(comm):
    with pytest.raises(ValueError, match="'median'"):
        comm.allreduce(np.ones(2), "median")


def test_bfloat16_moves_as_words_and_reduces_in_float32(comm):
    ml_dtypes = pytest.importorskip("ml_dtypes")
    x = rank_data(comm.rank, (4, 3)).astype(ml_dtypes.bfloat16)
    expected = everyone(comm, (4, 3)).astype(ml_dtypes.bfloat16).astype(np.float32).sum(0).astype(ml_dtypes.bfloat16)
    assert comm.allreduce(x).dtype == ml_dtypes.bfloat16
    np.testing.assert_array_equal(comm.allreduce(x, out=x.copy()), expected)
    np.testing.assert_array_equal(comm.iallreduce(x).wait(), expected)
    np.testing.assert_array_equal(comm.allreduce(x), expected)
    np.testing.assert_array_equal(x, rank_data(comm.rank, (4, 3)).astype(x.dtype))  # without out, x stays
    inplace = x.copy()
    assert comm.iallreduce(inplace, out=inplace).wait() is inplace  # a DDP bucket's call
    np.testing.assert_array_equal(inplace, expected)
    np.testing.assert_array_equal(comm.allgather(x)[comm.size - 1], rank_data(comm.size - 1, (4, 3)).astype(x.dtype))
    y = x.copy()
    comm.broadcast(y, root=0)
    np.testing.assert_array_equal(y, rank_data(0, (4, 3)).astype(x.dtype))
