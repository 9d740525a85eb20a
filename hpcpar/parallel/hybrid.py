"""Hybrid sharding (HSDP): ZeRO within groups of ``shard_size`` consecutive dp ranks, replicas across them.

    shards, replicas = shard_groups(ctx, shard_size)   # replicas: None when shard_size is all of dp
    average_over(replicas, shard_gradient)            # after each step's reduce-scatter over shards

ZeRO's collectives (reduce-scatter, all-gather) run over ``shards``; the shard gradient, the dp
mean over the group, is then averaged over ``replicas`` (the ranks at the same place of every
group), which makes it the mean over all of dp. Each group holds the whole optimizer state, as
PyTorch's HSDP and DeepSpeed's hpZ: with a node's ranks as a group, the gathers stay on the
node's links and only a shard's gradient crosses nodes. The default (``default_shard_size``):
all of dp on one node, a node's dp ranks when dp spans nodes.
"""
from __future__ import annotations

from mpi4py import MPI


def default_shard_size(dp_size: int, dp_ranks_per_node: int) -> int:
    """A node's dp ranks when dp spans nodes and they divide it, else all of dp."""
    if dp_ranks_per_node < 1 or dp_ranks_per_node >= dp_size or dp_size % dp_ranks_per_node:
        return dp_size
    return dp_ranks_per_node


def dp_ranks_per_node(ctx) -> int:
    """The fewest ranks of this dp (x cp) group on one node (collective over it)."""
    local = ctx.dp_cp.mpi.Split_type(MPI.COMM_TYPE_SHARED)
    try:
        return ctx.dp_cp.mpi.allreduce(local.Get_size(), op=MPI.MIN)
    finally:
        local.Free()


def shard_groups(ctx, shard_size: int):
    """(the communicator ZeRO shards over, the one its shard gradients are averaged over or None);
    collective over dp (x cp: ``ctx.dp_cp``). The context owns (and closes) what it makes."""
    dp = ctx.dp_cp
    if shard_size == dp.size:
        return dp, None
    shards = ctx.adopt(dp.split(dp.rank // shard_size, dp.rank, "dp-shard"))
    replicas = ctx.adopt(dp.split(dp.rank % shard_size, dp.rank, "dp-replica"))
    return shards, replicas


def average_over(replicas, shard_gradient) -> None:
    """The shard gradient, in place, averaged over the replica groups (nothing without them)."""
    if replicas is not None and replicas.size > 1:
        replicas.allreduce(shard_gradient, "mean", out=shard_gradient)
