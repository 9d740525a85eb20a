"""`hpcpar train` stopped and resumed ends bit for bit where an uninterrupted run ends: under mixed
precision with pipelines, ZeRO-1, local SGD and the parameter server, with gradient compression's
state in the checkpoint (or left out), and after a stop signal. (Split from test_jobs.py so that
the two halves run side by side under ``make test-serial``'s two workers.)"""
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import h5py
import numpy as np
import pytest

from conftest import REPO, final_parameters
from test_jobs import train


def resumed_from_step_4_equals_straight(job, tmp_path, token_file, common) -> dict:
    """The 8-step run in ``tmp_path/straight`` interrupted after its step-4 checkpoint (that checkpoint
    alone, in ``tmp_path/stopped``) and resumed ends with its parameters bit for bit; they are returned."""
    shutil.copytree(tmp_path / "straight" / "ckpt" / "step-00000004", tmp_path / "stopped" / "ckpt" / "step-00000004")
    (tmp_path / "stopped" / "ckpt" / "latest").write_text("step-00000004\n")
    resumed = train(job, tmp_path / "stopped", token_file, *common, "train.steps=8")
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert "resumed from" in resumed.stdout and "step     8/8" in resumed.stdout
    a, b = final_parameters(tmp_path / "straight" / "ckpt"), final_parameters(tmp_path / "stopped" / "ckpt")
    assert a.keys() == b.keys()
    for name in a:
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)
    return a


@pytest.mark.parametrize("layout", [["parallel.dp=2", "parallel.pp=2", "parallel.zero=1"],
                                    ["parallel.dp=2", "parallel.tp=2", "parallel.pp=1", "parallel.zero=2"],
                                    ["parallel.dp=4", "parallel.pp=1", "parallel.mode=\"local_sgd\"",
                                     "parallel.local_steps=2", "parallel.micro_batches=1",
                                     "parallel.average_optimizer_state=true"]],
                         ids=["dp2-pp2-zero1", "dp2-tp2-zero2", "local-sgd"])
def test_bfloat16_trains_with_pipelines_and_zero_and_resumes_exactly(tmp_path, token_file, layout):
    """Mixed precision under pipelines, ZeRO-1 and local SGD: the loss falls, and a run stopped at step 4
    and resumed ends with the float32 masters of an uninterrupted run, bit for bit."""
    pytest.importorskip("ml_dtypes")
    job = os.path.join(REPO, "jobs", "gpt-pp.toml")
    common = [*layout, "train.precision=\"bf16\"", "model.n_layer=2", "model.n_embd=32", "parallel.micro_batches=2",
              "train.log_interval=1", "train.eval_interval=0", "train.sample_tokens=0", "checkpoint.interval=4"]
    straight = train(job, tmp_path / "straight", token_file, *common, "train.steps=8")
    assert straight.returncode == 0, straight.stdout + straight.stderr
    losses = [json.loads(line)["loss"] for line in open(tmp_path / "straight" / "metrics.jsonl") if '"loss"' in line]
    assert len(losses) == 8 and all(np.isfinite(losses)) and losses[-1] < losses[0]
    records = [json.loads(line) for line in open(tmp_path / "straight" / "metrics.jsonl") if '"loss"' in line]
    assert [r["skipped_steps"] for r in records] == [0] * 8  # bf16: nothing overflowed

    a = resumed_from_step_4_equals_straight(job, tmp_path, token_file, common)
    assert all(a[k].dtype == np.float32 for k in a)


# Each compressor in a data-parallel and a pipeline or tensor-parallel layout, and each precision whose
# regression the docstring names (bf16 top-k residuals, fp16 PowerSGD QR).
@pytest.mark.parametrize("layout", [["parallel.dp=4", "parallel.pp=1", 'parallel.compression="topk"',
                                     "parallel.compression_ratio=0.05"],
                                    ["parallel.dp=2", "parallel.pp=2", 'parallel.compression="powersgd"'],
                                    ["parallel.dp=4", "parallel.pp=1", 'parallel.compression="topk"',
                                     'train.precision="bf16"'],
                                    ["parallel.dp=4", "parallel.pp=1", 'parallel.compression="powersgd"',
                                     'train.precision="fp16"'],
                                    ["parallel.dp=2", "parallel.pp=1", "parallel.tp=2", 'parallel.compression="topk"']],
                         ids=["topk-dp4", "powersgd-dp2-pp2", "topk-dp4-bf16", "powersgd-dp4-fp16", "topk-dp2-tp2"])
def test_compressed_training_resumes_exactly(tmp_path, token_file, layout):
    """Top-k's residuals and PowerSGD's errors and Q factors are in the checkpoint
    (parallel.compression_state): a run stopped at step 4 and resumed in its layout ends with the
    masters of the uninterrupted run, bit for bit (it did not before). Resumed in another layout,
    the error feedback starts afresh, and the run says so. Under bf16, top-k's residuals are
    bfloat16, which HDF5 cannot store: the checkpoint failed; they are saved as float32 now. Under
    fp16, PowerSGD's QR failed (no 16-bit QR); it runs in float32. At dp 2 x tp 2, top-k let the
    copies of the parameters every tp rank holds drift apart, and the resume loaded one of them."""
    job = os.path.join(REPO, "jobs", "gpt-pp.toml")
    common = [*layout, "model.n_layer=2", "model.n_embd=32", "parallel.micro_batches=2", "parallel.bucket_mb=0.02",
              "train.log_interval=1", "train.eval_interval=0", "train.sample_tokens=0", "checkpoint.interval=4"]
    straight = train(job, tmp_path / "straight", token_file, *common, "train.steps=8")
    assert straight.returncode == 0, straight.stdout + straight.stderr
    for run in ("stopped", "elsewhere"):
        shutil.copytree(tmp_path / "straight" / "ckpt" / "step-00000004", tmp_path / run / "ckpt" / "step-00000004")
        (tmp_path / run / "ckpt" / "latest").write_text("step-00000004\n")
    resumed = train(job, tmp_path / "stopped", token_file, *common, "train.steps=8")
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert "resumed from" in resumed.stdout and "starts afresh" not in resumed.stdout + resumed.stderr
    a, b = final_parameters(tmp_path / "straight" / "ckpt"), final_parameters(tmp_path / "stopped" / "ckpt")
    for name in a:
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)
    other = train(job, tmp_path / "elsewhere", token_file, *common, "train.steps=8", "parallel.dp=1", "parallel.pp=2",
                  "parallel.tp=2")
    assert other.returncode == 0, other.stdout + other.stderr
    assert "error feedback was saved in another layout or with other buckets: it starts afresh" in other.stdout + other.stderr


def test_compression_state_can_be_left_out_of_checkpoints(tmp_path, token_file):
    """checkpoint.compression_state = false: the checkpoint holds no error feedback (its shards
    are smaller by top-k's residuals, one float32 copy of the gradients per replica), and a resume
    trains on with the error feedback started afresh, saying so."""
    job = os.path.join(REPO, "jobs", "gpt-pp.toml")
    common = ["parallel.dp=4", "parallel.pp=1", 'parallel.compression="topk"', "model.n_layer=2", "model.n_embd=32",
              "parallel.micro_batches=2", "parallel.bucket_mb=0.02", "train.log_interval=1", "train.eval_interval=0",
              "train.sample_tokens=0", "checkpoint.interval=4"]
    sizes = {}
    for kept in ("true", "false"):
        run = train(job, tmp_path / kept, token_file, *common, "train.steps=4", f"checkpoint.compression_state={kept}")
        assert run.returncode == 0, run.stdout + run.stderr
        step = tmp_path / kept / "ckpt" / "step-00000004"
        keys = json.loads((step / "manifest.json").read_text())["tensors"]
        assert any(key.startswith("compression/") for key in keys) == (kept == "true"), sorted(keys)
        sizes[kept] = sum(path.stat().st_size for path in step.glob("shard-*.h5"))
    assert sizes["false"] < sizes["true"]
    resumed = train(job, tmp_path / "false", token_file, *common, "train.steps=6", "checkpoint.compression_state=false")
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert "resumed from" in resumed.stdout and "step     6/6" in resumed.stdout
    assert ("error feedback is not kept in checkpoints (checkpoint.compression_state = false): it starts afresh"
            in resumed.stdout + resumed.stderr)


def test_bfloat16_parameter_server_trains_and_resumes_exactly(tmp_path, token_file):
    """bf16 with mode = "ps": float32 masters on the 2 servers, float32 pushes from the 2 workers. The
    loss falls, nothing is skipped, the checkpoint holds the float32 masters, and a run resumed
    from step 4 ends with the masters of an uninterrupted run, bit for bit."""
    pytest.importorskip("ml_dtypes")
    job = os.path.join(REPO, "jobs", "gpt-ps.toml")
    common = ["parallel.staleness=0", "parallel.servers=2", "train.precision=\"bf16\"", "model.n_embd=32",
              "data.batch_size=8", "train.log_interval=1", "train.eval_interval=0", "train.sample_tokens=0",
              "checkpoint.interval=4"]
    straight = train(job, tmp_path / "straight", token_file, *common, "train.steps=8")
    assert straight.returncode == 0, straight.stdout + straight.stderr
    records = [json.loads(line) for line in open(tmp_path / "straight" / "metrics.jsonl") if '"loss"' in line]
    losses = [r["loss"] for r in records]
    assert len(losses) == 8 and all(np.isfinite(losses)) and losses[-1] < losses[0]
    assert [r["skipped_steps"] for r in records] == [0] * 8

    a = resumed_from_step_4_equals_straight(job, tmp_path, token_file, common)
    assert all(a[k].dtype == np.float32 for k in a)
    assert any(not np.array_equal(a[k], a[k].astype(ml_dtypes_bfloat16()).astype(np.float32)) for k in a)  # masters


def ml_dtypes_bfloat16():
    import ml_dtypes

    return ml_dtypes.bfloat16


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_local_sgd_resumes_exactly_from_any_step(tmp_path, token_file, precision):
    """Each local SGD replica's own values are saved as its rows beside the averaged model, so a
    run resumes bit for bit wherever it stopped (H = 4, ``average_optimizer_state = false``):
    from a run stopped between averages (``train.max_seconds = 1e-9``: after step 1), from a
    periodic checkpoint between averages (step 3) and from one right after an average (step 4,
    where the replicas' optimizer states still differ). Before the rows the first averaged early,
    the second was refused, and the third resumed every replica with one replica's moments.
    (fp16: each replica's loss scaler is saved too.)"""
    job = os.path.join(REPO, "jobs", "gpt-local-sgd.toml")
    common = ["parallel.local_steps=4", "parallel.average_optimizer_state=false", "model.n_layer=1",
              "model.n_embd=32", "model.block_size=16", "train.log_interval=1", "train.eval_interval=0",
              "train.sample_tokens=0", "checkpoint.keep=8", f"train.precision=\"{precision}\""]
    straight = train(job, tmp_path / "straight", token_file, *common, "train.steps=8", "checkpoint.interval=1",
                     ranks=2)
    assert straight.returncode == 0, straight.stdout + straight.stderr
    stopped = train(job, tmp_path / "stopped", token_file, *common, "train.steps=8", "train.max_seconds=1e-9", ranks=2)
    assert stopped.returncode == 0 and "stopped at step 1 " in stopped.stdout, stopped.stdout + stopped.stderr
    for step in (3, 4):  # a periodic checkpoint alone, as if the run had been killed after it
        folder = tmp_path / f"periodic-{step}" / "ckpt"
        shutil.copytree(tmp_path / "straight" / "ckpt" / f"step-{step:08d}", folder / f"step-{step:08d}")
        (folder / "latest").write_text(f"step-{step:08d}\n")
    for run in ("stopped", "periodic-3", "periodic-4"):
        resumed = train(job, tmp_path / run, token_file, *common, "train.steps=8", ranks=2)
        assert resumed.returncode == 0 and "resumed from" in resumed.stdout, resumed.stdout + resumed.stderr
        a, b = final_parameters(tmp_path / "straight" / "ckpt"), final_parameters(tmp_path / run / "ckpt")
        assert a.keys() == b.keys()
        for name in a:
            np.testing.assert_array_equal(a[name], b[name], err_msg=f"{run}: {name}")

    # the model of a checkpoint between averages is the replicas' mean (what another dp, export, generate use)
    with h5py.File(tmp_path / "straight" / "ckpt" / "step-00000003" / "index.h5", "r") as f:
        rows = {name: f["local_sgd/2/param"][name][...] for name in f["model"]}
        assert any(not np.array_equal(*replicas) for replicas in rows.values())  # the replicas differ there
        for name, replicas in rows.items():
            np.testing.assert_allclose(f["model"][name][...], replicas.mean(axis=0), rtol=1e-6, err_msg=name)

    # with another number of replicas the rows do not apply: the run starts from their average, and says so
    other = train(job, tmp_path / "periodic-3", token_file, *common, "train.steps=10", ranks=1)
    assert other.returncode == 0, other.stdout + other.stderr
    assert "replicas were saved at dp = 2, this run has dp = 1" in other.stdout + other.stderr


def test_stop_signal_checkpoints_and_the_resumed_run_matches(tmp_path, token_file):
    job = os.path.join(REPO, "jobs", "gpt-dp.toml")
    common = ["train.steps=30", "train.log_interval=1", "train.eval_interval=0", "checkpoint.interval=0",
              "model.n_embd=32", "model.n_layer=1", "model.dropout=0.1"]  # the masks come from the restored step
    straight = train(job, tmp_path / "straight", token_file, *common)
    assert straight.returncode == 0, straight.stdout + straight.stderr

    proc = train(job, tmp_path / "stopped", token_file, *common, "train.max_seconds=600", wait=False)
    for line in proc.stdout:  # wait until training is under way, then signal every process of the job
        if "step     3/30" in line:
            os.killpg(proc.pid, signal.SIGUSR1)
            break
    output = proc.stdout.read()
    assert proc.wait(timeout=120) == 0, output
    assert "stopped at step" in output and "signal SIGUSR1" in output
    stopped_at = int(output.split("stopped at step ")[1].split()[0])
    assert 3 <= stopped_at < 30

    resumed = train(job, tmp_path / "stopped", token_file, *common)
    assert resumed.returncode == 0 and "resumed from" in resumed.stdout, resumed.stdout + resumed.stderr
    a, b = final_parameters(tmp_path / "straight" / "ckpt"), final_parameters(tmp_path / "stopped" / "ckpt")
    assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)


def test_a_stop_signal_after_the_run_ended_leaves_its_exit_status_0(tmp_path, token_file):
    """SLURM's USR1 can come just as a run ends: once ``hpcpar train`` is done it ignores stop
    signals, where Python's shutdown would put their default action back and let one kill the
    finished rank (exit status 10 from mpiexec; found by tests/sweep.py). Signals every 0.2 ms
    from the last line to the end reach that moment: the old code died 10 times in 10. One rank,
    started without mpiexec: the signals go to the rank alone (a launcher flooded with signals to
    forward fails by itself once its proxies have gone)."""
    job = os.path.join(REPO, "jobs", "gpt-dp.toml")
    sets = [f'checkpoint.dir="{tmp_path}/ckpt"', f'data.path="{token_file}"', "train.steps=2", "train.eval_interval=0",
            "train.sample_tokens=0", "model.n_embd=32", "model.n_layer=1"]
    proc = subprocess.Popen([sys.executable, "-m", "hpcpar", "train", job, *[a for s in sets for a in ("--set", s)]],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
                            env={**os.environ, "OPENBLAS_NUM_THREADS": "1"})
    for line in proc.stdout:
        if "val_loss" in line:  # the run's last line: from here on nothing is left to stop
            break
    while proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGUSR1)
        except ProcessLookupError:
            break
        time.sleep(0.0002)
    output = proc.stdout.read()
    assert proc.wait(timeout=60) == 0, output
