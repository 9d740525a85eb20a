# SLURM set-up shared by the one-node test SLURM (tests/slurm/bring_up.sh) and the test cluster's
# (tests/cluster/slurm_up.sh). Sourced by bash after the caller has defined:
#   die MESSAGE / log MESSAGE       report (die exits non-zero)
#   on_node NODE COMMAND...         run COMMAND where NODE's daemons run (and see its slurm.conf)
#   CTLD_NODE, CTLD_PIDFILE         the controller's node and pid file
#   slurmd_pidfile NODE             the pid file of NODE's slurmd
#   LOG_DIR                         where slurmctld.log and the slurmd logs are

# slurm.conf of a test cluster, all but its nodes and partition (the caller appends those).
# The configuration is a test cluster, not a template for a real one:
#   - no cgroups anywhere (proctrack/linuxproc, task/none, no accounting): runs in containers;
#   - nodes claim more CPUs than the hardware has (SlurmdParameters=config_overrides) and the
#     partition oversubscribes (OverSubscribe=FORCE), so 4-8 MPI ranks and several jobs fit on 2 cores.
slurm_conf() { # WHO CLUSTER CONTROLLER AUTH_INFO STATE_DIR SPOOL_DIR CTLD_PIDFILE SLURMD_PIDFILE CTLD_LOG SLURMD_LOG
    cat <<EOC
# Written by hpcpar $1 without cgroups.
ClusterName=$2
SlurmctldHost=$3
AuthType=auth/munge
SlurmUser=root
SlurmdUser=root
StateSaveLocation=$5
SlurmdSpoolDir=$6
SlurmctldPidFile=$7
SlurmdPidFile=$8
SlurmctldLogFile=$9
SlurmdLogFile=${10}
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
AuthInfo=$4
EOC
}

slurm_pid_alive() { [ -s "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }
munge_ok() { command -v munge >/dev/null && munge "$@" -n 2>/dev/null | unmunge "$@" >/dev/null 2>&1; }

# Packages (only what is missing). Package scripts may try to start services with the
# distribution's configuration; whatever they start is checked or replaced by the caller.
slurm_install_packages() {
    if command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v sbatch >/dev/null &&
        command -v munged >/dev/null; then
        return 0
    fi
    command -v apt-get >/dev/null || die "slurm-wlm/munge are missing and there is no apt-get to install them"
    log "installing slurm-wlm and munge with apt-get"
    export DEBIAN_FRONTEND=noninteractive
    : >/tmp/hpcpar-slurm-apt.log
    _apt_install() {
        apt-get install -y -q --no-install-recommends -o DPkg::Lock::Timeout=120 slurm-wlm munge \
            >>/tmp/hpcpar-slurm-apt.log 2>&1
    }
    if ! _apt_install; then
        apt-get update -q >>/tmp/hpcpar-slurm-apt.log 2>&1 ||
            die "apt-get update failed (apt repositories unreachable?): $(tail -n 1 /tmp/hpcpar-slurm-apt.log)"
        _apt_install || die "apt-get install slurm-wlm munge failed: $(tail -n 1 /tmp/hpcpar-slurm-apt.log)"
    fi
    command -v slurmctld >/dev/null || die "slurm-wlm installed but slurmctld is not on PATH"
}

munge_key() { # /etc/munge/munge.key, made once; every munged of this machine shares it
    [ -s /etc/munge/munge.key ] && return 0
    mkdir -p /etc/munge
    if command -v mungekey >/dev/null; then mungekey --create --force >/dev/null
    else dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 status=none; fi
    chown munge:munge /etc/munge/munge.key 2>/dev/null || true
    chmod 400 /etc/munge/munge.key
}

# Run munged (as the munge user the package creates: as root it warns about file owners) with
# MUNGED_ARGS, on node $1 (with on_node), and wait until it answers on SOCKET ($2).
start_munged() { # NODE SOCKET MUNGED_ARGS...
    local node=$1 socket=$2
    shift 2
    if id munge >/dev/null 2>&1; then on_node "$node" runuser -u munge -- munged "$@" 9>&- 8>&-
    else on_node "$node" munged --force "$@" 9>&- 8>&-; fi || die "munged did not start on $node"
    for _ in $(seq 50); do munge_ok --socket="$socket" && return 0; sleep 0.1; done
    die "munged started but munge -n | unmunge fails on $socket"
}

slurm_stop() { # PIDFILE: SIGTERM, wait until it has gone (SIGKILL after 10 s)
    local pidfile=$1 pid
    slurm_pid_alive "$pidfile" || return 0
    pid=$(cat "$pidfile")
    kill "$pid" 2>/dev/null || true
    for _ in $(seq 100); do kill -0 "$pid" 2>/dev/null || return 0; sleep 0.1; done
    kill -KILL "$pid" 2>/dev/null || true
}

_log_tail() { tail -n 3 "$LOG_DIR/$1" 2>/dev/null | tr '\n' ' '; }

# Start whatever daemon is not running: slurmctld on CTLD_NODE, then a slurmd on each NODE
# (slurmctld and slurmd daemonize and write their pid files themselves). Every daemon is started
# with the lock descriptors (8, 9) closed, or it would hold a bring-up lock for its lifetime.
slurm_start_daemons() { # NODES...
    local node
    if ! slurm_pid_alive "$CTLD_PIDFILE"; then
        on_node "$CTLD_NODE" slurmctld 9>&- 8>&- || die "slurmctld did not start; see $LOG_DIR/slurmctld.log: $(_log_tail slurmctld.log)"
    fi
    # The controller must answer before a slurmd registers with it.
    for _ in $(seq 100); do on_node "$CTLD_NODE" scontrol ping >/dev/null 2>&1 && break; sleep 0.1; done
    on_node "$CTLD_NODE" scontrol ping >/dev/null 2>&1 ||
        die "slurmctld does not answer scontrol ping; see $LOG_DIR/slurmctld.log: $(_log_tail slurmctld.log)"
    for node in "$@"; do
        slurm_pid_alive "$(slurmd_pidfile "$node")" && continue
        on_node "$node" slurmd 9>&- 8>&- ||
            die "slurmd did not start on $node; see $LOG_DIR/$(basename "$(slurmd_pidfile "$node")" .pid).log"
    done
}

# Wait until every NODE is usable. A node left down or drained by an earlier run is resumed once.
slurm_wait_usable() { # WAIT_S NODES...
    local deadline=$((SECONDS + $1)) node state resumed=" "
    shift
    for node in "$@"; do
        while :; do
            state=$(on_node "$CTLD_NODE" sinfo -h -N -n "$node" -o %T 2>/dev/null | head -n1)
            case "$state" in idle | mixed | allocated | completing) break ;; esac
            case "$state" in
            down* | drain* | fail*)
                case "$resumed" in *" $node "*) ;; *)
                    on_node "$CTLD_NODE" scontrol update NodeName="$node" State=RESUME >/dev/null 2>&1 || true
                    resumed="$resumed$node " ;;
                esac ;;
            esac
            [ "$SECONDS" -lt "$deadline" ] ||
                die "node $node is '${state:-unknown}' after $1 s, not idle; see the logs in $LOG_DIR: $(_log_tail slurmctld.log)"
            slurm_pid_alive "$(slurmd_pidfile "$node")" || die "slurmd on $node exited; see the slurmd log in $LOG_DIR"
            sleep 0.5
        done
    done
}
