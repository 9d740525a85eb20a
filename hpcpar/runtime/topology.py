"""Where the ranks run: the nodes, each rank's node-local rank, and which communicators cross nodes.

A node is what MPI calls a shared-memory domain (``MPI_COMM_TYPE_SHARED``): ranks on one node
can talk through memory, ranks on different nodes only through the network, which is slower
by an order of magnitude or more. Placement therefore matters: tensor parallelism talks inside
every layer and belongs inside a node; pipeline stages exchange one activation per micro-batch
and data-parallel replicas one gradient all-reduce per step, so they are the axes that may
cross nodes (the rule of Megatron-LM and of the published 3D-parallelism studies).

Nodes are numbered in the order of their lowest world rank. Everything here except
``discover`` is arithmetic on the gathered placement, so every rank reaches the same report.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass

from mpi4py import MPI

from .grid import Mesh, mesh_of


class PlacementWarning(UserWarning):
    """Tensor parallelism crosses nodes although its groups would fit inside one."""


@dataclass(frozen=True)
class Topology:
    node_of: tuple[int, ...]  # node index of every world rank
    hosts: tuple[str, ...]  # host name of every node, by node index

    @property
    def nodes(self) -> int:
        return len(self.hosts)

    def ranks_on(self, node: int) -> list[int]:
        return [r for r, n in enumerate(self.node_of) if n == node]

    def node_sizes(self) -> list[int]:
        return [len(self.ranks_on(n)) for n in range(self.nodes)]

    def span(self, ranks) -> int:
        """How many nodes the given world ranks sit on."""
        return len({self.node_of[r] for r in ranks})

    def peers(self, rank: int, group) -> tuple[int, int]:
        """(peers on ``rank``'s node, peers on other nodes) among the world ranks of ``group``."""
        inside = sum(1 for r in group if r != rank and self.node_of[r] == self.node_of[rank])
        return inside, len(group) - 1 - inside


def discover(world: MPI.Comm, node: MPI.Comm) -> Topology:
    """The placement of every rank of ``world``; ``node`` is world split by COMM_TYPE_SHARED (collective)."""
    leader = node.bcast(world.Get_rank(), root=0)  # the node's lowest world rank names it
    placement = world.allgather((leader, MPI.Get_processor_name()))
    leaders = sorted({lead for lead, _ in placement})
    index = {lead: i for i, lead in enumerate(leaders)}
    return Topology(node_of=tuple(index[lead] for lead, _ in placement),
                    hosts=tuple(placement[lead][1] for lead in leaders))


# The layout arguments below (``*layout``) are a Mesh, or the grid's sizes (dp, pp, tp) in order or by name.

def fastest_first(mesh: Mesh) -> list[str]:
    """The axes that can vary and are spelt (cp only above 1; the others have one rank per
    communicator), fastest first."""
    return [name for name in reversed(mesh.table.spelt_order) if mesh.shown(name)]


def groups(axis: str, *layout, **sizes) -> list[list[int]]:
    """The world ranks of every communicator along ``axis`` of the grid."""
    return mesh_of(*layout, **sizes).groups(axis)


def crossing_axes(topo: Topology, *layout, **sizes) -> list[str]:
    """The grid axes (fastest first) some of whose communicators span more than one node."""
    mesh = mesh_of(*layout, **sizes)
    return [axis for axis in fastest_first(mesh) if any(topo.span(g) > 1 for g in mesh.groups(axis))]


def _range(values) -> str:
    lo, hi = min(values), max(values)
    return str(lo) if lo == hi else f"{lo}-{hi}"


def placement_table(topo: Topology, mesh: Mesh) -> str:
    """Per communicator: its groups, how many cross nodes, and each member's peers inside / across nodes."""
    rows = [("communicator", "groups", "size", "nodes spanned", "groups across nodes", "peers inside / across")]
    for axis in fastest_first(mesh) + ["world"]:
        members = mesh.groups(axis) if axis != "world" else [list(range(mesh.world_size))]
        spans = [topo.span(g) for g in members]
        split = [topo.peers(r, g) for g in members for r in g]
        rows.append((axis, str(len(members)), str(len(members[0])), _range(spans),
                     f"{sum(s > 1 for s in spans)} of {len(members)}",
                     f"{_range([i for i, _ in split])} / {_range([a for _, a in split])}"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.rjust(w) if i else cell.ljust(w) for i, (cell, w) in enumerate(zip(row, widths)))
             for row in rows]
    return "\n".join(lines[:1] + ["  ".join("-" * w for w in widths)] + lines[1:])


def nodes_line(topo: Topology) -> str:
    parts = []
    for n, host in enumerate(topo.hosts):
        ranks = topo.ranks_on(n)
        contiguous = ranks == list(range(ranks[0], ranks[-1] + 1))
        shown = f"{ranks[0]}-{ranks[-1]}" if contiguous and len(ranks) > 1 else ",".join(map(str, ranks))
        parts.append(f"{host} (ranks {shown})")
    return f"{topo.nodes} node{'s' if topo.nodes > 1 else ''}: " + ", ".join(parts)


def tensor_placement_advice(topo: Topology, mesh: Mesh) -> str | None:
    """Why tensor parallelism crossing nodes could be avoided, or None when it does not cross or must."""
    tp = mesh.size("tp")
    if "tp" not in crossing_axes(topo, mesh) or any(size % tp for size in topo.node_sizes()):
        return None
    return (f"tensor parallelism crosses nodes although tp={tp} divides the ranks of every node "
            f"({'/'.join(map(str, topo.node_sizes()))}): start consecutive ranks on the same node "
            "(mpiexec -ppn N, srun --distribution=block) so each tp group stays inside one; "
            "tensor inside a node, pipeline and data across")


def report(topo: Topology, *layout, **sizes) -> str:
    """The layout report: the nodes, each communicator's placement, and what crosses nodes.
    On one node, one line."""
    if topo.nodes == 1:
        return nodes_line(topo) + "; every communicator stays inside it"
    mesh = mesh_of(*layout, **sizes)
    crossing = crossing_axes(topo, mesh)
    inside = " (tp inside nodes)" if mesh.size("tp") > 1 and "tp" not in crossing else ""
    lines = [nodes_line(topo), placement_table(topo, mesh), "across nodes: " + ", ".join(crossing) + inside]
    advice = tensor_placement_advice(topo, mesh)
    if advice:
        lines.append("warning: " + advice)
    return "\n".join(lines)


def warn_about_placement(topo: Topology, *layout, **sizes) -> None:
    advice = tensor_placement_advice(topo, mesh_of(*layout, **sizes))
    if advice:
        warnings.warn(advice, PlacementWarning, stacklevel=3)
