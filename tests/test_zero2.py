"""ZeRO-2 (`parallel.zero = 2`) through `hpcpar train`: float64 with dropout 0.1 in every layout
equals one process, its checkpoints load into another layout and stage, and the old boolean key
reads as ZeRO-1 with one notice, `hpcpar bench zero` runs. (The sync itself, its bytes and memory:
test_zero_grads.py.)"""
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from conftest import REPO, final_parameters, venv_bin
from test_jobs import train

JOB = os.path.join(REPO, "jobs", "gpt-dp.toml")
COMMON = ["model.n_layer=2", "model.n_embd=32", "model.dropout=0.1", "data.batch_size=8", "train.steps=5",
          'train.precision="fp64"', "train.log_interval=1", "train.eval_interval=0", "train.sample_tokens=0"]
LAYOUTS = {  # ranks, overrides; small buckets so that a bucket holds few parameters and many are in flight
    "dp2": (2, ["parallel.dp=2"]),
    "dp4-accumulate": (4, ["parallel.dp=4", "parallel.micro_batches=2", "parallel.bucket_mb=0.01"]),
    "dp4-hybrid": (4, ["parallel.dp=4", "parallel.shard_size=2"]),  # HSDP: 2 groups of 2
    "dp2-tp2-sp": (4, ["parallel.dp=2", "parallel.tp=2", "parallel.sequence_parallel=true", "parallel.bucket_mb=0.01"]),
    "dp2-pp2-1f1b": (4, ["parallel.dp=2", "parallel.pp=2", "parallel.micro_batches=2"]),
    "dp2-pp2-zb1": (4, ["parallel.dp=2", "parallel.pp=2", "parallel.micro_batches=2", 'parallel.schedule="zb1"']),
    "2x2x2-sp": (8, ["parallel.dp=2", "parallel.pp=2", "parallel.tp=2", "parallel.sequence_parallel=true",
                     "parallel.micro_batches=2"]),
}


def run(folder, token_file, ranks, *overrides):
    proc = train(JOB, folder, token_file, *COMMON, *overrides, ranks=ranks, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc


def largest_difference(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float(np.max(np.abs(a[name] - b[name]))) for name in a)


@pytest.fixture(scope="module")
def one_process(tmp_path_factory, token_file):
    folder = tmp_path_factory.mktemp("one-process")
    run(folder, token_file, 1, "parallel.dp=1", "checkpoint.interval=5")
    return final_parameters(str(folder / "ckpt"))


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_zero_2_equals_one_process_in_every_layout(tmp_path, token_file, one_process, layout):
    ranks, overrides = LAYOUTS[layout]
    run(tmp_path, token_file, ranks, *overrides, "parallel.zero=2", "checkpoint.interval=5")
    assert largest_difference(final_parameters(str(tmp_path / "ckpt")), one_process) <= 1e-12


def resumed_from_step_3(straight, folder, token_file, ranks, *overrides):
    """``straight``'s step-3 checkpoint alone in ``folder``, resumed there to step 5 with ``overrides``."""
    shutil.copytree(straight / "ckpt" / "step-00000003", folder / "ckpt" / "step-00000003")
    (folder / "ckpt" / "latest").write_text("step-00000003\n")
    proc = run(folder, token_file, ranks, *overrides, "checkpoint.interval=5")
    assert "resumed from" in proc.stdout and "step     5/5" in proc.stdout, proc.stdout
    return final_parameters(str(folder / "ckpt"))


def test_zero_2_resumes_bitwise_and_continues_as_zero_0_at_dp_4(tmp_path, token_file, one_process):
    """A 2x2 pipeline under ZeRO-2, stopped after step 3: resumed in its layout it ends bit for bit
    as the uninterrupted run; resumed as plain DDP at dp 4, it equals one process."""
    layout = ["parallel.dp=2", "parallel.pp=2", "parallel.micro_batches=2", "parallel.zero=2"]
    run(tmp_path / "straight", token_file, 4, *layout, "checkpoint.interval=3")
    straight = final_parameters(str(tmp_path / "straight" / "ckpt"))
    same = resumed_from_step_3(tmp_path / "straight", tmp_path / "same", token_file, 4, *layout)
    for name in straight:
        np.testing.assert_array_equal(same[name], straight[name], err_msg=name)
    other = resumed_from_step_3(tmp_path / "straight", tmp_path / "dp4", token_file, 4, "parallel.dp=4",
                                "parallel.zero=0")
    assert largest_difference(other, one_process) <= 1e-12


def test_the_old_boolean_key_is_zero_1_with_a_notice_and_zero_4_is_refused(tmp_path, token_file):
    proc = run(tmp_path / "old", token_file, 2, "parallel.dp=2", "parallel.zero=true", "train.steps=1",
               "checkpoint.interval=0")
    assert "parallel.zero = true is read as the ZeRO stage 1; write parallel.zero = 1" in proc.stdout + proc.stderr
    refused = train(JOB, tmp_path / "four", token_file, *COMMON, "parallel.dp=2", "parallel.zero=4", ranks=2)
    assert refused.returncode == 2 and not (tmp_path / "four" / "ckpt").exists()
    assert "parallel.zero (--set): 4 must be 0, 1, 2 or 3" in refused.stderr


def test_bench_zero_prints_the_stages_and_their_memory_beside_the_formula():
    proc = subprocess.run([venv_bin("mpiexec"), "-n", "2", sys.executable, "-m", "hpcpar", "bench", "zero", "--no-peer",
                           "--n-layer", "1", "--n-embd", "32", "--block", "16", "--batch", "2", "--steps", "1"],
                          capture_output=True, text=True, timeout=240, env={**os.environ, "OPENBLAS_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for row in ("hpcpar DDP", "hpcpar ZeRO-1", "hpcpar ZeRO-2", "measured / formula"):
        assert row in proc.stdout, proc.stdout
