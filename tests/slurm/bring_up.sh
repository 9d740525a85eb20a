#!/usr/bin/env bash
# Bring up a one-node SLURM cluster on this machine, for the SLURM tests (tests/test_slurm.py).
#
#   sudo tests/slurm/bring_up.sh      # exit 0: sbatch/srun/squeue work and the node is usable
#   sudo tests/slurm/tear_down.sh     # stop the daemons again
#
# Idempotent, and cheap when SLURM is already up (well under a second: nothing is installed, written or
# restarted). On a fresh Debian/Ubuntu machine it installs slurm-wlm and munge with apt-get, writes
# /etc/slurm/slurm.conf, starts munged, slurmctld and slurmd as daemons (no systemd needed) and
# waits until sinfo shows the node usable. Any failure exits non-zero with the reason on stderr,
# which the test fixture shows as its skip (or, under CI=true, failure) message.
#
# The configuration (the settings of tests/slurm/lib.sh) is a test cluster, not a template for a
# real one: no cgroups, the node claims CPUS (default 8) CPUs whatever the hardware has and its
# partition oversubscribes, so 4-8 MPI ranks and several jobs fit on a 2-core machine; controller
# and node talk over 127.0.0.1, so the host name need not resolve.
#
# The two-node test cluster (tests/cluster/bring_up.sh --slurm) runs its own daemons inside its
# own network namespaces, with its own configuration, state and munged: the two never meet.
set -euo pipefail

CPUS=${HPCPAR_SLURM_CPUS:-8}
CONF_DIR=/etc/slurm
CONF=$CONF_DIR/slurm.conf
LOG_DIR=/var/log/slurm
MUNGE_SOCKET_DIR=/run/munge
WAIT_S=${HPCPAR_SLURM_WAIT_S:-60}

die() { echo "bring_up.sh: $*" >&2; exit 1; }
log() { echo "bring_up.sh: $*" >&2; }
. "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

[ "$(id -u)" = 0 ] || die "needs root (it installs slurm-wlm and munge and starts daemons); run it with sudo"

NODE=$(hostname -s)
[ -n "$NODE" ] || die "hostname -s printed nothing; the node needs a name"

# One bring-up at a time (two test sessions starting together must not race on daemons).
exec 9>/run/hpcpar-slurm.lock
flock -w 300 9 || die "another bring_up.sh has held /run/hpcpar-slurm.lock for 300 s"

config() {
    slurm_conf "tests/slurm/bring_up.sh: a one-node test cluster" hpcpar "$NODE(127.0.0.1)" cred_expire=10 \
        /var/spool/slurmctld /var/spool/slurmd /run/slurmctld.pid /run/slurmd.pid \
        "$LOG_DIR/slurmctld.log" "$LOG_DIR/slurmd.log"
    echo "NodeName=$NODE NodeAddr=127.0.0.1 CPUs=$CPUS State=UNKNOWN"
    echo "PartitionName=debug Nodes=$NODE Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE"
}

# What tests/slurm/lib.sh needs to know: one node, this machine.
on_node() { shift; "$@"; }
CTLD_NODE=$NODE
CTLD_PIDFILE=/run/slurmctld.pid
slurmd_pidfile() { echo /run/slurmd.pid; }
node_state() { sinfo -h -N -n "$NODE" -o %T 2>/dev/null | head -n1; }

# Fast path: installed, same configuration, all three daemons alive, node usable.
if command -v slurmctld >/dev/null && command -v slurmd >/dev/null && [ -f "$CONF" ] &&
    cmp -s "$CONF" <(config) && munge_ok &&
    slurm_pid_alive /run/slurmctld.pid && slurm_pid_alive /run/slurmd.pid &&
    case "$(node_state)" in idle | mixed | allocated | completing) true ;; *) false ;; esac; then
    exit 0
fi

# 1. Packages (only what is missing).
slurm_install_packages

# 2. munge: a key and a running daemon.
if ! munge_ok; then
    munge_key
    mkdir -p "$MUNGE_SOCKET_DIR" /var/log/munge /var/lib/munge
    chown munge:munge "$MUNGE_SOCKET_DIR" /var/log/munge /var/lib/munge 2>/dev/null || true
    start_munged "$NODE" "$MUNGE_SOCKET_DIR/munge.socket.2"
fi

# 3. Configuration: rewritten (and the daemons restarted) only when it differs.
mkdir -p "$CONF_DIR" "$LOG_DIR" /var/spool/slurmctld /var/spool/slurmd
if ! cmp -s "$CONF" <(config); then
    config >"$CONF.new" && mv "$CONF.new" "$CONF"
    log "wrote $CONF (node $NODE, $CPUS CPUs)"
    slurm_stop /run/slurmd.pid
    slurm_stop /run/slurmctld.pid
fi

# 4. The daemons, and wait until the node is usable.
slurm_start_daemons "$NODE"
slurm_wait_usable "$WAIT_S" "$NODE"
log "SLURM is up: node $NODE $(node_state), partition $(sinfo -h -o %P | head -n1)"
