"""Rank 0's view of a training run: a live progress bar, or log lines with elapsed time and ETA.

Modes (``hpcpar train --progress``):

- ``bar``: a tqdm bar updated every step (steps, elapsed, ETA, steps/s, tokens/s, loss) on the
  terminal the job was started from: rank 0's stderr when it is one, else the terminal of the
  launcher that started the rank through pipes (``mpiexec`` in a terminal); with no terminal
  (a batch job; ``srun`` without ``--pty``, whose ranks run under slurmstepd) it falls back
  to ``log``. While the bar shows, every log line (evaluation,
  checkpoints, warnings) is printed above it on that terminal, never glued to it.
- ``log``: a plain line every ``train.log_interval`` steps, with elapsed time and ETA.
- ``auto`` (the default): ``bar`` when rank 0's stderr is a terminal, else ``log``.
- ``none``: neither (other log lines still print).
"""
from __future__ import annotations

import os
import sys
import time

from .. import log

MODES = ("auto", "bar", "log", "none")
_PIPES = ("pipe:", "socket:")


def _parent(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])


def launcher_terminal() -> str | None:
    """The terminal of the nearest ancestor whose output is not a pipe, when it is a terminal.

    Under ``mpiexec`` a rank's output goes through pipes to the launcher, which forwards it; the
    launcher's own stderr is the user's terminal. An ancestor that writes to a file (a batch
    job's log, a redirect) ends the search: the user did not ask for a terminal.
    """
    try:
        pid = os.getpid()
        for _ in range(8):
            pid = _parent(pid)
            if pid <= 1:
                return None
            target = os.readlink(f"/proc/{pid}/fd/2")
            if target.startswith(_PIPES):
                continue
            return target if target.startswith("/dev/pts/") or target.startswith("/dev/tty") else None
    except OSError:
        return None
    return None


def open_terminal():
    """A writable stream to the user's terminal, or None: stderr, /dev/tty, or the launcher's terminal."""
    if sys.stderr.isatty():
        return sys.stderr
    for path in ("/dev/tty", launcher_terminal()):
        if path is None:
            continue
        try:
            stream = open(path, "w", buffering=1)
        except OSError:
            continue
        if stream.isatty():
            return stream
        stream.close()
    return None


def clock(seconds: float) -> str:
    """0:01:05 for 65 seconds."""
    seconds = int(round(seconds))
    return f"{seconds // 3600}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"


class Progress:
    """What rank 0 shows while training; on the other ranks every call does nothing.

    Made before the run's first log line (so that with a bar every line goes to the bar's
    terminal, in order), started at the first step by ``begin``.
    """

    def __init__(self, mode: str, total_steps: int, unit: str = "tok", show: bool = True):
        """``unit``: what a step processes (tok, img); ``show``: this is the rank that shows progress."""
        if mode not in MODES:
            raise ValueError(f"progress must be one of {', '.join(MODES)}, got {mode!r}")
        self.total, self.unit, self.start_step = total_steps, unit, 0
        self.began = time.perf_counter()
        self.rate = None  # items per second, smoothed over steps
        self.bar = self._terminal = None
        self.lines = show and mode in ("log", "auto", "bar")
        if show and (mode == "bar" or (mode == "auto" and sys.stderr.isatty())):
            self._terminal = open_terminal()
            if self._terminal is None:
                log.get_logger(__name__).info("progress: no terminal for the bar (a batch job?); log lines instead")
            else:
                self.lines = False
                log.set_console_writer(self._write_above)

    @property
    def live(self) -> bool:
        """Whether a bar shows (or will): it wants the loss of every step."""
        return self._terminal is not None

    def begin(self, start_step: int) -> None:
        """The run starts (again) at ``start_step``: elapsed time and ETA count from here."""
        self.start_step, self.began = start_step, time.perf_counter()
        if self._terminal is None:
            return
        from tqdm import tqdm

        try:  # a terminal that does not know its width (0 columns) gets a bar of 100
            sized = os.get_terminal_size(self._terminal.fileno()).columns > 0
        except OSError:
            sized = False
        self.bar = tqdm(total=self.total, initial=start_step, file=self._terminal, dynamic_ncols=sized,
                        ncols=None if sized else 100, mininterval=0, smoothing=0.3, unit="step", desc="train",
                        bar_format="{desc} {percentage:3.0f}%|{bar}| {n_fmt}/{total_fmt} "
                                   "[{elapsed}<{remaining}, {rate_fmt}{postfix}]")

    def _write_above(self, text: str, level: int) -> None:
        """A log line on the bar's terminal: above the bar (cleared, the line written, the bar redrawn)."""
        if self.bar is not None:
            self.bar.write(text, file=self._terminal)
        else:
            self._terminal.write(text + "\n")
            self._terminal.flush()

    def step(self, step: int, loss: float, items_per_step: float, step_seconds: float) -> None:
        """Every step: the bar moves on (steps, ETA, rate, tokens/s, loss)."""
        if step_seconds > 0:
            now = items_per_step / step_seconds
            self.rate = now if self.rate is None else 0.7 * self.rate + 0.3 * now
        if self.bar is not None:
            self.bar.set_postfix_str(f"loss {loss:.4f}, {self.rate or 0:,.0f} {self.unit}/s", refresh=False)
            self.bar.update(step - self.bar.n)

    def timing(self, step: int) -> str:
        """'elapsed 0:01:05  ETA 0:10:00' after ``step`` (ETA from this run's mean step time)."""
        elapsed = time.perf_counter() - self.began
        done = step - self.start_step
        eta = elapsed / done * (self.total - step) if done > 0 else float("nan")
        return f"elapsed {clock(elapsed)}  ETA {clock(eta) if eta == eta else '?'}"

    def line(self, step: int, text: str) -> None:
        """At a log interval: in log mode, ``text`` with elapsed time and ETA."""
        if self.lines:
            log.get_logger(__name__).info(f"{text}  {self.timing(step)}")

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None
        if self._terminal is not None:
            log.set_console_writer(None)
            if self._terminal is not sys.stderr:
                self._terminal.close()
        self._terminal = None
