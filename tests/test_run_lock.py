"""One run per checkpoint folder (``hpcpar.train.run_lock``): a second run on a folder exits 2
naming the holder before it writes anything, a holder killed by SIGKILL is taken over by the
next run with one line, and where the file system has no working locks the record decides."""
import errno
import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from conftest import REPO
from hpcpar.train import run_lock
from hpcpar.train.config import JobError

JOB = os.path.join(REPO, "jobs", "gpt-dp.toml")


def start_train(tmp_path, token_file, *overrides, steps=2, flags=()):
    sets = [f'checkpoint.dir="{tmp_path}/ckpt"', f'data.path="{token_file}"', f"train.steps={steps}",
            "train.eval_interval=0", "train.sample_tokens=0", "model.n_embd=32", "model.n_layer=1", *overrides]
    return subprocess.Popen([sys.executable, "-m", "hpcpar", "train", JOB, "--progress", "log", *flags,
                             *[a for s in sets for a in ("--set", s)]],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
                            env={**os.environ, "OPENBLAS_NUM_THREADS": "1"})


def record(tmp_path) -> dict:
    with open(tmp_path / "ckpt" / run_lock.LOCK_NAME) as f:
        return json.load(f)


def test_two_runs_started_at_once_one_trains_and_a_killed_holder_is_taken_over(tmp_path, token_file):
    runs = [start_train(tmp_path, token_file, "train.max_seconds=120", steps=1_000_000) for _ in range(2)]
    deadline = time.monotonic() + 120
    while all(r.poll() is None for r in runs) and time.monotonic() < deadline:
        time.sleep(0.05)
    refused = next(r for r in runs if r.poll() is not None)
    holder = next(r for r in runs if r is not refused)
    output = refused.stdout.read()
    assert refused.returncode == 2, output
    assert f"is in use by another run (pid {holder.pid} on {os.uname().nodename}" in output, output
    assert output.count("error:") == 1 and "starting fresh" not in output and not re.search(r"step\s+\d+/", output), output
    assert holder.poll() is None, "the holder trains on"
    os.killpg(holder.pid, signal.SIGKILL)
    holder.wait(timeout=30)
    assert record(tmp_path)["ended"] is None  # killed: the record was not closed, the kernel dropped the lock

    successor = start_train(tmp_path, token_file)
    output = successor.stdout.read()
    assert successor.wait(timeout=120) == 0, output
    assert f"took over the lock of a run that ended without releasing it (pid {holder.pid}" in output, output
    assert record(tmp_path)["ended"] and record(tmp_path)["pid"] == successor.pid

    after = start_train(tmp_path, token_file, steps=3)  # a clean end leaves nothing to take over
    output = after.stdout.read()
    assert after.wait(timeout=120) == 0, output
    assert "took over" not in output and "resumed from" in output, output


def test_overwrite_moves_the_lock_with_the_old_folder_and_holds_a_new_one(tmp_path, token_file):
    first = start_train(tmp_path, token_file)
    assert first.wait(timeout=120) == 0, first.stdout.read()
    again = start_train(tmp_path, token_file, 'checkpoint.resume="never"', flags=("--overwrite",))
    output = again.stdout.read()
    assert again.wait(timeout=120) == 0, output
    aside = [name for name in os.listdir(tmp_path) if name.startswith("ckpt.old")]
    assert len(aside) == 1
    with open(tmp_path / aside[0] / run_lock.LOCK_NAME) as f:
        old = json.load(f)
    assert old["ended"] and old["pid"] == again.pid  # the run that moved it ended its record there
    assert record(tmp_path)["ended"] and record(tmp_path)["pid"] == again.pid


def test_a_metrics_file_on_the_lock_is_refused(tmp_path, token_file):
    proc = start_train(tmp_path, token_file, f'train.metrics="{tmp_path}/ckpt/run.lock"')
    output = proc.stdout.read()
    assert proc.wait(timeout=60) == 2, output
    assert "is checkpoint.dir's run lock ('run.lock'" in output, output


@pytest.fixture
def sleeper():
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    time.sleep(0.2)
    yield proc
    proc.kill()
    proc.wait()


def holder_of(pid: int) -> dict:
    return {**run_lock.own_record(), "pid": pid, "pid_start": run_lock._start_ticks(pid)}


def test_holder_alive_tells_a_live_process_from_a_gone_or_reused_one(sleeper):
    assert run_lock.holder_alive(holder_of(sleeper.pid)) is True
    assert run_lock.holder_alive({**holder_of(sleeper.pid), "pid_start": -1}) is False  # its pid, reused
    assert run_lock.holder_alive({**holder_of(sleeper.pid), "ended": "2026-01-01T00:00:00Z"}) is False
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    assert run_lock.holder_alive(holder_of(dead.pid)) is False
    assert run_lock.holder_alive({"host": "another-node", "pid": 1}) is None  # cannot be told from here


def test_without_working_locks_the_record_decides(tmp_path, monkeypatch, sleeper):
    def no_locks(fd, operation):
        raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))

    monkeypatch.setattr(run_lock.fcntl, "flock", no_locks)
    root = str(tmp_path / "ckpt")
    os.makedirs(root)
    path = os.path.join(root, run_lock.LOCK_NAME)
    with open(path, "w") as f:
        json.dump(holder_of(sleeper.pid), f)
    with pytest.raises(JobError, match=f"in use by another run \\(pid {sleeper.pid}"):
        run_lock.RunLock(root, "job.toml").take()
    assert json.load(open(path))["pid"] == sleeper.pid  # nothing written

    sleeper.kill()
    sleeper.wait()
    lock = run_lock.RunLock(root, "job.toml")
    line = lock.take()
    assert "no working locks" in line and f"took over from pid {sleeper.pid}" in line
    lock.release()
