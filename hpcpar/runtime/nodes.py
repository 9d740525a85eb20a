"""Which ranks share a node's memory: real nodes, or pretend ones for testing.

A node is the set of ranks ``MPI_Comm_split_type(MPI_COMM_TYPE_SHARED)`` puts together.
``HPCPAR_NODE_SIZE=k`` (or ``init(node_size=k)``, job key ``parallel.node_size``) cuts each
real node into pretend nodes of ``k`` consecutive ranks, so that code which treats ranks on
one node differently from ranks on others (the shared-memory all-reduce, hpcpar.runtime.shm)
runs its inter-node step on a single machine: with 4 ranks and k = 2, ranks {0, 1} and
{2, 3} act as two nodes. Only that code sees pretend nodes; BLAS threads, the wait policy
and GPU selection go by the real node.
"""
from __future__ import annotations

import os

from mpi4py import MPI

NODE_SIZE_VARIABLE = "HPCPAR_NODE_SIZE"


def node_size_setting(node_size: int | None = None) -> int | None:
    """The pretend node size: ``node_size`` if given, else HPCPAR_NODE_SIZE, else None (real nodes)."""
    if node_size is None:
        text = os.environ.get(NODE_SIZE_VARIABLE, "")
        if text == "":
            return None
        try:
            node_size = int(text)
        except ValueError:
            raise ValueError(f"{NODE_SIZE_VARIABLE} must be a positive integer, got {text!r}") from None
    if isinstance(node_size, bool) or not isinstance(node_size, int) or node_size < 1:
        raise ValueError(f"node size must be a positive integer, got {node_size!r}")
    return node_size


def node_color(comm: MPI.Comm, node: MPI.Comm, node_size: int | None) -> int:
    """A number equal on the ranks of one (pretend) node and different across nodes.

    ``node`` is ``comm`` split by shared memory with key = rank in ``comm`` (so node ranks
    follow ``comm``'s order). Collective over ``node``. The number is the rank in ``comm``
    of the node's first rank, so it serves as a ``Split`` color on any sub-communicator.
    """
    members = node.allgather(comm.Get_rank())
    first = 0 if node_size is None else (node.Get_rank() // node_size) * node_size
    return members[first]
