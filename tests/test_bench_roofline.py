"""`hpcpar bench roofline`: the GEMM-only time replays exactly the step's products.

One step of the bench's GPT records 75 products (per block: qkv, scores, weights @ v, the
attention projection and the two MLP layers forward, two products backward for each linear
layer and four for attention; the tied head's three) whose flops are the textbook count:
3 x (24 L C^2 + 2 C V) per token + 3 x 4 L T C per token of attention. No timing is asserted.
"""
import os
import subprocess
import sys

import numpy as np
from mpi4py import MPI

from conftest import venv_bin
from hpcpar.autograd import fused
from hpcpar.bench import roofline
from hpcpar.bench.step import BENCH_CONFIG
from hpcpar.bench.zero import make_strategy, one_step


class Args:
    batch, precision = 2, "fp32"


def test_one_step_s_products_are_recorded_with_their_textbook_flops():
    strategy = make_strategy(roofline.roofline_job(Args, 1, "fp32"), MPI.COMM_WORLD)
    c, b = BENCH_CONFIG, Args.batch
    ids = np.random.default_rng(0).integers(0, c.vocab_size, (b, c.block_size + 1))
    with roofline.recorded_products() as calls:
        one_step(strategy, ids[:, :-1], ids[:, 1:], 0.0)
    strategy.ctx.close()
    tokens, L, C, T, V = b * c.block_size, c.n_layer, c.n_embd, c.block_size, c.vocab_size
    assert len(calls) == 18 * L + 3
    assert roofline.flops(calls) == 3 * tokens * (24 * L * C * C + 2 * C * V + 4 * L * T * C)
    assert all(a.dtype == np.float32 and w.dtype == np.float32 for a, w in calls)


def test_sixteen_bit_products_are_replayed_as_the_float32_blas_calls_they_are():
    from ml_dtypes import bfloat16

    a, w = np.ones((4, 3), dtype=bfloat16), np.ones((3, 2), dtype=bfloat16)
    up = roofline.multiplied(a, w)
    assert [x.dtype for x in up] == [np.float32, np.float32]
    assert roofline.multiplied(up[0], up[1])[0] is up[0]


def test_the_bench_prints_its_rows_at_two_ranks():
    command = ["timeout", "60", venv_bin("mpiexec"), "-n", "2", sys.executable, "-m", "hpcpar", "bench", "roofline",
               "--batch", "1", "--steps", "1", "--no-torch"]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=70,
                          env={**os.environ, "OPENBLAS_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "2 ranks, one BLAS thread each (" in proc.stdout, proc.stdout
    rows = {line.strip().split("  ")[0]: line.split() for line in proc.stdout.splitlines()
            if line.strip().startswith(("hpcpar fp32", "GEMM-only"))}
    assert list(rows)[:2] == ["hpcpar fp32", "GEMM-only (75 products)"], proc.stdout
    assert rows["GEMM-only (75 products)"][-3:-1] == ["1.00", "1.00"], proc.stdout  # against itself, wall and cpu
    native = fused.status().startswith("native")
    assert ("hpcpar fp32, NumPy passes" in rows) == native, proc.stdout  # the fused passes' baseline
    assert f"elementwise passes: {fused.status()}" in proc.stdout
