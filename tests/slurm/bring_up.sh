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
# The configuration is a test cluster, not a template for a real one:
#   - no cgroups anywhere (proctrack/linuxproc, task/none, no accounting): runs in containers;
#   - the node claims CPUS (default 8) CPUs whatever the hardware has (SlurmdParameters=
#     config_overrides) and its partition oversubscribes (OverSubscribe=FORCE), so 4-8 MPI ranks
#     and several jobs fit on a 2-core machine;
#   - controller and node talk over 127.0.0.1, so the host name need not resolve.
set -euo pipefail

CPUS=${HPCPAR_SLURM_CPUS:-8}
CONF_DIR=/etc/slurm
CONF=$CONF_DIR/slurm.conf
LOG_DIR=/var/log/slurm
MUNGE_SOCKET_DIR=/run/munge
WAIT_S=${HPCPAR_SLURM_WAIT_S:-60}

die() { echo "bring_up.sh: $*" >&2; exit 1; }
log() { echo "bring_up.sh: $*" >&2; }

[ "$(id -u)" = 0 ] || die "needs root (it installs slurm-wlm and munge and starts daemons); run it with sudo"

NODE=$(hostname -s)
[ -n "$NODE" ] || die "hostname -s printed nothing; the node needs a name"

# One bring-up at a time (two test sessions starting together must not race on daemons).
exec 9>/run/hpcpar-slurm.lock
flock -w 300 9 || die "another bring_up.sh has held /run/hpcpar-slurm.lock for 300 s"

config() {
    cat <<EOF
# Written by hpcpar tests/slurm/bring_up.sh: a one-node test cluster without cgroups.
ClusterName=hpcpar
SlurmctldHost=$NODE(127.0.0.1)
AuthType=auth/munge
SlurmUser=root
SlurmdUser=root
StateSaveLocation=/var/spool/slurmctld
SlurmdSpoolDir=/var/spool/slurmd
SlurmctldPidFile=/run/slurmctld.pid
SlurmdPidFile=/run/slurmd.pid
SlurmctldLogFile=$LOG_DIR/slurmctld.log
SlurmdLogFile=$LOG_DIR/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
# Look at pending jobs every few seconds (a requeued job waits for a pass after cred_expire).
SchedulerParameters=sched_interval=5,bf_interval=5
MpiDefault=none
MailProg=/bin/true
ReturnToService=2
SlurmdParameters=config_overrides
# Finished jobs stay visible to scontrol for 10 minutes (there is no slurmdbd, so no sacct).
MinJobAge=600
# A job cancelled or preempted gets this long between SIGTERM and SIGKILL.
KillWait=30
# A requeued job waits cred_expire seconds before it may start again (default 120).
AuthInfo=cred_expire=10
NodeName=$NODE NodeAddr=127.0.0.1 CPUs=$CPUS State=UNKNOWN
PartitionName=debug Nodes=$NODE Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE
EOF
}

pid_alive() { [ -s "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }
munge_ok() { command -v munge >/dev/null && munge -n 2>/dev/null | unmunge >/dev/null 2>&1; }
node_state() { sinfo -h -N -n "$NODE" -o %T 2>/dev/null | head -n1; }
node_usable() { case "$(node_state)" in idle | mixed | allocated | completing) return 0 ;; *) return 1 ;; esac; }

# Fast path: installed, same configuration, all three daemons alive, node usable.
if command -v slurmctld >/dev/null && command -v slurmd >/dev/null && [ -f "$CONF" ] &&
    cmp -s "$CONF" <(config) && munge_ok &&
    pid_alive /run/slurmctld.pid && pid_alive /run/slurmd.pid && node_usable; then
    exit 0
fi

# 1. Packages (only what is missing). Package scripts may try to start services with the
#    distribution's configuration; whatever they start is checked or replaced below.
if ! command -v slurmctld >/dev/null || ! command -v slurmd >/dev/null ||
    ! command -v sbatch >/dev/null || ! command -v munged >/dev/null; then
    command -v apt-get >/dev/null || die "slurm-wlm/munge are missing and there is no apt-get to install them"
    log "installing slurm-wlm and munge with apt-get"
    export DEBIAN_FRONTEND=noninteractive
    : >/tmp/hpcpar-slurm-apt.log
    apt_install() {
        apt-get install -y -q --no-install-recommends -o DPkg::Lock::Timeout=120 slurm-wlm munge \
            >>/tmp/hpcpar-slurm-apt.log 2>&1
    }
    if ! apt_install; then
        apt-get update -q >>/tmp/hpcpar-slurm-apt.log 2>&1 ||
            die "apt-get update failed (apt repositories unreachable?): $(tail -n 1 /tmp/hpcpar-slurm-apt.log)"
        apt_install || die "apt-get install slurm-wlm munge failed: $(tail -n 1 /tmp/hpcpar-slurm-apt.log)"
    fi
    command -v slurmctld >/dev/null || die "slurm-wlm installed but slurmctld is not on PATH"
fi

# 2. munge: a key and a running daemon.
if ! munge_ok; then
    if [ ! -s /etc/munge/munge.key ]; then
        mkdir -p /etc/munge
        if command -v mungekey >/dev/null; then mungekey --create --force >/dev/null
        else dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 status=none; fi
        chown munge:munge /etc/munge/munge.key 2>/dev/null || true
        chmod 400 /etc/munge/munge.key
    fi
    mkdir -p "$MUNGE_SOCKET_DIR" /var/log/munge /var/lib/munge
    chown munge:munge "$MUNGE_SOCKET_DIR" /var/log/munge /var/lib/munge 2>/dev/null || true
    # munged runs as the munge user that the package creates (as root it warns about file owners).
    if id munge >/dev/null 2>&1; then runuser -u munge -- munged 9>&- || die "munged did not start; see /var/log/munge/munged.log"
    else munged --force 9>&- || die "munged did not start; see /var/log/munge/munged.log"; fi
    for _ in $(seq 50); do munge_ok && break; sleep 0.1; done
    munge_ok || die "munged started but munge -n | unmunge fails; see /var/log/munge/munged.log"
fi

# 3. Configuration: rewritten (and the daemons restarted) only when it differs.
mkdir -p "$CONF_DIR" "$LOG_DIR" /var/spool/slurmctld /var/spool/slurmd
restart=0
if ! cmp -s "$CONF" <(config); then
    config >"$CONF.new" && mv "$CONF.new" "$CONF"
    restart=1
    log "wrote $CONF (node $NODE, $CPUS CPUs)"
fi

stop() { # stop the daemon whose pid file is $1, waiting until it has gone
    local pidfile=$1 pid
    pid_alive "$pidfile" || return 0
    pid=$(cat "$pidfile")
    kill "$pid" 2>/dev/null || true
    for _ in $(seq 100); do kill -0 "$pid" 2>/dev/null || return 0; sleep 0.1; done
    kill -KILL "$pid" 2>/dev/null || true
}

if [ "$restart" = 1 ]; then
    stop /run/slurmd.pid
    stop /run/slurmctld.pid
fi

# 4. Daemons. slurmctld and slurmd daemonize and write their pid files themselves. Every daemon is
#    started with the lock's descriptor closed (9>&-), or it would hold the lock for its lifetime.
if ! pid_alive /run/slurmctld.pid; then
    slurmctld 9>&- || die "slurmctld did not start; see $LOG_DIR/slurmctld.log: $(tail -n 3 $LOG_DIR/slurmctld.log 2>/dev/null)"
fi
# The controller must answer before slurmd registers with it.
for _ in $(seq 100); do scontrol ping >/dev/null 2>&1 && break; sleep 0.1; done
scontrol ping >/dev/null 2>&1 ||
    die "slurmctld does not answer scontrol ping; see $LOG_DIR/slurmctld.log: $(tail -n 3 $LOG_DIR/slurmctld.log 2>/dev/null)"
if ! pid_alive /run/slurmd.pid; then
    slurmd 9>&- || die "slurmd did not start; see $LOG_DIR/slurmd.log: $(tail -n 3 $LOG_DIR/slurmd.log 2>/dev/null)"
fi

# 5. Wait until the node is usable. A node left down or drained by an earlier run is resumed once.
resumed=0
deadline=$((SECONDS + WAIT_S))
while ! node_usable; do
    state=$(node_state)
    case "$state" in
    down* | drain* | fail*)
        if [ "$resumed" = 0 ]; then
            scontrol update NodeName="$NODE" State=RESUME >/dev/null 2>&1 || true
            resumed=1
        fi
        ;;
    esac
    if [ "$SECONDS" -ge "$deadline" ]; then
        die "node $NODE is '${state:-unknown}' after ${WAIT_S} s, not idle; see $LOG_DIR/slurmd.log and $LOG_DIR/slurmctld.log: $(tail -n 3 $LOG_DIR/slurmd.log 2>/dev/null)"
    fi
    pid_alive /run/slurmd.pid ||
        die "slurmd exited; see $LOG_DIR/slurmd.log: $(tail -n 3 $LOG_DIR/slurmd.log 2>/dev/null)"
    sleep 0.5
done
log "SLURM is up: node $NODE $(node_state), partition $(sinfo -h -o %P | head -n1)"
