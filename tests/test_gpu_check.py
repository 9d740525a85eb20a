"""``make gpu-check`` (hpcpar.bench.gpu_check) without a GPU: it says "no GPU" and exits 0, and its
parts run here on the transfer guard's device with the NCCL double (the numbers are CPU numbers,
checked for shape and consistency only, never presented as GPU figures)."""
import os
import shutil
import subprocess
import sys

import pytest
from mpi4py import MPI

import nccl_double
from hpcpar.bench import gpu_check
from hpcpar.bench.gpu_report import format_report
from hpcpar.runtime.context import init
from hpcpar.nn.gpt import GPTConfig

from conftest import REPO

TINY = GPTConfig(vocab_size=32, block_size=8, n_layer=1, n_head=2, n_embd=16, seed=0)


def test_without_a_gpu_it_says_so_and_exits_0(tmp_path):
    report = tmp_path / "report.md"
    result = subprocess.run([sys.executable, "-m", "hpcpar.bench.gpu_check", "--report", str(report)],
                            capture_output=True, text=True, timeout=120, cwd=tmp_path,
                            env={**os.environ, "PYTHONPATH": REPO})
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("no GPU: CuPy is not installed")
    text = report.read_text()
    assert "no GPU: CuPy is not installed" in text and "Nothing was run or measured." in text


@pytest.mark.skipif(not shutil.which("make"), reason="needs make")
def test_make_gpu_check_says_no_gpu_even_on_a_bare_python(tmp_path):
    """The target as a GPU machine runs it, here with a Python that has not even NumPy if there is one."""
    bare = "/usr/bin/python3" if os.path.exists("/usr/bin/python3") else sys.executable
    report = tmp_path / "report.md"
    result = subprocess.run(["make", "-s", "-C", REPO, "gpu-check", f"GPU_PYTHON={bare}", f"GPU_REPORT={report}"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "no GPU: CuPy is not installed" in result.stdout and "no GPU" in report.read_text()


def test_the_makefile_target_runs_it_under_eight_minutes():
    makefile = open(os.path.join(REPO, "Makefile")).read()
    recipe = makefile[makefile.index("\ngpu-check:"):].splitlines()[2]
    assert "timeout -k 15" in makefile and "$(TIMEOUT) 480" in recipe and "-m hpcpar.bench.gpu_check" in recipe


def test_step_times_on_the_guard_against_pytorch_cpu():
    pytest.importorskip("torch")
    rows = gpu_check.step_times("guard", ("fp32", "bf16", "fp16"), steps=1, warmup=0, torch_device="cpu",
                                config=TINY, batch_size=2)
    fp32, bf16, fp16 = rows
    assert fp32["hpcpar_ms"] > 0 and fp32["pytorch_ms"] > 0 and fp32["ratio"] == fp32["hpcpar_ms"] / fp32["pytorch_ms"]
    layers = TINY.n_layer  # the step's own products, recorded on the guard's device arrays and replayed alone
    assert fp32["products"] == 18 * layers + 3 and fp32["vs_gemm"] == fp32["hpcpar_ms"] / fp32["gemm_ms"]
    assert "needs bfloat16 arrays" in bf16["error"]  # the guard, like CuPy, has no bfloat16
    assert fp16["hpcpar_tokens_s"] > 0


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("backend", ["nccl", "mpi"])
def test_bandwidth_and_checkpoint_parts_on_the_guard(backend, tmp_path_factory):
    ctx = init(dp=MPI.COMM_WORLD.Get_size(), device="guard", backend=backend, runtime=nccl_double.runtime(),
               shm=False)
    rows = gpu_check.allreduce_bandwidth(ctx.dp, ctx.xp, sizes=[8, 1024, 1 << 16])
    assert [row["bytes"] for row in rows] == [8, 1024, 1 << 16]
    n = ctx.dp.size
    for row in rows:
        assert row["busbw_GBps"] == pytest.approx(row["algbw_GBps"] * 2 * (n - 1) / n)
    assert ctx.world.allgather_object(rows) == [rows] * n  # every rank reports the slowest rank's figures
    folder = ctx.world.bcast_object(str(tmp_path_factory.mktemp("ckpt")) if ctx.rank == 0 else None)
    result = gpu_check.checkpoint_roundtrip(ctx, folder)
    assert result["equal"] and result["on_device"]


def test_run_matrix_skips_what_cannot_run_here():
    """(What runs is run by the whole check below.)"""
    rows = gpu_check.run_matrix(sys.executable, "mpiexec", {"mpi-staged": None, "mpi-cuda-aware": "not CUDA-aware",
                                                            "nccl": None}, gpus=1, budget=gpu_check.Budget(0))
    by = {(row["backend"], row["ranks"]): row["result"] for row in rows}
    assert by == {("mpi-staged", 1): "not run: time budget spent", ("mpi-staged", 2): "not run: time budget spent",
                  ("mpi-cuda-aware", 1): "skipped: not CUDA-aware", ("mpi-cuda-aware", 2): "skipped: not CUDA-aware",
                  ("nccl", 1): "not run: time budget spent", ("nccl", 2): "skipped: NCCL needs one GPU per rank"}


def test_the_report_and_summary_of_a_full_run():
    facts = {"python": "3", "cupy": "13.3.0", "gpus": 1, "why": None, "nccl": True, "torch": "2.5", "torch_cuda": True,
             "gpu_name": "a GPU"}
    results = {"commands": {"matrix": "mpiexec ...", "workers": "mpiexec ..."},
               "matrix": [{"backend": "nccl", "ranks": 1, "result": "4 passed in 1s", "seconds": 1.0, "log": ""},
                          {"backend": "nccl", "ranks": 2, "result": "FAILED (exit 1)", "seconds": 2.0, "log": "boom"}],
               "reference": "PyTorch CUDA",
               "step": [{"precision": "fp32", "hpcpar_ms": 10.0, "hpcpar_tokens_s": 100.0, "gemm_ms": 8.0, "vs_gemm": 1.25,
                         "products": 75, "pytorch_ms": 5.0, "pytorch_tokens_s": 200.0, "ratio": 2.0},
                        {"precision": "bf16", "error": "no bf16"}],
               "bandwidth": {"nccl": {"rows": [{"bytes": 8, "us": 10.0, "algbw_GBps": 0.0008, "busbw_GBps": 0.0008}],
                                      "comm": "NcclCommunicator", "result": "done"},
                             "mpi-cuda-aware": {"result": "skipped: not CUDA-aware"}},
               "checkpoint": {"equal": True, "on_device": True, "save_s": 0.1, "load_s": 0.2, "tensors": 10}}
    text = format_report(facts, results, {"library": "MPICH 4.2", "cuda_aware": True, "device_nonblocking": True})
    for heading in ("## 1. GPU tests", "## 2. GPT training step", "## 3. All-reduce bandwidth",
                    "## 4. Checkpoint of device arrays"):
        assert heading in text
    assert "| fp32 | 10.00 | 100 | 8.00 | 1.25 | 5.00 | 200 | 2.00 |" in text and "boom" in text
    summary = gpu_check.summarize(facts, results)
    assert "tests nccl at 2 rank(s): FAILED (exit 1)" in summary
    assert "GPT step fp32: 10.0 ms/step, 2.00 x PyTorch CUDA, 1.25 x its GEMMs alone (8.0 ms)" in summary
    assert "checkpoint of device arrays: equal after load" in summary


def test_the_whole_check_runs_on_the_guard(tmp_path, capsys):
    """The driver end to end on CPUs: the matrix (staged MPI at 1 and 2 ranks on the guard), the step
    against PyTorch CPU, the bandwidth and checkpoint workers under mpiexec, the report, the summary."""
    pytest.importorskip("torch")
    facts = {"python": "3", "cupy": None, "gpus": 1, "why": None, "nccl": False, "torch": "cpu", "torch_cuda": False,
             "gpu_name": "the transfer guard"}
    report = tmp_path / "report.md"
    status = gpu_check.check(str(report), facts, gpu_check.Budget(240), device="guard", step_config=TINY, steps=1,
                             max_bytes=1 << 12)
    summary = capsys.readouterr().out
    assert status == 0, summary
    assert "tests mpi-staged at 2 rank(s): 6 passed" in summary
    assert "tests nccl at 1 rank(s): skipped: CuPy has no NCCL" in summary
    assert "GPT step bf16: precision bf16 on the GPU needs bfloat16 arrays" in summary
    assert "checkpoint of device arrays: equal after load" in summary
    text = report.read_text()
    assert "### mpi-staged" in text and "| 2 KiB |" in text and "FAILED" not in text
    assert "skipped: the MPI library is not CUDA-aware" in text


def test_a_broken_cupy_is_not_a_machine_without_a_gpu(tmp_path):
    (tmp_path / "fake" / "cupy").mkdir(parents=True)
    (tmp_path / "fake" / "cupy" / "__init__.py").write_text('raise ImportError("libnvrtc.so.12: cannot open")')
    result = subprocess.run([sys.executable, "-m", "hpcpar.bench.gpu_check", "--report", str(tmp_path / "r.md")],
                            capture_output=True, text=True, timeout=120, cwd=tmp_path,
                            env={**os.environ, "PYTHONPATH": f"{tmp_path / 'fake'}{os.pathsep}{REPO}"})
    assert result.returncode == 1
    assert "CuPy is installed but fails to import (ImportError: libnvrtc.so.12: cannot open)" in result.stdout
    assert "pip install 'hpcpar[gpu]'" in result.stdout
