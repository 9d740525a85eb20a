"""Every `hpcpar bench` runs end to end on a tiny problem and prints its table of ratios.

Only the shape of the output is checked (columns, rows, positive finite numbers): timings on
a shared machine are not asserted. `bench allreduce` is covered with the native build.
"""
import math
import subprocess
import sys

import pytest

from conftest import venv_bin


def bench(name, *args, ranks=2):
    command = [sys.executable, "-m", "hpcpar", "bench", name, *map(str, args)]
    if ranks:
        command = [venv_bin("mpiexec"), "-n", str(ranks), *command]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def table(output: str, header_start: str) -> tuple[list, list]:
    """(header cells, rows of cells) of the table whose header line starts with ``header_start``."""
    lines = output.splitlines()
    at = next(i for i, line in enumerate(lines) if line.strip().startswith(header_start))
    rows = []
    for line in lines[at + 2:]:  # past the header and its rule
        if not line.strip() or set(line.strip()) <= {"-", " "}:
            break
        rows.append(line.split())
    return lines[at].split(), rows


def positive(cell: str) -> bool:
    value = float(cell.rstrip("%"))
    return math.isfinite(value) and value > 0


def test_bench_step_times_a_training_step_in_each_precision():
    pytest.importorskip("ml_dtypes")
    output = bench("step", "--steps", 2, "--warmup", 1, "--batch", 2, "--no-torch", "--precision", "bf16", ranks=0)
    header, rows = table(output, "framework")
    assert header[:3] == ["framework", "precision", "ms/step"]
    assert [row[:2] for row in rows] == [["hpcpar", "fp32"], ["hpcpar", "bf16"]] and all(positive(r[2]) for r in rows)
    fp32_peak, bf16_peak = float(rows[0][-2]), float(rows[1][-2])  # tracemalloc bytes: not a timing
    assert rows[0][-1] == "1.00" and bf16_peak <= 0.72 * fp32_peak  # measured: 0.65 at batch 2
    assert "NumPy has no 16-bit GEMM" in output and "On a GPU" in output


def test_bench_dp_compares_the_gradient_sync_with_one_raw_all_reduce():
    header, rows = table(bench("dp", "--steps", 2, "--batch", 2), "ranks")
    assert {"path", "sync/raw", "exposed", "hidden", "weak"} <= set(header)
    assert [row[:2] for row in rows] == [["1", "-"], ["2", "MPI"], ["2", "shm"]]  # buckets by MPI, then in the window
    assert all(positive(row[header.index("sync/raw")]) for row in rows[1:])


def test_bench_ckpt_compares_save_and_load_with_raw_files():
    output = bench("ckpt", "--repeats", 1, "--n-layer", 1, "--n-embd", 32)
    rows = table(output, "bytes")[1]
    assert [row[0] for row in rows] == ["save", "load"]
    assert all(positive(row[-1]) for row in rows)
    header, rows = table(output, "blocks training ms")
    assert rows[0][:2] == ["async", "save"] and all(positive(cell) for cell in rows[0][2:])
    header, rows = table(output, "save s")
    assert rows[0][:2] == ["finite", "check"] and all(positive(cell) for cell in rows[0][2:4])
    assert "shard bytes by rank" in output


def test_bench_pipeline_compares_the_bubble_with_theory():
    header, rows = table(bench("pipeline", "--batch", 8, "--micro", 2, "--steps", 1, "--stages", 2, "--n-layer", 2),
                         "schedule")
    assert header[-1] == "bubble/(theory+comm)"
    assert [row[0] for row in rows] == ["gpipe", "1f1b", "interleaved", "zb1"]
    assert all(positive(row[-1]) for row in rows)


@pytest.mark.parametrize("ranks, slow_rank", [(2, 0), (3, 1)])
def test_bench_async_runs_every_mode(ranks, slow_rank):
    _, rows = table(bench("async", "--steps", 4, "--batch", 2, "--slow-rank", slow_rank, "--slow-factor", 2,
                          ranks=ranks), "mode")
    modes = [" ".join(row[:-8]) for row in rows]
    assert modes == ["allreduce", "allreduce (W)", "ps sync", "ps async s=1", "ps async s=4", "local SGD H=4",
                     "local SGD H=16"]
    assert all(positive(row[-7]) for row in rows)  # time s


def test_bench_async_seed_initialises_the_model():
    """``--seed`` is the seed "of the model and the batches": the model once kept seed 0 whatever it said."""
    from hpcpar.bench.async_training import bench_model

    weights = [bench_model(seed).embed.wte.weight.data for seed in (0, 0, 1)]
    assert (weights[0] == weights[1]).all() and (weights[0] != weights[2]).any()


def test_bench_net_needs_two_nodes_and_says_so():
    """On one node there is nothing to compare (its run on two nodes: tests/test_cluster.py)."""
    proc = subprocess.run([venv_bin("mpiexec"), "-n", "2", sys.executable, "-m", "hpcpar", "bench", "net"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "hpcpar bench net: needs ranks on at least 2 nodes and 2 on the first (got [2] ranks on 1 node(s))" \
        in proc.stderr
