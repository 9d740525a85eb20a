#!/usr/bin/env bash
# Start SLURM on the test cluster; tests/cluster/bring_up.sh runs this (under its lock) for --slurm:
# munged and slurmctld on node1, one slurmd on every node, then wait until all nodes are usable.
#
#   sudo tests/cluster/bring_up.sh --slurm
#   tests/cluster/on node1 sbatch --nodes=2 --ntasks-per-node=2 slurm/train.sbatch jobs/gpt-3d.toml
#
# Inside the nodes /etc/slurm is the cluster's own (a bind mount of /run/hpcpar-cluster/slurm/etc
# in each node's mount namespace), so sbatch, srun and scontrol run on a node need no SLURM_CONF;
# on this machine itself /etc/slurm stays the one-node test SLURM's (tests/slurm/bring_up.sh).
# Everything else is the cluster's own as well: ports (each node has its network namespace),
# state, logs and munged (its socket in /run/hpcpar-cluster/munge), so the one-node SLURM can run
# at the same time. tear_down.sh stops all of it with the nodes.
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
. "$HERE/common.sh"
. "$HERE/../slurm/lib.sh"

CPUS=${HPCPAR_SLURM_CPUS:-8}
WAIT_S=${HPCPAR_SLURM_WAIT_S:-60}
SLURM_DIR=$STATE/slurm
LOG_DIR=$SLURM_DIR/log
MUNGE_DIR=$STATE/munge
MUNGE_SOCKET=$MUNGE_DIR/munge.socket

[ "$(id -u)" = 0 ] || die "needs root"
cluster_is_up || die "the test cluster is not up; run tests/cluster/bring_up.sh --slurm"

on_node() { "$HERE/on" "$@"; }
CTLD_NODE=node1
CTLD_PIDFILE=$SLURM_DIR/slurmctld.pid
slurmd_pidfile() { echo "$SLURM_DIR/slurmd-$1.pid"; }

config() {
    local node i=0
    slurm_conf "tests/cluster/slurm_up.sh: the test cluster's nodes," hpcpar-nodes "node1($PREFIX.1)" \
        "cred_expire=10,socket=$MUNGE_SOCKET" "$SLURM_DIR/ctld" "$SLURM_DIR/spool-%n" "$CTLD_PIDFILE" \
        "$SLURM_DIR/slurmd-%n.pid" "$LOG_DIR/slurmctld.log" "$LOG_DIR/slurmd-%n.log"
    for node in $(node_names); do
        i=$((i + 1))
        echo "NodeName=$node NodeAddr=$PREFIX.$i CPUs=$CPUS State=UNKNOWN"
    done
    echo "PartitionName=debug Nodes=$(node_names | paste -sd,) Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE"
}

slurm_install_packages
munge_key

# munged on node1 for the whole cluster: its socket is on the shared file system.
if ! munge_ok --socket="$MUNGE_SOCKET"; then
    mkdir -p "$MUNGE_DIR"
    chown munge:munge "$MUNGE_DIR" 2>/dev/null || true
    chmod 755 "$MUNGE_DIR"   # munged: clients must reach the socket, only munge may write here
    start_munged node1 "$MUNGE_SOCKET" --socket="$MUNGE_SOCKET" --pid-file="$MUNGE_DIR/munged.pid" \
        --log-file="$MUNGE_DIR/munged.log" --seed-file="$MUNGE_DIR/munged.seed"
fi

mkdir -p "$SLURM_DIR/etc" "$SLURM_DIR/ctld" "$LOG_DIR" /etc/slurm $(node_names | sed "s|^|$SLURM_DIR/spool-|")
if ! cmp -s "$SLURM_DIR/etc/slurm.conf" <(config); then
    config >"$SLURM_DIR/etc/slurm.conf.new" && mv "$SLURM_DIR/etc/slurm.conf.new" "$SLURM_DIR/etc/slurm.conf"
    for node in $(node_names); do slurm_stop "$(slurmd_pidfile "$node")"; done
    slurm_stop "$CTLD_PIDFILE"
fi
for node in $(node_names); do
    # The node's /etc/slurm: its mount namespace is held by its process, so this bind stays.
    on_node "$node" sh -c 'mountpoint -q /etc/slurm || mount --bind "$1" /etc/slurm' sh "$SLURM_DIR/etc"
done

slurm_start_daemons $(node_names)
slurm_wait_usable "$WAIT_S" $(node_names)
log "SLURM is up on the test cluster: $(on_node node1 sinfo -h -o '%D nodes %T, partition %P' | paste -sd ' ')"
