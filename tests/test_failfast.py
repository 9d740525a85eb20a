"""Fail fast: one rank's exception ends the whole job; debug mode catches mismatched collectives."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from conftest import venv_bin
from hpcpar.runtime import CollectiveMismatchError, Communicator
from hpcpar.runtime import debug

RAISING_SCRIPT = """
import time
import numpy as np
from mpi4py import MPI
comm = MPI.COMM_WORLD
if comm.Get_rank() == 1:
    raise RuntimeError("deliberate failure on rank one")
comm.Allreduce(np.ones(1), np.empty(1))   # rank 0 would wait here forever
time.sleep(60)
"""


def run_mpi(args, n, timeout):
    """The finished job; one still running at ``timeout`` (a rank left waiting) fails the test."""
    return subprocess.run([venv_bin("mpiexec"), "-n", str(n), *args], capture_output=True, text=True, timeout=timeout)


def test_hpcpar_run_aborts_the_job_when_rank_1_raises(tmp_path):
    script = tmp_path / "boom.py"
    script.write_text(RAISING_SCRIPT)
    proc = run_mpi([venv_bin("hpcpar"), "run", str(script)], n=2, timeout=30)
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0  # promptly: rank 0 would sleep past the timeout
    assert "rank 1 of 2 failed" in output and "deliberate failure on rank one" in output
    assert output.count("Traceback") == 1


def test_fail_fast_helper_in_a_users_script(tmp_path):
    script = tmp_path / "helper.py"
    script.write_text("from hpcpar.runtime import fail_fast\nwith fail_fast():\n" +
                      "".join("    " + line + "\n" for line in RAISING_SCRIPT.strip().splitlines()))
    proc = run_mpi([sys.executable, str(script)], n=2, timeout=30)
    assert proc.returncode != 0
    assert "rank 1 of 2 failed" in proc.stderr


def test_a_plain_script_after_hpcpar_init_aborts_the_job_when_rank_1_raises(tmp_path):
    """`mpiexec -n 2 python script.py`, no `hpcpar run`: init() installs the fail-fast hooks."""
    script = tmp_path / "plain.py"
    script.write_text("import hpcpar\nctx = hpcpar.init()\n" + RAISING_SCRIPT)
    proc = run_mpi([sys.executable, str(script)], n=2, timeout=30)
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0, output
    assert "rank 1 of 2 failed" in output and output.count("Traceback") == 1


HOOKS_SCRIPT = """
import json, sys, threading
import hpcpar
if sys.argv[2] == "own":
    sys.excepthook = lambda *exc: None
ctx = hpcpar.init(**json.loads(sys.argv[1]))
if ctx.rank == 0:
    print(json.dumps([ctx.host["fail_fast"], sys.excepthook.__name__, threading.excepthook.__name__]))
"""


@pytest.mark.parametrize("kwargs, env, hook, expected", [
    ({}, {}, "python's", ["on: an uncaught exception on any rank aborts the job; a rank that ends its program "
                          "answers the stall census at its exit", "_abort", "_thread_hook"]),
    ({"fail_fast": False}, {}, "python's", ["left alone (init(fail_fast=False))", "excepthook", "_excepthook"]),
    ({}, {"HPCPAR_FAIL_FAST": "0"}, "python's", ["left alone (HPCPAR_FAIL_FAST=0)", "excepthook", "_excepthook"]),
    ({}, {}, "own", ["on: an uncaught exception on any rank aborts the job (the application's own sys.excepthook "
                     "kept); a rank that ends its program answers the stall census at its exit", "<lambda>",
                     "_thread_hook"]),
], ids=["default", "init-argument", "environment", "the-applications-hook"])
def test_init_installs_fail_fast_unless_told_not_to(tmp_path, kwargs, env, hook, expected):
    script = tmp_path / "hooks.py"
    script.write_text(HOOKS_SCRIPT)
    proc = subprocess.run([venv_bin("mpiexec"), "-n", "2", sys.executable, str(script), json.dumps(kwargs), hook],
                          capture_output=True, text=True, timeout=60, env={**os.environ, **env})
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.splitlines()[-1]) == expected


def test_python_dash_m_hpcpar_runs_the_cli():
    proc = subprocess.run([sys.executable, "-m", "hpcpar", "info"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "world size    1" in proc.stdout and "parallel HDF5" in proc.stdout


@pytest.mark.mpi(min_size=2)
def test_debug_mode_names_the_ranks_with_another_shape(world):
    comm = Communicator(world, "world")
    debug.set_enabled(True)
    try:
        shape = (3,) if comm.rank == comm.size - 1 else (4,)
        with pytest.raises(CollectiveMismatchError) as error:
            comm.allreduce(np.ones(shape))
        ranks = list(range(comm.size - 1))
        assert f"ranks {ranks}: allreduce shape (4,)" in str(error.value)
        assert f"ranks [{comm.size - 1}]: allreduce shape (3,)" in str(error.value)
        # Agreeing calls still go through, and uncounted checks leave the traffic figures alone.
        comm.stats.reset()
        comm.allreduce(np.ones(2))
        assert comm.stats.calls("allreduce") == 1
    finally:
        debug.set_enabled(False)


@pytest.mark.mpi(min_size=2)
def test_debug_mode_names_a_different_operation(world):
    comm = Communicator(world, "world")
    debug.set_enabled(True)
    try:
        with pytest.raises(CollectiveMismatchError, match="broadcast"):
            if comm.rank == 0:
                comm.broadcast(np.ones(2))
            else:
                comm.allreduce(np.ones(2))
    finally:
        debug.set_enabled(False)


MISMATCH_SCRIPT = """
import time
import numpy as np
from mpi4py import MPI
from hpcpar.runtime import Communicator, debug
debug.set_enabled(True)
world = MPI.COMM_WORLD
pairs = Communicator(world.Split(int(world.Get_rank() >= 1), world.Get_rank()), "pairs")
if world.Get_rank() >= 1:  # world ranks 1 and 2 are ranks 0 and 1 of "pairs"
    pairs.allreduce(np.ones(3 if world.Get_rank() == 2 else 4))
time.sleep(60)  # world rank 0 is elsewhere: the abort must reach it too
"""


def test_a_debug_mismatch_is_reported_once_with_world_ranks(tmp_path):
    script = tmp_path / "mismatch.py"
    script.write_text(MISMATCH_SCRIPT)
    proc = run_mpi([venv_bin("hpcpar"), "run", str(script)], n=3, timeout=60)
    assert proc.returncode != 0
    assert proc.stderr.count("Traceback") == 1 and "rank 1 of 3 failed" in proc.stderr, proc.stderr
    assert "ranks [0]: allreduce shape (4,) dtype float64 (world ranks [1])" in proc.stderr
    assert "ranks [1]: allreduce shape (3,) dtype float64 (world ranks [2])" in proc.stderr
