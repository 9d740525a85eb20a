"""Jobs submitted with sbatch to a real one-node SLURM, which tests/slurm/bring_up.sh installs and
starts (as root; about 15 s on a fresh Debian machine, under a second when it is already up).

These are serial tests: pytest runs as one process and the jobs start the MPI ranks. When SLURM
cannot be brought up (not root, no apt...) they skip with the script's reason, except under
CI=true, where a failed bring-up fails them: CI must exercise the SLURM scripts.

    .venv/bin/python -m pytest tests/test_slurm.py
"""
import os
import re
import subprocess
import sys
import time

import numpy as np
import pytest

from conftest import REPO, final_parameters

pytestmark = pytest.mark.slurm

BRING_UP = os.path.join(REPO, "tests", "slurm", "bring_up.sh")
# States after which a job runs no more (a requeued job goes back to PENDING instead).
FINISHED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED",
            "BOOT_FAIL", "DEADLINE"}


@pytest.fixture(scope="session")
def slurm_cluster():
    """A running one-node SLURM (brought up once per session)."""
    try:
        result = subprocess.run(["bash", BRING_UP], capture_output=True, text=True, timeout=600)
        failure = None if result.returncode == 0 else (
            result.stderr.strip().splitlines() or [f"exit code {result.returncode}"])[-1]
    except subprocess.TimeoutExpired:
        failure = "tests/slurm/bring_up.sh ran for more than 600 s"
    if failure is not None:
        if os.environ.get("CI") == "true":
            pytest.fail(f"SLURM bring-up failed under CI=true: {failure}")
        pytest.skip(f"no SLURM here: {failure}")


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


def submit(*argv, env=None):
    """`sbatch --parsable ARGV...` from the repository root; returns the job id.

    ARGV is what follows `sbatch` on a command line: options (pass --output=FILE, which overrides
    the scripts' logs/%x-%j.out), then a script and its arguments, or --wrap=COMMAND.
    """
    result = subprocess.run(["sbatch", "--parsable", *map(str, argv)], cwd=REPO, capture_output=True,
                            text=True, env=job_env() if env is None else env, timeout=60)
    assert result.returncode == 0, f"sbatch {' '.join(map(str, argv))} failed: {result.stderr}"
    return result.stdout.strip().split(";")[0]                # "JOBID" or "JOBID;CLUSTER"


def job_info(job_id):
    """The job's fields from `scontrol show job` (JobState, ExitCode, Restarts, StdOut...).

    There is no slurmdbd, so no sacct: scontrol knows a job until MinJobAge (600 s in the
    test cluster) after it ends."""
    result = subprocess.run(["scontrol", "show", "job", "-o", str(job_id)], capture_output=True, text=True,
                            timeout=30)
    if result.returncode != 0:
        return {"JobId": str(job_id), "JobState": "UNKNOWN", "Reason": result.stderr.strip()}
    return dict(re.findall(r"(\w+)=(\S*)", result.stdout))


def wait_for(job_id, timeout, states=FINISHED):
    """Poll until the job is in one of `states` (default: finished) and return job_info.
    On timeout cancel the job and fail with its state and the end of its output."""
    deadline = time.monotonic() + timeout
    while True:
        info = job_info(job_id)
        if info["JobState"] in states or info["JobState"] == "UNKNOWN":
            return info
        if time.monotonic() > deadline:
            subprocess.run(["scancel", str(job_id)], capture_output=True, timeout=30)
            out = info.get("StdOut", "")
            tail = open(out).read()[-3000:] if out and os.path.exists(out) else "(no output file)"
            pytest.fail(f"job {job_id} still {info['JobState']} after {timeout} s "
                        f"(waiting for {sorted(states)}); output:\n{tail}")
        time.sleep(0.5)


def test_wrapped_mpiexec_runs_hpcpar_info_on_four_ranks(slurm_cluster, tmp_path):
    out = tmp_path / "info.out"
    job = submit("--ntasks=4", f"--output={out}",
                 "--wrap=. slurm/env.sh && command -v hpcpar && mpiexec -n 4 hpcpar info")
    info = wait_for(job, timeout=180)
    text = out.read_text()
    assert (info["JobState"], info["ExitCode"]) == ("COMPLETED", "0:0"), text
    # slurm/env.sh put the venv's hpcpar on PATH (the job's inherited PATH had none)
    assert os.path.realpath(text.splitlines()[0]) == os.path.realpath(os.path.join(sys.prefix, "bin", "hpcpar")), text
    assert re.search(r"^world size +4 +layout dp=4 pp=1 tp=1$", text, re.M), text
    assert re.search(r"^world rank +0 +1 +2 +3$", text, re.M), text
    assert re.search(r"^dp \(replica\) +0 +1 +2 +3$", text, re.M), text
    # one line per rank with its node-local rank: all four ranks ran on this job's node
    node = info["NodeList"]
    assert re.findall(rf"^ +(\d) +{re.escape(node)} +(\d) +\d+$", text, re.M) == [(r, r) for r in "0123"], text


# ----- hpcpar train under sbatch -------------------------------------------------------------
SMALL = ["--set", "model.n_layer=1", "--set", "model.n_embd=32", "--set", "train.eval_interval=0",
         "--set", "train.log_interval=1", "--set", "checkpoint.interval=0"]


def job_args(tmp, token_file, steps):
    return [os.path.join(REPO, "jobs", "gpt-dp.toml"), *SMALL, "--set", f"train.steps={steps}",
            "--set", f'data.path="{token_file}"', "--set", f'checkpoint.dir="{tmp}/ckpt"',
            "--set", f'train.metrics="{tmp}/metrics.jsonl"']




def test_train_sbatch_completes_and_checkpoints(slurm_cluster, tmp_path, token_file):
    out = tmp_path / "train.out"
    job = submit("--ntasks=4", f"--output={out}", "slurm/train.sbatch", *job_args(tmp_path, token_file, 6),
                 env=job_env(HPCPAR_LAUNCHER="mpiexec"))
    info = wait_for(job, timeout=240)
    text = out.read_text()
    assert (info["JobState"], info["ExitCode"]) == ("COMPLETED", "0:0"), text
    assert "step     6/6" in text and "val_loss" in text, text
    assert os.path.isdir(tmp_path / "ckpt" / "step-00000006")


def test_usr1_checkpoints_requeues_and_resumes_to_the_same_parameters(slurm_cluster, tmp_path, token_file):
    steps = 40
    straight = subprocess.run([os.path.join(os.path.dirname(sys.executable), "mpiexec"), "-n", "4", sys.executable,
                               "-m", "hpcpar", "train", *job_args(tmp_path / "straight", token_file, steps)],
                              capture_output=True, text=True, timeout=300,
                              env={**os.environ, "OPENBLAS_NUM_THREADS": "1"})
    assert straight.returncode == 0, straight.stdout + straight.stderr

    out = tmp_path / "preempted.out"
    job = submit("--ntasks=4", f"--output={out}", "slurm/train.sbatch", *job_args(tmp_path / "run", token_file, steps))
    deadline = time.monotonic() + 180
    while not (out.exists() and "step     3/" in out.read_text()):  # training is under way
        assert time.monotonic() < deadline, out.read_text() if out.exists() else "no output"
        time.sleep(0.2)
    subprocess.run(["scancel", "--signal=USR1", "--batch", job], check=True, timeout=30)
    info = wait_for(job, timeout=300)
    text = out.read_text()
    assert (info["JobState"], info["ExitCode"]) == ("COMPLETED", "0:0"), text
    assert int(info["Restarts"]) == 1, text
    assert "stopped at step" in text and "signal SIGUSR1" in text and "requeue of SLURM job" in text, text
    assert "resumed from" in text and f"step    {steps}/{steps}" in text, text
    a, b = final_parameters(tmp_path / "straight" / "ckpt"), final_parameters(tmp_path / "run" / "ckpt")
    assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)
