"""How tests/sweep.py runs hpcpar: every command under `timeout -k`, its verdict, a run stopped by
SIGUSR1, and a checkpoint's tensors."""
from __future__ import annotations

import dataclasses
import os
import re
import shlex
import signal
import subprocess
import sys
import time

from conftest import venv_bin

ENV = {**os.environ, "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
TRAIN_TIMEOUT = 240  # seconds a training command may run
SERIAL_TIMEOUT = 120  # seconds a serial command (ckpt, generate) may run
KILL_AFTER = 10  # seconds `timeout` waits after its SIGTERM before SIGKILL
STEP_LINE = re.compile(r"^step\s+\d+/", re.MULTILINE)


@dataclasses.dataclass
class Outcome:
    """One command's ending."""
    command: list[str]
    folder: str
    rc: int
    stdout: str
    stderr: str

    def defect(self, refusal: bool = True) -> str | None:
        """Why this ending is a defect, or None: a traceback, a timeout, an exit status other than 0
        (or 2, where ``refusal`` allows one), or a 2 that is not exactly one `error:` line on stderr."""
        if "Traceback" in self.stdout + self.stderr:
            return "traceback"
        if self.rc in (124, 137, -signal.SIGKILL):
            return f"timed out (exit status {self.rc})"
        if self.rc == 2 and refusal:
            errors = sum("error:" in line for line in self.stderr.splitlines())
            return None if errors == 1 else f"exit status 2 with {errors} `error:` lines on stderr"
        return None if self.rc == 0 else f"exit status {self.rc}"

    def error_line(self) -> str:
        return next((line for line in self.stderr.splitlines() if "error:" in line), "")

    def shell(self) -> str:
        """The command as a shell line that reruns it."""
        return f"cd {shlex.quote(self.folder)} && {shlex.join(self.command)}"

    def tail(self, lines: int = 8) -> list[str]:
        text = [line for line in (self.stdout + self.stderr).splitlines() if line.strip()]
        return text[-lines:]


def hpcpar(*args: str) -> list[str]:
    return [sys.executable, "-m", "hpcpar", *args]


def mpiexec(world: int, *args: str) -> list[str]:
    return [venv_bin("mpiexec"), "-n", str(world), *args]


def train_command(world: int, keys: dict, steps: int, *flags: str) -> list[str]:
    sets = [item for key, value in keys.items() for item in ("--set", f"{key}={value}")]
    return mpiexec(world, *hpcpar("train", "job.toml", "--set", f"train.steps={steps}", *sets, *flags))


def run(command: list[str], folder: str, seconds: int = SERIAL_TIMEOUT) -> Outcome:
    """``command`` in ``folder``, killed by `timeout` after ``seconds``."""
    limited = ["timeout", "-k", str(KILL_AFTER), str(seconds), *command]
    proc = subprocess.run(limited, cwd=folder, capture_output=True, text=True, env=ENV,
                          timeout=seconds + KILL_AFTER + 30)
    return Outcome(command, folder, proc.returncode, proc.stdout, proc.stderr)


def train(folder: str, world: int, keys: dict, steps: int, *flags: str) -> Outcome:
    return run(train_command(world, keys, steps, *flags), folder, TRAIN_TIMEOUT)


def _own_group_deaf_to_usr1():
    """In the child before exec: a process group of its own (the stop signal goes to the whole group),
    and SIGUSR1 ignored, so that `timeout` at its head is not ended by it (its default action);
    mpiexec and hpcpar set handlers of their own."""
    os.setsid()
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)


def timed_train(folder: str, world: int, keys: dict, steps: int, stop: tuple[int, float] | None = None
                ) -> tuple[Outcome, float]:
    """A training run that prints its steps as they end, and the seconds from its first step line to
    its last. With ``stop`` = (step, seconds), SIGUSR1 goes to every process of the run that many
    seconds after its line of that step, if it is still running: what SLURM sends before a time limit."""
    command = train_command(world, keys, steps, "--progress", "log")
    limited = ["timeout", "-k", str(KILL_AFTER), str(TRAIN_TIMEOUT), *command]
    out, err = (open(os.path.join(folder, name), "w+") for name in ("stdout.txt", "stderr.txt"))
    with out, err:
        proc = subprocess.Popen(limited, cwd=folder, stdout=out, stderr=err, env=ENV, preexec_fn=_own_group_deaf_to_usr1)
        first, last = _watch(proc, out, stop)
        out.seek(0), err.seek(0)
        outcome = Outcome(command, folder, proc.returncode, out.read(), err.read())
    return outcome, (last - first if first is not None else 0.0)


def _watch(proc: subprocess.Popen, out, stop: tuple[int, float] | None) -> tuple[float | None, float | None]:
    """Until ``proc`` ends (`timeout` ends it at the latest): when its first and its last step line
    appeared (monotonic seconds; None without any); SIGUSR1 as ``stop`` asks."""
    first = last = signal_at = None
    seen = 0
    while proc.poll() is None:
        out.seek(0)
        count = len(STEP_LINE.findall(out.read()))
        now = time.monotonic()
        if count > seen:
            seen, last, first = count, now, first if first is not None else now
        if stop is not None and count >= stop[0]:
            signal_at = signal_at or now + stop[1]
            if now >= signal_at:
                os.killpg(proc.pid, signal.SIGUSR1)
                stop = None
        time.sleep(0.005)
    return first, last


def tensors(folder: str, step: int) -> tuple[dict, Outcome]:
    """Every global tensor of checkpoint ``step`` under ``folder``/ckpt (through `hpcpar ckpt export`),
    and the export's outcome (no tensors if it failed)."""
    import h5py

    path = os.path.join(folder, f"export-{step}.h5")
    outcome = run(hpcpar("ckpt", "export", f"ckpt/step-{step:08d}", path), folder)
    found: dict = {}
    if outcome.rc == 0 and "Traceback" not in outcome.stderr:
        with h5py.File(path, "r") as f:
            f.visititems(lambda name, obj: found.__setitem__(name, obj[()]) if isinstance(obj, h5py.Dataset) else None)
    return found, outcome
