"""The stall watchdog: a wait that lasts too long names the ranks that have not arrived."""
import os
import re
import subprocess
import sys

import pytest
from mpi4py import MPI

from conftest import REPO, venv_bin
from hpcpar.runtime import Communicator
from hpcpar.runtime.watchdog import StallWatchdog

STALLING_SCRIPT = """
import sys, time
import numpy as np
from mpi4py import MPI
from hpcpar.runtime import Communicator, fail_fast

case, late = sys.argv[1], float(sys.argv[2])
world = Communicator(MPI.COMM_WORLD, "world", wait_policy="yield")
with fail_fast():
    world.barrier()  # collective #1: everyone is up
    if case == "collective":
        if world.rank == 2:
            time.sleep(late)
        world.allreduce(np.ones(3))  # collective #2
    elif case == "subgroup":  # world ranks 1 and 2 as ranks 0 and 1 of 'pair'
        group = MPI.COMM_WORLD.Split(0 if world.rank > 0 else MPI.UNDEFINED, world.rank)
        pair = Communicator(group, "pair", wait_policy="yield") if world.rank > 0 else None
        if world.rank == 2:
            time.sleep(late)
        if pair is not None:
            pair.allreduce(np.ones(3))  # the pair's collective #1
    elif case == "p2p":
        if world.rank == 0:
            world.recv(np.empty(3), source=1, tag=7)
        elif world.rank == 1:
            time.sleep(late)
            world.send(np.ones(3), dest=0, tag=7)
    print(f"rank {world.rank} done", flush=True)
"""


def run_stalling(tmp_path, case, late, **env):
    script = tmp_path / "stall.py"
    script.write_text(STALLING_SCRIPT)
    return subprocess.run([venv_bin("mpiexec"), "-n", "3", sys.executable, str(script), case, str(late)],
                          capture_output=True, text=True, timeout=90,
                          env={**os.environ, "PYTHONPATH": REPO, "HPCPAR_STALL_S": "1", **env})


def stall_reports(output: str) -> list:
    return [line for line in output.splitlines() if line.startswith("hpcpar: stall:")]


def test_a_late_rank_is_named_once_and_the_job_goes_on(tmp_path):
    proc = run_stalling(tmp_path, "collective", 5)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert sorted(re.findall(r"rank (\d) done", proc.stdout)) == ["0", "1", "2"]  # lines of ranks may interleave
    reports = stall_reports(proc.stderr)
    assert reports, proc.stderr
    # reported by the lowest rank that arrived, repeated while the wait goes on (every 1 s here)
    assert all(r.startswith("hpcpar: stall: rank 0 of communicator 'world' has waited") for r in reports), reports
    # rank 1's answer may come after the first report on a loaded machine; it is in a later one
    assert any("in allreduce #2; arrived: ranks 0, 1; not arrived: rank 2 (no word" in r for r in reports), reports


def test_ranks_are_also_named_in_the_world(tmp_path):
    proc = run_stalling(tmp_path, "subgroup", 5)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    reports = stall_reports(proc.stderr)
    assert reports and "rank 0 (world 1) of communicator 'pair'" in reports[0], proc.stderr
    assert "in allreduce #1; arrived: ranks 0 (world 1); not arrived: rank 1 (world 2) (no word" in reports[0]


def test_a_point_to_point_wait_names_its_peer(tmp_path):
    proc = run_stalling(tmp_path, "p2p", 3)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    reports = stall_reports(proc.stderr)
    assert reports and all("rank 0 of communicator 'world'" in r for r in reports), proc.stderr
    assert "to receive from rank 1 (tag 7) in recv" in reports[0]


def test_stall_abort_ends_the_job_with_the_report(tmp_path):
    proc = run_stalling(tmp_path, "collective", 300, HPCPAR_STALL_ABORT_S="3")
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert "StallError" in output and "not arrived: rank 2 (no word" in output, output
    assert "rank 2 done" not in output


def test_settings_from_the_environment(monkeypatch):
    world = MPI.COMM_SELF
    monkeypatch.setenv("HPCPAR_STALL_S", "0")
    assert Communicator(world, "self").watchdog is None
    monkeypatch.setenv("HPCPAR_STALL_S", "soon")
    with pytest.raises(ValueError, match="HPCPAR_STALL_S must be a number of seconds, got 'soon'"):
        Communicator(world, "self")
    monkeypatch.setenv("HPCPAR_STALL_S", "90")
    monkeypatch.setenv("HPCPAR_STALL_ABORT_S", "30")
    watchdog = Communicator(world, "self").watchdog
    assert (watchdog.warn_seconds, watchdog.abort_seconds) == (30.0, 30.0)  # the census runs before the abort
    assert Communicator(world, "again").watchdog is watchdog  # one per MPI communicator: one numbering
    assert isinstance(watchdog, StallWatchdog)
