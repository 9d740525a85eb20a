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

import numpy as np
import pytest

from conftest import REPO, final_parameters
from hpcpar.host import BLAS_THREAD_VARIABLES
from services import shared_service
from slurm_jobs import job_env, submit, wait_for, wait_for_output

pytestmark = pytest.mark.slurm

SLURM_DIR = os.path.join(REPO, "tests", "slurm")


def slurmctld_running() -> bool:
    try:
        os.kill(int(open("/run/slurmctld.pid").read()), 0)
        return True
    except (OSError, ValueError):
        return False


@pytest.fixture(scope="session")
def slurm_cluster():
    """A running one-node SLURM (brought up once per session, tests/services.py)."""
    yield from shared_service("slurm", [os.path.join(SLURM_DIR, "bring_up.sh")],
                              [os.path.join(SLURM_DIR, "tear_down.sh")], slurmctld_running,
                              marker="/run/hpcpar-slurm.started-by-tests")


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
    # The uninterrupted run uses the BLAS threads the sbatch job gets (its --cpus-per-task, through
    # slurm/env.sh): another thread count splits the products otherwise and rounds differently.
    threads = re.search(r"^#SBATCH --cpus-per-task=(\d+)", open(os.path.join(REPO, "slurm", "train.sbatch")).read(),
                        re.M).group(1)
    straight = subprocess.run([os.path.join(os.path.dirname(sys.executable), "mpiexec"), "-n", "4", sys.executable,
                               "-m", "hpcpar", "train", *job_args(tmp_path / "straight", token_file, steps)],
                              capture_output=True, text=True, timeout=300,
                              env={**os.environ, **{name: threads for name in BLAS_THREAD_VARIABLES}})
    assert straight.returncode == 0, straight.stdout + straight.stderr

    out = tmp_path / "preempted.out"
    job = submit("--ntasks=4", f"--output={out}", "slurm/train.sbatch", *job_args(tmp_path / "run", token_file, steps))
    wait_for_output(out, "step     3/", timeout=180)  # training is under way
    subprocess.run(["scancel", "--signal=USR1", "--batch", job], check=True, timeout=30)
    info = wait_for(job, timeout=300)
    text = out.read_text()
    assert (info["JobState"], info["ExitCode"]) == ("COMPLETED", "0:0"), text
    assert int(info["Restarts"]) == 1, text
    assert "stopped at step" in text and "signal SIGUSR1" in text and "requeue of SLURM job" in text, text
    assert "resumed from" in text and f"step    {steps}/{steps}" in text, text
    a, b = final_parameters(tmp_path / "straight" / "ckpt"), final_parameters(tmp_path / "run" / "ckpt")
    assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)
