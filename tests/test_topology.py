"""The placement report: which communicators cross nodes, for given placements of ranks on nodes.
(On real nodes: tests/test_multinode.py and tests/test_cluster.py.)"""
import pytest
from mpi4py import MPI

from hpcpar.runtime import topology
from hpcpar.runtime.topology import PlacementWarning, Topology, crossing_axes, groups, report

BLOCK = Topology(node_of=(0, 0, 1, 1), hosts=("node1", "node2"))        # mpiexec -ppn 2
ROUND_ROBIN = Topology(node_of=(0, 1, 0, 1), hosts=("node1", "node2"))  # mpiexec -ppn 1


def test_groups_are_those_of_the_context_docstring():
    assert groups("tp", 2, 2, 2) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert groups("dp", 2, 2, 2) == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert groups("pp", 2, 2, 2) == [[0, 4], [1, 5], [2, 6], [3, 7]]
    with pytest.raises(ValueError, match="axis must be one of"):
        groups("world", 2, 2, 2)


@pytest.mark.parametrize("topo, layout, crossing", [
    (BLOCK, (1, 2, 2), ["pp"]), (BLOCK, (2, 1, 2), ["dp"]), (BLOCK, (4, 1, 1), ["dp"]), (BLOCK, (1, 1, 4), ["tp"]),
    (BLOCK, (2, 2, 1), ["pp"]), (ROUND_ROBIN, (1, 2, 2), ["tp"]), (ROUND_ROBIN, (2, 2, 1), ["dp"]),
    (Topology(node_of=(0, 0, 0, 0), hosts=("vm",)), (2, 1, 2), []),
])
def test_crossing_axes(topo, layout, crossing):
    dp, pp, tp = layout
    assert crossing_axes(topo, dp, pp, tp) == crossing


def test_report_splits_every_communicator_into_peers_inside_and_across():
    text = report(BLOCK, 1, 2, 2)
    assert text.splitlines()[0] == "2 nodes: node1 (ranks 0-1), node2 (ranks 2-3)"
    rows = {line.split()[0]: line.split()[1:] for line in text.splitlines()[3:7]}
    assert rows["tp"] == ["2", "2", "1", "0", "of", "2", "1", "/", "0"]
    assert rows["pp"] == ["2", "2", "2", "2", "of", "2", "0", "/", "1"]
    assert rows["world"] == ["1", "4", "2", "1", "of", "1", "1", "/", "2"]
    assert text.splitlines()[-1] == "across nodes: pp (tp inside nodes)"


def test_tensor_parallelism_across_nodes_is_warned_about_only_when_it_could_stay_inside():
    text = report(ROUND_ROBIN, 1, 2, 2)
    assert "2 nodes: node1 (ranks 0,2), node2 (ranks 1,3)" in text
    assert "warning: tensor parallelism crosses nodes although tp=2 divides the ranks of every node (2/2)" in text
    with pytest.warns(PlacementWarning, match="mpiexec -ppn N, srun --distribution=block"):
        topology.warn_about_placement(ROUND_ROBIN, 1, 2, 2)
    assert "warning" not in report(BLOCK, 1, 1, 4)  # tp=4 cannot fit in nodes of 2 ranks
    assert "warning" not in report(BLOCK, 1, 2, 2)  # tp stays inside


def test_one_node_is_one_line():
    assert report(Topology(node_of=(0, 0), hosts=("vm",)), 2, 1, 1) == \
        "1 node: vm (ranks 0-1); every communicator stays inside it"


def test_discover_on_one_process():
    topo = topology.discover(MPI.COMM_SELF, MPI.COMM_SELF)
    assert topo == Topology(node_of=(0,), hosts=(MPI.Get_processor_name(),))
