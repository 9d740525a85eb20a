#!/usr/bin/env bash
# Stop the daemons that tests/slurm/bring_up.sh started (slurmd, slurmctld, munged), by their pid
# files. Packages, /etc/slurm/slurm.conf and the controller's state stay, so the next bring_up.sh
# only starts the daemons again (job ids continue where they were). Running jobs are killed.
set -euo pipefail
[ "$(id -u)" = 0 ] || { echo "tear_down.sh: needs root" >&2; exit 1; }

stop() { # NAME PIDFILE: SIGTERM, then SIGKILL after 10 s
    local name=$1 pidfile=$2 pid
    if ! [ -s "$pidfile" ] || ! kill -0 "$(cat "$pidfile")" 2>/dev/null; then
        echo "tear_down.sh: $name is not running"
        return 0
    fi
    pid=$(cat "$pidfile")
    kill "$pid"
    for _ in $(seq 100); do
        kill -0 "$pid" 2>/dev/null || { echo "tear_down.sh: stopped $name (pid $pid)"; return 0; }
        sleep 0.1
    done
    kill -KILL "$pid" 2>/dev/null || true
    echo "tear_down.sh: killed $name (pid $pid), it ignored SIGTERM for 10 s"
}

stop slurmd /run/slurmd.pid
stop slurmctld /run/slurmctld.pid
stop munged /run/munge/munged.pid
