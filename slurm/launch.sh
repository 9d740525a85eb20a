# hpcpar_launch COMMAND [ARGS...]: run COMMAND as one MPI rank per task of this SLURM job, and pass
# the preemption signals on to the ranks. Sourced (bash) by slurm/*.sbatch after slurm/env.sh.
#
# HPCPAR_LAUNCHER picks how the ranks start:
#   srun     (default) srun --kill-on-bad-exit=1 --mpi=pmi2: SLURM starts and tracks every rank;
#            one failing rank ends the step. pmi2 suits MPICH-family MPIs (the PyPI wheel
#            included); an Open MPI build usually wants --mpi=pmix (HPCPAR_SRUN_MPI=pmix).
#   mpiexec  mpiexec -n $SLURM_NTASKS: the MPI's own launcher. MPICH's (hydra) reads the
#            allocation from SLURM and starts one hydra_pmi_proxy per node with srun.
#
# Signals: `#SBATCH --signal=B:USR1@90` and `scancel --signal=USR1 --batch` signal only this batch
# shell, and bash runs a trap only when its foreground command ends (an untrapped USR1 kills it
# and, with it, the job). So the launcher runs in the background, the shell waits for it, and a
# trap passes USR1 or TERM on to the ranks (measured: srun and hydra's mpiexec both forward USR1
# to every rank, hydra forwards TERM too; srun ends its step at once on TERM, see _hpcpar_forward).
# The ranks save a checkpoint and exit 0, and `wait` returns the launcher's exit status.
hpcpar_launch() {
    case "${HPCPAR_LAUNCHER:-srun}" in
    srun)
        [ "${SLURM_RESTART_COUNT:-0}" = 0 ] || _hpcpar_remove_stale_shm
        # Since SLURM 22.05 srun no longer inherits the job's --cpus-per-task: pass it on.
        set -- srun --kill-on-bad-exit=1 --mpi="${HPCPAR_SRUN_MPI:-pmi2}" \
            ${SLURM_CPUS_PER_TASK:+--cpus-per-task="$SLURM_CPUS_PER_TASK"} "$@"
        ;;
    mpiexec)
        set -- mpiexec -n "$SLURM_NTASKS" "$@"
        ;;
    *)
        echo "hpcpar_launch: HPCPAR_LAUNCHER=$HPCPAR_LAUNCHER; use srun or mpiexec" >&2
        return 2
        ;;
    esac
    echo "+ $*" >&2
    "$@" &
    local pid=$! rc
    trap '_hpcpar_forward USR1 '"$pid" USR1
    trap '_hpcpar_forward TERM '"$pid" TERM
    while :; do
        _hpcpar_interrupted=0
        wait "$pid" && rc=0 || rc=$?
        # A trapped signal ends `wait` early with 128+signal while the launcher still runs.
        [ "$_hpcpar_interrupted" = 1 ] && [ "$rc" -gt 128 ] && continue
        break
    done
    trap - USR1 TERM
    return "$rc"
}

_hpcpar_forward() { # SIGNAL LAUNCHER_PID
    _hpcpar_interrupted=1
    echo "== $(date +%T) batch shell got SIG$1: forwarding it to the ranks" >&2
    if [ "$1" = TERM ] && [ "${HPCPAR_LAUNCHER:-srun}" = srun ]; then
        # srun answers SIGTERM by killing its step at once (no checkpoint), so signal the job's
        # steps directly; without --batch/--full, scancel spares this shell. In the background:
        # while a job is being requeued or cancelled, scancel can block until it has ended.
        timeout 10 scancel --signal=TERM "$SLURM_JOB_ID" >/dev/null 2>&1 &
    else
        kill -s "$1" "$2" 2>/dev/null || true
    fi
}

# MPICH derives the name of a node's shared-memory segment from the PMI job id, which under srun
# is "<job id>.<step id>". A requeued job runs step 0 again under the same job id; when the previous
# run's ranks were killed before MPI_Finalize (requeue, preemption, time limit), their segment is
# still in /dev/shm, and MPI_Init of the new ranks attaches to it and spins forever (measured with
# the PyPI MPICH 5). So on a restart, first remove on every node this user's MPICH segments that
# no process has open or mapped. (mpiexec's job ids are fresh on every run: it needs none of this.)
_hpcpar_remove_stale_shm() {
    srun --nodes="$SLURM_JOB_NUM_NODES" --ntasks="$SLURM_JOB_NUM_NODES" --ntasks-per-node=1 --mpi=none \
        python -c '
import glob, os, socket
in_use = set()
for pid in filter(str.isdigit, os.listdir("/proc")):
    try:
        in_use.update(os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd"))
        with open(f"/proc/{pid}/maps") as maps:
            in_use.update(line.split(None, 5)[-1].strip() for line in maps if "/dev/shm/" in line)
    except OSError:
        pass
removed = 0
for f in set(glob.glob("/dev/shm/mpich_shm_*")) - in_use:
    try:
        if os.stat(f).st_uid == os.getuid():
            os.unlink(f)
            removed += 1
    except OSError:
        pass
if removed:
    print(f"{socket.gethostname()}: removed {removed} stale MPICH shared-memory segment(s) from /dev/shm")
' || echo "hpcpar_launch: could not check /dev/shm for stale MPICH segments" >&2
}
