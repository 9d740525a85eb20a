#!/usr/bin/env bash
# Bring up a small cluster of "nodes" on this one machine, for the multi-node tests
# (tests/test_cluster.py) and for trying multi-node runs by hand (README.md, "Several nodes").
#
#   sudo tests/cluster/bring_up.sh [--nodes N] [--rate RATE] [--delay TIME] [--slurm]
#   tests/cluster/on node1 COMMAND...    # run COMMAND on node1 (as root)
#   sudo tests/cluster/tear_down.sh      # remove all of it
#
# A node is a network, UTS, System V IPC and mount namespace held by one idle process: its own
# host name (node1, node2, ...), its own loopback, one Ethernet link (veth) to a switch, its own
# /dev/shm and IPC (so MPI ranks on different nodes cannot meet in shared memory: they must use
# the network), its own /etc/hosts that names the nodes and a /sys that shows its own devices. The switch is a bridge inside a namespace of its own,
# so the cluster's subnet (10.77.0.0/24, node i at 10.77.0.i) exists only inside these
# namespaces: nothing is added to this machine's own network, and no packet can leave.
# Files (the repository, the venv, /tmp) are shared, as on a cluster with a shared file system.
#
# --rate RATE (tc syntax: 10gbit, 800mbit) limits each node's outgoing link with a token bucket,
# so "inter-node" is measurably slower than shared memory; --delay TIME (20us) adds one-way
# latency with netem where the kernel has it (this script says so and exits when it does not).
# Without them the links run as fast as the kernel moves packets between namespaces.
# --slurm also starts SLURM: slurmctld on node1 and one slurmd per node (tests/cluster/slurm_up.sh).
#
# Idempotent: run again with the same nodes and it only re-applies the shaping (and starts
# whatever SLURM daemon is missing); with a different node count it rebuilds the cluster.
# Any failure exits non-zero with the reason on stderr (the test fixture shows it as the skip or,
# under CI=true, failure message).
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
. "$HERE/common.sh"

NODES=2 RATE="" DELAY="" SLURM=0
while [ $# -gt 0 ]; do
    case "$1" in
    --nodes) NODES=${2:?--nodes needs a number}; shift 2 ;;
    --rate) RATE=${2:?--rate needs a rate such as 10gbit}; shift 2 ;;
    --delay) DELAY=${2:?--delay needs a time such as 20us}; shift 2 ;;
    --slurm) SLURM=1; shift ;;
    -h | --help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) die "unknown argument '$1' (see --help)" ;;
    esac
done
case "$NODES" in '' | *[!0-9]*) die "--nodes must be a whole number from 1 to 200, got '$NODES'" ;; esac
[ "$NODES" -ge 1 ] && [ "$NODES" -le 200 ] || die "--nodes must be from 1 to 200, got $NODES"
[ -z "$RATE" ] || rate_bits "$RATE" >/dev/null || die "--rate '$RATE' is not a rate such as 10gbit, 800mbit or 1000000bit"
[ -z "$DELAY" ] || [[ "$DELAY" =~ ^[0-9]+(\.[0-9]+)?(us|ms|s)$ ]] || die "--delay '$DELAY' is not a time such as 20us or 1ms"
[ "$(id -u)" = 0 ] || die "needs root (it creates network namespaces); run it with sudo"
for tool in ip tc unshare nsenter mount; do
    command -v $tool >/dev/null || die "'$tool' is missing (Debian: apt-get install iproute2 util-linux)"
done

exec 8>"$LOCK"
flock -w 300 8 || die "another bring_up.sh or tear_down.sh has held $LOCK for 300 s"

if cluster_is_up && [ "$(cat "$STATE/nodes")" = "$NODES" ]; then
    :
else
    cluster_is_down || { log "rebuilding: the cluster up now is not the one asked for ($NODES nodes)"; remove_cluster; }
    trap remove_cluster EXIT  # whatever stops the making (die, set -e) removes the half-made cluster
    make_cluster "$NODES"
    trap - EXIT
fi
shape_links "$RATE" "$DELAY"
[ "$SLURM" = 0 ] || "$HERE/slurm_up.sh"
log "up: $(node_names | paste -sd ' ') on $PREFIX.0/24${RATE:+, links limited to $RATE}${DELAY:+, $DELAY one-way delay}"
