"""The fault campaign of a run's life across restarts: every way a user may start, stop and restart
a run, and what it must never cost. Each test asserts that nothing was lost: every checkpoint that
existed before still verifies (what `hpcpar ckpt verify` checks), `latest` names a committed step,
and a resumed run ends bitwise where an uninterrupted one does where it should.

Most runs are one process (`python -m hpcpar train`, a tiny GPT, a few steps); the layout change
and the killed rank run two ranks under mpiexec.
"""
import hashlib
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from conftest import final_parameters, prepared_tokens, venv_bin
from hpcpar.checkpoint.cli import check
from hpcpar.checkpoint.manifest import latest_step, list_steps, step_dirname

JOB = """
[model]
block_size = 16
n_layer = 1
n_head = 2
n_embd = 16
[data]
batch_size = 4
eval_batches = 1
[train]
steps = 4
log_interval = 1
[checkpoint]
interval = 2
"""


@pytest.fixture
def job(tmp_path):
    path = tmp_path / "tiny.toml"
    path.write_text(JOB)
    return str(path)


@pytest.fixture(scope="module")
def other_token_file(tmp_path_factory):
    """A second, different token file (half a MiB of the standard library)."""
    return prepared_tokens(str(tmp_path_factory.mktemp("other") / "other.h5"), 0.5)


def train(job, folder, data, *args, ranks=1, timeout=180, launcher=None, cwd=None):
    """``hpcpar train`` of the tiny job with its checkpoints and metrics under ``folder``; args: --set
    overrides (``key=value``) and options (``--resume never``); ``data`` None: the job's data.path."""
    command = [sys.executable, "-m", "hpcpar", "train", job, "--progress", "log",
               "--set", f'checkpoint.dir="{folder}/ckpt"', "--set", f'train.metrics="{folder}/metrics.jsonl"']
    command += ["--set", f'data.path="{data}"'] if data else []
    for arg in args:
        command += arg.split(" ", 1) if arg.startswith("--") else ["--set", arg]
    if launcher:
        command = launcher + command[3:]  # the launcher's script takes the command's arguments
    elif ranks > 1:
        command = [venv_bin("mpiexec"), "-n", str(ranks)] + command
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout, cwd=cwd,
                          env={**os.environ, "OPENBLAS_NUM_THREADS": "1"})


def ok(proc):
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout + proc.stderr


def refused(proc):
    """Exit 2, one error line on rank 0, no traceback."""
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.count("hpcpar train: error") == 1 and "Traceback" not in proc.stderr, proc.stderr
    return proc.stderr


def state_of(root) -> dict:
    """Every committed step of ``root`` with the digest of its files' bytes, and ``latest``."""
    state = {}
    for step in list_steps(str(root)):
        folder = os.path.join(str(root), step_dirname(step))
        digest = hashlib.sha256()
        for name in sorted(os.listdir(folder)):
            with open(os.path.join(folder, name), "rb") as f:
                digest.update(name.encode() + f.read())
        state[step] = digest.hexdigest()
    return {"steps": state, "latest": latest_step(str(root))}


def assert_nothing_lost(before: dict, root, unchanged: bool = True) -> None:
    """Every step of ``before`` is still in ``root`` and verifies; ``latest`` names a committed step
    that verifies; with ``unchanged`` the steps are byte for byte what they were and ``latest`` too."""
    after = state_of(root)
    for step in before["steps"]:
        folder = os.path.join(str(root), step_dirname(step))
        assert os.path.isdir(folder), f"step {step} of {root} was lost"
        assert check(folder) == [], f"step {step} of {root} no longer verifies: {check(folder)}"
    assert after["latest"] in after["steps"], f"latest of {root} names step {after['latest']}, not committed"
    assert check(os.path.join(str(root), step_dirname(after["latest"]))) == []
    if unchanged:
        assert after == before, f"{root} changed: {before} -> {after}"


def lrs(folder) -> dict:
    return {r["step"]: r["lr"] for r in map(json.loads, open(os.path.join(folder, "metrics.jsonl"))) if "lr" in r}


# ----- run identity ------------------------------------------------------------------------------------
def test_another_model_is_refused_and_the_run_keeps_its_checkpoints(job, tmp_path, token_file):
    ok(train(job, tmp_path, token_file))
    before = state_of(tmp_path / "ckpt")
    error = refused(train(job, tmp_path, token_file, "model.n_embd=32", "train.steps=6", "checkpoint.keep=1"))
    assert "holds another run's checkpoint (step 4)" in error and "model.n_embd: 16 in the checkpoint, 32 now" in error
    assert "--resume never --overwrite" in error and "checkpoint.dir" in error  # the ways out
    assert_nothing_lost(before, tmp_path / "ckpt")


def test_another_data_file_is_refused_and_every_difference_is_named(job, tmp_path, token_file, other_token_file):
    ok(train(job, tmp_path, token_file))
    before = state_of(tmp_path / "ckpt")
    error = refused(train(job, tmp_path, other_token_file, "model.n_layer=2", "train.steps=6"))
    for line in ("model.n_layer: 1 in the checkpoint, 2 now", "data.tokens: 1048576 in the checkpoint, 524288 now",
                 "data.sample_sha256", "data.bytes"):
        assert line in error, error
    assert_nothing_lost(before, tmp_path / "ckpt")
    # the same data under another path is the same run: a moved file resumes, and says so
    moved = str(tmp_path / "moved.h5")
    os.link(token_file, moved) if os.stat(token_file).st_dev == os.stat(tmp_path).st_dev else \
        __import__("shutil").copyfile(token_file, moved)
    text = ok(train(job, tmp_path, moved, "train.steps=6", "checkpoint.keep=10"))
    assert "resumed from" in text and f"data.path: {token_file} in the checkpoint, {moved} now" in text
    assert_nothing_lost(before, tmp_path / "ckpt", unchanged=False)


def test_another_learning_rate_and_clip_resume_with_one_line_each(job, tmp_path, token_file):
    ok(train(job, tmp_path, token_file))
    before = state_of(tmp_path / "ckpt")
    text = ok(train(job, tmp_path, token_file, "optimizer.lr=0.002", "optimizer.grad_clip=1.0"))
    assert "resumed from" in text and "step 4" in text and "fingerprint" in text
    assert "optimizer.grad_clip: 0.0 in the checkpoint, 1.0 now (allowed" in text
    assert "nothing to do: the checkpoint is at step 4, train.steps = 4" in text  # and it trained nothing
    assert "val_loss" not in text and "step     " not in text
    assert_nothing_lost(before, tmp_path / "ckpt")
    text = ok(train(job, tmp_path, token_file, "optimizer.lr=0.002", "train.steps=5", "checkpoint.keep=10"))
    assert "learning-rate schedule from the job, not the checkpoint: optimizer.lr 0.001 -> 0.002, train.steps 4 -> 5" in text
    assert lrs(tmp_path)[5] == pytest.approx(0.002 * 0.5 * (1 + np.cos(np.pi * 4 / 5)))  # the job's lr and length
    assert_nothing_lost(before, tmp_path / "ckpt", unchanged=False)


def test_another_layout_resumes_resharded(job, tmp_path, token_file):
    ok(train(job, tmp_path, token_file, "train.steps=2", ranks=2))
    before = state_of(tmp_path / "ckpt")
    text = ok(train(job, tmp_path, token_file, "train.steps=4"))
    assert "layout: dp 2 x pp 1 x tp 1 in the checkpoint, dp 1 x pp 1 x tp 1 now (allowed: resharded)" in text
    assert "step     4/4" in text
    assert_nothing_lost(before, tmp_path / "ckpt", unchanged=False)


# ----- the resume policy ------------------------------------------------------------------------------
def test_a_fresh_run_into_a_used_folder_is_refused_or_moves_the_old_run_aside(job, tmp_path, token_file):
    ok(train(job, tmp_path, token_file, "train.steps=6"))
    before = state_of(tmp_path / "ckpt")
    error = refused(train(job, tmp_path, token_file, "--resume never", "train.steps=2", "checkpoint.keep=1"))
    assert "holds checkpoints (steps 4, 6)" in error and "--overwrite" in error
    assert_nothing_lost(before, tmp_path / "ckpt")
    text = ok(train(job, tmp_path, token_file, "--resume never", "--overwrite", "train.steps=2", "checkpoint.keep=1"))
    assert f"moving {tmp_path}/ckpt (steps 4, 6) aside to {tmp_path}/ckpt.old-1; nothing is deleted" in text
    assert_nothing_lost(before, tmp_path / "ckpt.old-1")  # the old run, whole, under its new name
    assert state_of(tmp_path / "ckpt") == {"steps": {2: state_of(tmp_path / "ckpt")["steps"][2]}, "latest": 2}
    # one metrics file per run: the old one renamed with its run id, the new one holds the new run only
    old = [name for name in os.listdir(tmp_path) if name.startswith("metrics.") and name != "metrics.jsonl"]
    assert len(old) == 1 and max(json.loads(line)["step"] for line in open(tmp_path / old[0])) == 6
    assert max(json.loads(line)["step"] for line in open(tmp_path / "metrics.jsonl")) == 2


def test_auto_starts_fresh_in_an_empty_folder_and_must_refuses_it(job, tmp_path, token_file):
    error = refused(train(job, tmp_path / "new", token_file, "--resume must"))
    assert f"--resume must: no checkpoint in {tmp_path}/new/ckpt" in error
    assert not os.path.exists(tmp_path / "new")  # refused before anything is written: not even the metrics' folder
    text = ok(train(job, tmp_path, token_file, "train.steps=2"))
    assert f"starting fresh: no checkpoint in {tmp_path}/ckpt" in text
    for name in ("job.toml", "command.txt", "env.json", "run.json"):  # the run folder's provenance
        assert os.path.isfile(tmp_path / "ckpt" / name), name
    assert "world size 1" in open(tmp_path / "ckpt" / "command.txt").read()
    env = json.load(open(tmp_path / "ckpt" / "env.json"))
    assert {"hpcpar", "python", "numpy", "mpi4py", "mpi_library", "h5py", "hdf5", "hosts"} <= set(env)
    before = state_of(tmp_path / "ckpt")
    text = ok(train(job, tmp_path, token_file, "--resume must", "train.steps=4"))
    assert f"resumed from {tmp_path}/ckpt/step-00000002 (step 2, fingerprint" in text
    records = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert any(r.get("event") == "resume" and r["step"] == 2 for r in records)
    assert_nothing_lost(before, tmp_path / "ckpt", unchanged=False)
    inspect = subprocess.run([sys.executable, "-m", "hpcpar", "ckpt", "inspect", str(tmp_path / "ckpt")],
                             capture_output=True, text=True, timeout=60)
    for line in ("run         ", "command     hpcpar train", "versions    hpcpar", "hosts       ", "fingerprint model:"):
        assert line in inspect.stdout, inspect.stdout


def test_a_step_folder_resumes_and_weights_only_starts_a_new_run(job, tmp_path, token_file, other_token_file):
    ok(train(job, tmp_path / "a", token_file))
    before = state_of(tmp_path / "a" / "ckpt")
    source = f"{tmp_path}/a/ckpt/step-00000002"
    text = ok(train(job, tmp_path / "b", token_file, f"--resume {source}"))
    assert f"resumed from {source} (step 2" in text and "step     4/4" in text
    a, b = final_parameters(tmp_path / "a" / "ckpt"), final_parameters(tmp_path / "b" / "ckpt")
    assert all(np.array_equal(a[k], b[k]) for k in a)  # from step 2 again: the same step 4, bit for bit
    # another data file: a full resume is refused, the weights alone are taken
    assert "data.tokens" in refused(train(job, tmp_path / "c", other_token_file, f"--resume {source}"))
    text = ok(train(job, tmp_path / "c", other_token_file, f"--resume {source}", "--load-weights-only"))
    assert f"initialised from the weights of {source} (step 2" in text and "step     4/4" in text
    assert json.load(open(tmp_path / "c" / "ckpt" / "run.json"))["started_from"] == source
    # continuing from a step folder into a folder that holds another run: refused, or that run moved aside
    other_run = state_of(tmp_path / "c" / "ckpt")
    assert "of another run than" in refused(train(job, tmp_path / "c", token_file, f"--resume {source}"))
    assert_nothing_lost(other_run, tmp_path / "c" / "ckpt")
    text = ok(train(job, tmp_path / "c", token_file, f"--resume {source}", "--overwrite"))
    assert f"aside to {tmp_path}/c/ckpt.old-1; nothing is deleted" in text and f"resumed from {source}" in text
    assert_nothing_lost(other_run, tmp_path / "c" / "ckpt.old-1")
    # the weights of another model do not fit, and --load-weights-only needs a step folder
    error = refused(train(job, tmp_path / "d", token_file, f"--resume {source}", "--load-weights-only", "model.n_embd=32"))
    assert "model.n_embd: 16 in the checkpoint, 32 now" in error
    assert "--load-weights-only takes the weights of a step folder" in refused(
        train(job, tmp_path / "d", token_file, "--load-weights-only"))
    assert_nothing_lost(before, tmp_path / "a" / "ckpt")


def test_auto_refuses_to_start_over_a_folder_whose_checkpoints_are_all_damaged(job, tmp_path, token_file):
    ok(train(job, tmp_path, token_file))
    for step in (2, 4):  # truncate every shard: nothing loads
        shard = tmp_path / "ckpt" / step_dirname(step) / "shard-00000.h5"
        shard.write_bytes(shard.read_bytes()[:100])
    before = state_of(tmp_path / "ckpt")
    error = refused(train(job, tmp_path, token_file, "train.steps=6"))
    assert f"no checkpoint in {tmp_path}/ckpt loads" in error and "nothing was written" in error
    assert state_of(tmp_path / "ckpt") == before  # the damaged steps are still there to repair


def test_extending_train_steps_follows_the_jobs_schedule(job, tmp_path, token_file):
    ok(train(job, tmp_path / "short", token_file, "train.steps=4", "lr_schedule.min_lr=0.0001"))
    text = ok(train(job, tmp_path / "short", token_file, "train.steps=8", "lr_schedule.min_lr=0.0001"))
    assert "learning-rate schedule from the job, not the checkpoint: train.steps 4 -> 8 (from step 4 on" in text
    ok(train(job, tmp_path / "long", token_file, "train.steps=8", "lr_schedule.min_lr=0.0001"))
    extended, straight = lrs(tmp_path / "short"), lrs(tmp_path / "long")
    assert [extended[s] for s in range(5, 9)] == [straight[s] for s in range(5, 9)]  # not min_lr for steps 5-8
    assert extended[5] > 0.0001


def test_a_missing_data_path_is_an_error_with_the_command_to_make_it(job, tmp_path):
    typo = str(tmp_path / "data" / "typo2.h5")
    error = refused(train(job, tmp_path, typo))
    assert f"hpcpar data prepare --out {typo}" in error and "Only the built-in corpus" in error
    assert not os.path.exists(typo) and not os.path.exists(tmp_path / "ckpt")
    # the built-in corpus at its default path is prepared on first use, and the run says so
    text = ok(train(job, tmp_path, None, "train.steps=1", "checkpoint.interval=0", cwd=tmp_path))
    assert "data/stdlib.h5 is missing: preparing it once from the Python standard library" in text
    assert os.path.isfile(tmp_path / "data" / "stdlib.h5") and "wrote data/stdlib.h5" in text


# ----- crashes ----------------------------------------------------------------------------------------
KILLER = """
import os, signal, sys
from mpi4py import MPI
from hpcpar.train.strategies.allreduce import AllReduce

step = {"n": 0}
finish = AllReduce.finish_step


def finish_step(self, max_norm, loss):  # rank 1 dies mid-step 6: gradients exchanged, no update
    step["n"] += 1
    if step["n"] == 6 and MPI.COMM_WORLD.Get_rank() == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    return finish(self, max_norm, loss)


AllReduce.finish_step = finish_step
from hpcpar.cli import main
main(sys.argv[1:])
"""


def test_a_rank_killed_mid_step_leaves_the_last_checkpoint_and_resumes_bitwise(job, tmp_path, token_file):
    killer = tmp_path / "killer.py"
    killer.write_text(KILLER)
    steps = ["train.steps=8", "model.n_embd=32"]
    ok(train(job, tmp_path / "straight", token_file, *steps, ranks=2))
    crashed = train(job, tmp_path / "killed", token_file, *steps,
                    launcher=[venv_bin("mpiexec"), "-n", "2", sys.executable, str(killer)])
    assert crashed.returncode != 0 and "step     5/8" in crashed.stdout and "step     6/8" not in crashed.stdout
    before = state_of(tmp_path / "killed" / "ckpt")
    assert before["latest"] == 4 and set(before["steps"]) == {2, 4}
    assert_nothing_lost(before, tmp_path / "killed" / "ckpt")
    text = ok(train(job, tmp_path / "killed", token_file, *steps, "checkpoint.keep=10", ranks=2))
    assert "resumed from" in text and "step 4" in text
    a, b = final_parameters(tmp_path / "straight" / "ckpt"), final_parameters(tmp_path / "killed" / "ckpt")
    assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)
    assert_nothing_lost(before, tmp_path / "killed" / "ckpt", unchanged=False)


EXIT = """
import sys
from mpi4py import MPI
if MPI.COMM_WORLD.Get_rank() == 1:
    sys.exit(3)
MPI.COMM_WORLD.Barrier()   # rank 0 would wait here forever
"""


def test_sys_exit_on_one_rank_ends_the_job_with_its_status(tmp_path):
    script = tmp_path / "exit3.py"
    script.write_text(EXIT)
    proc = subprocess.run([venv_bin("mpiexec"), "-n", "2", sys.executable, "-m", "hpcpar", "run", str(script)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert proc.stderr.count("rank 1 of 2 exited: exit status 3") == 1, proc.stderr


def test_a_checkpoint_that_does_not_fit_is_one_line_and_exit_2(job, tmp_path, token_file):
    """A checkpoint that carries no identity (written by a Python loop: no fingerprint, no model
    config) whose shapes do not fit the model: the load refuses it on every rank, one line, exit 2."""
    ok(train(job, tmp_path, token_file))
    for step in list_steps(str(tmp_path / "ckpt")):
        path = tmp_path / "ckpt" / step_dirname(step) / "manifest.json"
        manifest = json.loads(path.read_text())
        manifest["extra"].pop("fingerprint")
        manifest["extra"].pop("model_config")
        path.write_text(json.dumps(manifest))
    before = state_of(tmp_path / "ckpt")
    error = refused(train(job, tmp_path, token_file, "model.n_embd=32", "train.steps=6"))
    assert "nothing was loaded or written" in error, error
    assert_nothing_lost(before, tmp_path / "ckpt")
