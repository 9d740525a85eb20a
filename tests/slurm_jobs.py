"""Submitting and watching SLURM jobs from tests: the one-node SLURM (tests/test_slurm.py) and the
test cluster's (tests/test_cluster.py, whose commands run on a node: ``on=("tests/cluster/on", "node1")``)."""
import os
import re
import subprocess
import sys
import time

import pytest

from conftest import REPO

# States after which a job runs no more (a requeued job goes back to PENDING instead).
FINISHED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED",
            "BOOT_FAIL", "DEADLINE"}


def job_env(**extra):
    """The submitting environment without any activated venv, so a job must find hpcpar through
    slurm/env.sh (sbatch passes the submitter's environment on to the job)."""
    venv_bin = os.path.dirname(sys.executable)
    env = {k: v for k, v in os.environ.items() if k != "VIRTUAL_ENV" and not k.startswith("SLURM_")}
    env["PATH"] = os.pathsep.join(p for p in env.get("PATH", "").split(os.pathsep)
                                  if os.path.realpath(p) != os.path.realpath(venv_bin))
    if os.path.realpath(sys.prefix) != os.path.realpath(os.path.join(REPO, ".venv")):
        env["HPCPAR_VENV"] = sys.prefix          # pytest runs from another venv: use that one
    env.update(extra)
    return env


def submit(*argv, env=None, on=()):
    """`sbatch --parsable ARGV...` from the repository root; returns the job id.

    ARGV is what follows `sbatch` on a command line: options (pass --output=FILE, which overrides
    the scripts' logs/%x-%j.out), then a script and its arguments, or --wrap=COMMAND.
    """
    result = subprocess.run([*on, "sbatch", "--parsable", *map(str, argv)], cwd=REPO, capture_output=True,
                            text=True, env=job_env() if env is None else env, timeout=60)
    assert result.returncode == 0, f"sbatch {' '.join(map(str, argv))} failed: {result.stderr}"
    return result.stdout.strip().split(";")[0]                # "JOBID" or "JOBID;CLUSTER"


def job_info(job_id, on=()):
    """The job's fields from `scontrol show job` (JobState, ExitCode, Restarts, StdOut...).

    There is no slurmdbd, so no sacct: scontrol knows a job until MinJobAge (600 s in the
    test clusters) after it ends."""
    result = subprocess.run([*on, "scontrol", "show", "job", "-o", str(job_id)], capture_output=True, text=True,
                            timeout=30)
    if result.returncode != 0:
        return {"JobId": str(job_id), "JobState": "UNKNOWN", "Reason": result.stderr.strip()}
    return dict(re.findall(r"(\w+)=(\S*)", result.stdout))


def wait_for(job_id, timeout, states=FINISHED, on=()):
    """Poll until the job is in one of `states` (default: finished) and return job_info.
    On timeout cancel the job and fail with its state and the end of its output."""
    deadline = time.monotonic() + timeout
    while True:
        info = job_info(job_id, on)
        if info["JobState"] in states or info["JobState"] == "UNKNOWN":
            return info
        if time.monotonic() > deadline:
            subprocess.run([*on, "scancel", str(job_id)], capture_output=True, timeout=30)
            out = info.get("StdOut", "")
            tail = open(out).read()[-3000:] if out and os.path.exists(out) else "(no output file)"
            pytest.fail(f"job {job_id} still {info['JobState']} after {timeout} s "
                        f"(waiting for {sorted(states)}); output:\n{tail}")
        time.sleep(0.5)


def wait_for_output(path, text, timeout):
    """Wait until the file at ``path`` contains ``text`` (a job is under way)."""
    deadline = time.monotonic() + timeout
    while not (path.exists() and text in path.read_text()):
        assert time.monotonic() < deadline, path.read_text() if path.exists() else f"no output in {path}"
        time.sleep(0.2)
