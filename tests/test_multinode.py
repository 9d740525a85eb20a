"""MPI tests that need ranks on at least two nodes, two ranks on each (2 nodes x 2 ranks).

tests/test_cluster.py runs them on the test cluster of tests/cluster/bring_up.sh (network
namespaces on this machine); they run as well on a real allocation, e.g.
``srun --nodes=2 --ntasks-per-node=2 python -m pytest --with-mpi -m mpi tests/test_multinode.py``.
Under the single-node MPI runs of ``make test`` they skip: there is one node.
"""
import numpy as np
import pytest
from mpi4py import MPI

import hpcpar
from hpcpar.runtime.topology import crossing_axes

import test_3d
from hpcpar.parallel.hybrid import default_shard_size, dp_ranks_per_node
from test_zero_params import train_hybrid

pytestmark = pytest.mark.mpi(min_size=4)


@pytest.fixture(scope="module")
def ctx():
    """dp 1 x pp 2 x tp 2: with two ranks per node, tp inside nodes and pp across them."""
    world = MPI.COMM_WORLD
    node = world.Split_type(MPI.COMM_TYPE_SHARED)
    node_sizes = world.allgather(node.Get_size())
    node.Free()
    if world.Get_size() != 4 or len(set(world.allgather(MPI.Get_processor_name()))) != 2 or set(node_sizes) != {2}:
        pytest.skip("needs 4 ranks on 2 nodes, 2 on each (tests/test_cluster.py starts them)")
    return hpcpar.init(dp=1, pp=2, tp=2, device="cpu")


def test_topology_finds_the_nodes_and_what_crosses_them(ctx):
    topo = ctx.topology
    assert topo.nodes == 2 and topo.node_of == (0, 0, 1, 1)
    assert ctx.node.size == 2 and ctx.node_rank == ctx.rank % 2
    assert ctx.crossing_axes == ["pp"]  # tp inside a node, pp across
    assert crossing_axes(topo, dp=2, pp=1, tp=2) == ["dp"]
    assert crossing_axes(topo, dp=1, pp=1, tp=4) == ["tp"]


def network_bytes():
    """Bytes received and sent so far by this node's network interfaces (all but loopback).

    /proc/net/dev lists the devices of the reading process's network namespace: on the test
    cluster, this node's link to the switch; on a real node, its NICs."""
    rx = tx = 0
    with open("/proc/net/dev") as f:
        for line in f.readlines()[2:]:
            name, fields = line.split(":", 1)
            if name.strip() != "lo":
                values = fields.split()
                rx, tx = rx + int(values[0]), tx + int(values[8])
    return rx, tx


def transfer_and_count(world, source, dest, nbytes):
    """Send nbytes from world rank source to dest; every rank returns its node's (rx, tx) meanwhile."""
    buf = np.full(nbytes // 8, float(source + 1))
    world.Barrier()
    before = network_bytes()
    world.Barrier()
    if world.Get_rank() == source:
        world.Send(buf, dest=dest)
    elif world.Get_rank() == dest:
        world.Recv(buf, source=source)
        assert np.all(buf == source + 1)
    world.Barrier()
    after = network_bytes()
    return after[0] - before[0], after[1] - before[1]


def test_messages_between_nodes_go_over_the_network_and_inside_a_node_they_do_not(ctx):
    """What makes the test cluster a cluster: MPI uses the link between nodes (it could have used
    memory, as the nodes share one kernel) and shared memory inside a node."""
    world, size = ctx.world.mpi, 32 << 20
    rx, tx = transfer_and_count(world, source=0, dest=2, nbytes=size)  # node 0 -> node 1
    if ctx.rank == 0:
        assert tx >= size, f"32 MiB sent to the other node, but the network sent only {tx} bytes"
    if ctx.rank == 2:
        assert rx >= size, f"32 MiB came from the other node, but the network received only {rx} bytes"
    rx, tx = transfer_and_count(world, source=0, dest=1, nbytes=size)  # inside node 0
    if ctx.rank in (0, 1):
        assert rx + tx < size // 8, f"32 MiB passed inside a node, yet the network moved {rx + tx} bytes"


def test_collectives_across_nodes_equal_numpy(ctx):
    """Every communicator kind: world and pp across nodes, tp and node inside one."""
    world = ctx.world
    x = np.arange(1000, dtype=np.float64) * (world.rank + 1)
    total = np.arange(1000, dtype=np.float64) * sum(range(1, world.size + 1))
    np.testing.assert_array_equal(world.allreduce(x), total)
    for comm in (ctx.pp, ctx.tp, ctx.node):
        members = comm.allgather_object(world.rank)
        expected = np.arange(1000, dtype=np.float64) * sum(r + 1 for r in members)
        np.testing.assert_array_equal(comm.allreduce(x), expected)
        np.testing.assert_array_equal(comm.allgather(np.array([world.rank])).ravel(), members)
        np.testing.assert_array_equal(comm.broadcast(x.copy(), root=comm.size - 1), x / (world.rank + 1) * (members[-1] + 1))


def test_3d_with_tp_inside_and_pp_across_nodes_equals_one_process(ctx, capsys):
    """The 3D equality of tests/test_3d.py on real nodes: K AdamW steps with clipping, float64."""
    params, ref_losses = test_3d.reference()
    for sequence_parallel in (False, True):
        pipe, losses = test_3d.train(ctx, built=test_3d.build(ctx, sequence_parallel=sequence_parallel))
        label = f"1x2x2 on 2 nodes{' sequence-parallel' if sequence_parallel else ''}"
        test_3d.assert_matches(pipe, losses, params, ref_losses, label)
        diff = max(float(np.max(np.abs(p.data - params[n].data[test_3d.slab_slices(test_3d.global_slab(p)[1])])))
                   for n, p in pipe.named_parameters())
        diff = ctx.world.mpi.allreduce(diff, op=MPI.MAX)
        if ctx.rank == 0:
            with capsys.disabled():
                print(f"\n{label}: max |parameter - one process| = {diff:.2e} after {test_3d.STEPS} steps", flush=True)


def test_hierarchical_allreduce_across_nodes_equals_the_flat_one(ctx):
    """The shared-memory all-reduce on real nodes: each node reduces in its own memory, the
    nodes' ranks all-reduce their slices over the network, the node reads back; equal to MPI's
    flat all-reduce (integer-valued float64: exact in any order)."""
    from hpcpar.runtime.shm import shared_zeros

    comm = ctx.world
    assert comm.shm is not None
    rng = np.random.default_rng(comm.rank)
    for count in (1 << 14, 100_003, 1 << 21):
        x = rng.integers(-1000, 1000, count).astype(np.float64)
        flat = x.copy()
        comm.mpi.Allreduce(MPI.IN_PLACE, flat, op=MPI.SUM)
        shared = shared_zeros(comm, count, np.float64)
        shared[...] = x
        assert comm.allreduce(shared, "sum", out=shared) is shared
        np.testing.assert_array_equal(shared, flat)
        np.testing.assert_array_equal(comm.allreduce(x, "sum"), flat)  # a plain array: copied through the window
    assert comm.shm.describe() == "on: 2 node(s) x 2 ranks"  # set up on first use: hierarchical
    assert comm.shm.stats.calls("allreduce") >= 3  # the shared-memory path, not MPI's


def test_hybrid_sharding_shards_inside_nodes_and_equals_one_process(ctx, capsys):
    """ZeRO-3 at dp 4 on 2 nodes: by default it shards over each node's 2 ranks and averages the
    shard gradients across the nodes (HSDP 2 x 2), equal to one process in float64."""
    dp = hpcpar.init(dp=4, device="cpu")
    size = default_shard_size(dp.dp_size, dp_ranks_per_node(dp))
    assert size == 2
    diff = dp.world.mpi.allreduce(train_hybrid(dp, size), op=MPI.MAX)
    if dp.rank == 0:
        with capsys.disabled():
            print(f"\nHSDP 2 x 2 on 2 nodes: max |parameter - one process| = {diff:.2e} after 3 steps", flush=True)
    assert diff <= 1e-12
