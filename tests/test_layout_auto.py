"""`parallel.layout = "auto"` (`hpcpar train --layout auto`): the planner picks the layout a job
trains in. At 2 and 4 ranks the run trains the layout `hpcpar plan` ranks first on the machine
file, says so with the runner-up, and records it in the run's job.toml; layout keys the job gives
are kept; no machine file, or `--machine` without auto, is one line and exit 2."""
import os
import subprocess
import sys

import pytest

from conftest import venv_bin
from hpcpar.plan import machine as machines
from hpcpar.plan.layouts import plan_layouts
from hpcpar.train.config_load import load_job

JOB = ('[model]\nkind = "gpt"\nn_layer = 2\nn_embd = 32\nn_head = 4\nblock_size = 32\n[data]\nbatch_size = 8\n'
       '[train]\nsteps = 2\nlog_interval = 1\neval_interval = 0\nsample_tokens = 0\n')
CHOSEN = ("dp", "pp", "tp", "cp", "schedule", "micro_batches", "chunks", "sequence_parallel", "zero")


def launch(tmp_path, token_file, ranks, *flags, cwd=None):
    job = tmp_path / "job.toml"
    job.write_text(JOB)
    args = [venv_bin("mpiexec"), "-n", str(ranks), sys.executable, "-m", "hpcpar", "train", str(job),
            "--set", f'data.path="{token_file}"', "--set", f'checkpoint.dir="{tmp_path}/ckpt"', *flags]
    env = {**os.environ, "OPENBLAS_NUM_THREADS": "1", "PYTHONPATH": os.path.dirname(os.path.dirname(__file__))}
    return subprocess.run(args, capture_output=True, text=True, timeout=240, env=env, cwd=cwd)


def first_fitting(tmp_path, token_file, ranks, *overrides):
    job = load_job(str(tmp_path / "job.toml"), [f'data.path="{token_file}"', *overrides])
    ranked = plan_layouts(job, ranks, machines.load_machine("dgx-a100"),
                          fixed=[key.split("=")[0].split(".")[1] for key in overrides])
    return next(q for q in ranked.predictions if ranked.fits[id(q)]), len(ranked.predictions)


@pytest.mark.parametrize("ranks", [2, 4])
def test_layout_auto_trains_the_layout_the_planner_ranks_first(tmp_path, token_file, ranks):
    proc = launch(tmp_path, token_file, ranks, "--layout", "auto", "--machine", "dgx-a100")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    best, planned = first_fitting(tmp_path, token_file, ranks)
    assert f"layout auto: {best.label} of {planned} layouts planned on dgx-a100" in proc.stdout, proc.stdout
    assert "  runner-up: " in proc.stdout and "step     2/2" in proc.stdout
    recorded = load_job(str(tmp_path / "ckpt" / "job.toml"))  # the run folder's record of the job it trained
    assert recorded.parallel.layout == "auto"
    assert [getattr(recorded.parallel, key) for key in CHOSEN] == [getattr(best.job.parallel, key) for key in CHOSEN]


def test_layout_keys_the_job_gives_are_kept(tmp_path, token_file):
    proc = launch(tmp_path, token_file, 4, "--layout", "auto", "--machine", "dgx-a100", "--set", "parallel.tp=2")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    best, _ = first_fitting(tmp_path, token_file, 4, "parallel.tp=2")
    assert best.layout.tp == 2 and f"layout auto: {best.label} of " in proc.stdout and ", keeping tp:" in proc.stdout


@pytest.mark.parametrize("flags, message", [
    (["--layout", "auto"], 'layout = "auto" needs a machine file: there is no runs/plan/machine.toml'),
    (["--machine", "dgx-a100"], 'the machine file is read by --dry-run and by parallel.layout = "auto" only'),
])
def test_auto_without_a_machine_file_and_a_machine_without_auto_are_one_line(tmp_path, token_file, flags, message):
    proc = launch(tmp_path, token_file, 2, *flags, cwd=tmp_path)  # a folder without runs/plan/machine.toml
    assert proc.returncode == 2 and message in proc.stderr and proc.stderr.count("\n") == 1, proc.stderr
    assert not (tmp_path / "ckpt").exists()
