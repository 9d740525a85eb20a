"""The raw-MPI baseline: the C benchmark runs, and `hpcpar bench allreduce` prints both columns."""
import os
import subprocess
import sys

import pytest

from conftest import REPO, venv_bin

EXECUTABLE = os.path.join(REPO, "build", "allreduce_bench")
LIBRARY = os.path.join(REPO, "build", "libhpcpar_native.so")
needs_build = pytest.mark.skipif(not os.path.exists(LIBRARY), reason="build/ not built: run `make native`")


@needs_build
def test_c_benchmark_runs_at_two_ranks():
    proc = subprocess.run([venv_bin("mpiexec"), "-n", "2", EXECUTABLE, "--quick", "--csv"], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    header, *rows = [line.split(",") for line in proc.stdout.splitlines() if line]
    assert header == ["ranks", "wait", "bytes", "iters", "avg_us", "busbw_gbs"]
    assert [int(r[2]) for r in rows][:3] == [8, 128, 2048]
    assert all(r[0] == "2" and float(r[4]) > 0 for r in rows)


@needs_build
def test_bench_allreduce_issues_the_same_calls_on_every_side():
    proc = subprocess.run([venv_bin("mpiexec"), "-n", "2", sys.executable, "-m", "hpcpar", "bench", "allreduce",
                           "--max-mib", "0.125", "--rounds", "1"], capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    lines = lines[next(i for i, line in enumerate(lines) if line.startswith("all-reduce, float32")):]  # after log lines
    header = lines[1].split()
    assert header[:5] == ["size", "in-place", "C", "mpi4py", "hpcpar"] and header.count("hpcpar/C") == 3
    same = lines[3:3 + 8]
    assert [" ".join(line.split()[:2]) for line in same] == ["8 B", "32 B", "128 B", "512 B", "2 KiB", "8 KiB",
                                                              "32 KiB", "128 KiB"]
    assert all(float(cell) > 0 for line in same for cell in line.split()[2:])
    shared = [line.split() for line in lines[3 + 8 + 4:]]
    # the shared-memory path takes over from 64 KiB; below, hpcpar hands the call to MPI
    assert [row[2] for row in shared] == ["MPI"] * 7 + ["shm"]
    assert all(float(cell) > 0 for row in shared for cell in row[3:])
