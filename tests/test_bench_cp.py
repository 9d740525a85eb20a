"""`hpcpar bench cp` runs at 2 ranks and prints its tables; its work accounting is the ring's.

No timing is asserted (a shared machine): only that the tables come out, and the arithmetic
of which chunk pairs each rank computes under the zigzag and contiguous layouts.
"""
import os
import subprocess
import sys

import pytest

from conftest import venv_bin
from hpcpar.autograd.ops.ring_attention import pairs_per_rank


def test_bench_cp_prints_its_tables_at_two_ranks():
    tiny = ["--tokens", "64", "--heads", "1", "--head-size", "8", "--block", "16", "--n-layer", "1",
            "--n-embd", "16", "--n-head", "2", "--repeats", "1", "--no-peer"]
    command = ["timeout", "18", venv_bin("mpiexec"), "-n", "2", sys.executable, "-m", "hpcpar", "bench", "cp", *tiny]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=20,
                          env={**os.environ, "OPENBLAS_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    for heading in ("command: mpiexec -n 2 hpcpar bench cp", "ring_attention forward + backward per rank",
                    "balance across ranks", "overlap: ", "GPT training step", "cp = 2 (2 ranks)", "cp = 1 (1 rank)"):
        assert heading in out, out
    rows = [line.split() for line in out.splitlines() if line.split()[:1] in (["zigzag"], ["contiguous"])]
    assert [(r[0], r[1], r[4]) for r in rows[:4]] == [("zigzag", "0", "5"), ("zigzag", "1", "5"),
                                                      ("contiguous", "0", "3"), ("contiguous", "1", "7")], out


@pytest.mark.parametrize("size", [2, 3, 4, 8])
def test_zigzag_gives_every_rank_the_same_chunk_pairs_and_contiguous_does_not(size):
    zigzag, contiguous = pairs_per_rank(size, zigzag=True), pairs_per_rank(size, zigzag=False)
    assert zigzag == [2 * size + 1] * size  # ring_attention's docstring: 2C + 1 of the 4C pairs
    assert contiguous == [4 * rank + 3 for rank in range(size)]  # chunks 2i, 2i+1: 2i+1 and 2i+2 key chunks
    assert sum(zigzag) == sum(contiguous) == size * (2 * size + 1)  # the causal triangle of 2C chunks, either way


def test_one_rank_computes_its_three_pairs():
    assert pairs_per_rank(1, zigzag=True) == pairs_per_rank(1, zigzag=False) == [3]
