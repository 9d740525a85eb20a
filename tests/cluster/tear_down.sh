#!/usr/bin/env bash
# Remove the test cluster of tests/cluster/bring_up.sh: every process running inside its nodes
# (SLURM daemons, MPI ranks, the processes that hold the namespaces), the namespaces with their
# links and bridge, and /run/hpcpar-cluster. Nothing of it stays; safe to run when nothing is up.
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
. "$HERE/common.sh"
[ "$(id -u)" = 0 ] || die "needs root"
exec 8>"$LOCK"
flock -w 300 8 || die "another bring_up.sh or tear_down.sh has held $LOCK for 300 s"
if cluster_is_down; then
    log "nothing to remove"
else
    remove_cluster
    log "removed the test cluster"
fi
