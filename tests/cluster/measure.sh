#!/usr/bin/env bash
# The test cluster's links measured: point-to-point and all-reduce latency and bandwidth inside a
# node (shared memory) and across nodes (TCP over the veth links), with the links unshaped and
# limited to each RATE in turn (tc tbf; see bring_up.sh). Run from the repository root, as root:
#
#   sudo tests/cluster/measure.sh [--rounds N] [--max-mib M] [RATE ...]    # default RATEs: 10gbit 1gbit
#
# Prints the tables of `hpcpar bench net` (2 nodes x 2 ranks) for each setting. The cluster is
# brought up if needed, left unshaped afterwards, and torn down again if this script brought it up.
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
. "$HERE/common.sh"
ROUNDS=7 MAX_MIB=16 RATES=()
while [ $# -gt 0 ]; do
    case "$1" in
    --rounds) ROUNDS=${2:?}; shift 2 ;;
    --max-mib) MAX_MIB=${2:?}; shift 2 ;;
    -*) die "unknown option '$1'" ;;
    *) RATES+=("$1"); shift ;;
    esac
done
[ ${#RATES[@]} -gt 0 ] || RATES=(10gbit 1gbit)
VENV=${HPCPAR_VENV:-$PWD/.venv}
[ -x "$VENV/bin/hpcpar" ] || die "no hpcpar in $VENV (run from the repository root after make setup, or set HPCPAR_VENV)"
export PATH=$VENV/bin:$PATH OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1

was_up=0
cluster_is_up && was_up=1
for rate in none "${RATES[@]}"; do
    if [ "$rate" = none ]; then "$HERE/bring_up.sh" 2>/dev/null; else "$HERE/bring_up.sh" --rate "$rate" 2>/dev/null; fi
    echo "== links between nodes: $([ "$rate" = none ] && echo unshaped || echo "limited to $rate (tc tbf)")"
    timeout 600 "$HERE/on" node1 mpiexec -launcher-exec "$HERE/on" -hosts node1,node2 -ppn 2 -n 4 \
        hpcpar bench net --rounds "$ROUNDS" --max-mib "$MAX_MIB"
    echo
done
"$HERE/bring_up.sh" 2>/dev/null
[ "$was_up" = 1 ] || "$HERE/tear_down.sh" 2>/dev/null
