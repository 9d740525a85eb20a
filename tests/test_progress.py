"""What a user sees while a job trains: a live bar in a terminal (under mpiexec too), plain
log lines with elapsed time and ETA in a batch job's log."""
import fcntl
import os
import pty
import re
import select
import struct
import subprocess
import sys
import termios
import time

import pytest

from conftest import REPO, venv_bin
from hpcpar.train.progress import clock

STEPS = 6
SMALL = ["--set", f"train.steps={STEPS}", "--set", "train.eval_interval=3", "--set", "train.log_interval=2",
         "--set", "model.n_layer=2", "--set", "model.n_embd=32", "--set", "data.batch_size=8"]


def train_command(tmp_path, token_file, *options):
    return [venv_bin("mpiexec"), "-n", "2", sys.executable, "-m", "hpcpar", "train", os.path.join(REPO, "jobs", "gpt-dp.toml"),
            *SMALL, "--set", f'data.path="{token_file}"', "--set", f'checkpoint.dir="{tmp_path}/ckpt"',
            "--set", f'train.metrics="{tmp_path}/metrics.jsonl"', *options]


def run_in_terminal(argv, timeout=180, columns=120) -> bytes:
    """Run ``argv`` with a pseudo-terminal as its controlling terminal and stdio, as a user would."""
    pid, fd = pty.fork()
    if pid == 0:  # the child: its terminal is the pty
        os.environ.update(OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1")
        os.execv(argv[0], argv)
    fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", 40, columns, 0, 0))
    output, deadline = b"", time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([fd], [], [], 0.2)
            if ready:
                try:
                    chunk = os.read(fd, 65536)
                except OSError:  # EIO: every process holding the terminal has gone
                    break
                if not chunk:
                    break
                output += chunk
            elif os.waitpid(pid, os.WNOHANG)[0]:
                break
        else:
            os.kill(pid, 9)
            pytest.fail(f"{argv} did not finish in {timeout} s:\n{output.decode(errors='replace')}")
    finally:
        os.close(fd)
    try:
        _, status = os.waitpid(pid, 0)
    except ChildProcessError:
        status = 0
    assert os.waitstatus_to_exitcode(status) == 0, output.decode(errors="replace")
    return output


def screen_lines(raw: bytes) -> list[str]:
    """The lines a terminal shows: each line's carriage returns overwrite it from its first column."""
    lines = []
    for line in raw.decode(errors="replace").replace("\r\n", "\n").split("\n"):
        shown = ""
        for piece in line.split("\r"):
            shown = piece + shown[len(piece):]
        lines.append(shown.rstrip())
    return lines


BAR = re.compile(r"train +\d+%\|[^|]*\| (\d+)/6 \[(\d\d:\d\d)<(\d\d:\d\d|\?), +[\d.?]+ ?(?:step/s|s/step)"
                 r"(?:, loss (\d+\.\d{4}), [\d,]+ tok/s)?\]")


def test_the_bar_under_mpiexec_in_a_terminal_is_rewritten_in_place(tmp_path, token_file):
    raw = run_in_terminal(train_command(tmp_path, token_file, "--progress", "bar"))
    text = raw.decode(errors="replace")
    states = [m for m in BAR.finditer(text)]
    assert len({m.group(1) for m in states}) >= STEPS - 1, text  # (nearly) every step drew the bar
    assert any(m.group(3) != "?" and m.group(4) for m in states), text  # an ETA and the loss
    # rewritten in place: from one state of the bar to the next only carriage returns, no new line
    updates = [text[a.end():b.start()] for a, b in zip(states, states[1:]) if int(b.group(1)) == int(a.group(1)) + 1]
    assert updates and all("\n" not in between for between in updates if "val_loss" not in between), text
    shown = screen_lines(raw)
    evaluation = [line for line in shown if "val_loss" in line]
    assert evaluation and all(re.fullmatch(r"step 3: val_loss \d+\.\d{4}|val_loss \d+\.\d{4} after 6 steps", line) for line in evaluation), shown
    assert any(BAR.search(line) and " 6/6 " in line for line in shown), shown  # the bar stays, finished
    assert len(evaluation) == 2 and not any("val_loss" in line and BAR.search(line) for line in shown)


def test_a_batch_job_logs_lines_with_elapsed_time_and_eta(tmp_path, token_file):
    proc = subprocess.run(train_command(tmp_path, token_file), capture_output=True, text=True, timeout=180,
                          env={**os.environ, "OPENBLAS_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = [line for line in proc.stdout.splitlines() if line.startswith("step ") and "/6" in line]
    assert [line.split()[1] for line in lines] == ["1/6", "2/6", "4/6", "6/6"], proc.stdout
    for line in lines:
        assert re.search(r"elapsed \d+:\d\d:\d\d  ETA (\d+:\d\d:\d\d)$", line), line
    assert lines[-1].endswith("ETA 0:00:00") and "\r" not in proc.stdout + proc.stderr


def test_progress_none_prints_no_step_lines(tmp_path, token_file):
    proc = subprocess.run(train_command(tmp_path, token_file, "--progress", "none"), capture_output=True, text=True,
                          timeout=180, env={**os.environ, "OPENBLAS_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert not any(line.startswith("step ") and "/6" in line for line in proc.stdout.splitlines())
    assert "val_loss" in proc.stdout  # evaluations are log lines, not progress


def test_clock():
    assert clock(0) == "0:00:00" and clock(65) == "0:01:05" and clock(3 * 3600 + 7) == "3:00:07"
