"""`hpcpar train` end to end: every shipped job runs, bad job files fail fast and clearly,
a stop signal checkpoints and the resumed run ends where an uninterrupted one does."""
import glob
import json
import os
import shutil
import signal
import subprocess
import sys

import h5py
import numpy as np
import pytest

from conftest import REPO, final_parameters, venv_bin

JOBS = sorted(glob.glob(os.path.join(REPO, "jobs", "*.toml")))
RANKS = {"gpt-3d": 8}


def train(job, tmp, token_file, *overrides, ranks=4, timeout=240, wait=True):
    args = [venv_bin("mpiexec"), "-n", str(ranks), sys.executable, "-m", "hpcpar", "train", job,
            "--set", f'checkpoint.dir="{tmp}/ckpt"', "--set", f'train.metrics="{tmp}/metrics.jsonl"']
    if "digits" not in job:
        args += ["--set", f'data.path="{token_file}"']
    for item in overrides:
        args += ["--set", item]
    env = {**os.environ, "OPENBLAS_NUM_THREADS": "1"}
    if not wait:
        return subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                                start_new_session=True)
    return subprocess.run(args, capture_output=True, text=True, timeout=timeout, env=env)


@pytest.mark.parametrize("job", JOBS, ids=[os.path.basename(j)[:-5] for j in JOBS])
def test_every_shipped_job_runs(job, tmp_path, token_file):
    name = os.path.basename(job)[:-5]
    ranks = RANKS.get(name, 4)
    averages = ["parallel.local_steps=3"] if "local-sgd" in name else []  # an average inside the traced steps
    proc = train(job, tmp_path, token_file, "train.steps=6", "train.log_interval=3", "train.eval_interval=0",
                 "checkpoint.interval=3", "train.sample_tokens=0", f'train.trace="{tmp_path}/trace.json"',
                 *averages, ranks=ranks)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "step     6/6" in proc.stdout and "val_loss" in proc.stdout
    assert os.path.isdir(tmp_path / "ckpt" / "step-00000006")
    records = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert [r["step"] for r in records if "loss" in r] == [1, 3, 6]
    assert all(np.isfinite(r["loss"]) for r in records if "loss" in r)
    # the trace: every rank's steps (a server's rounds) with its compute and its communication
    spans = [e for e in json.load(open(tmp_path / "trace.json"))["traceEvents"] if e["ph"] == "X"]
    servers = 1 if "ps" in name else 0
    for rank in range(ranks):
        mine = {e["cat"] for e in spans if e["pid"] == rank}
        trainer = {"forward", "backward"} if rank < ranks - servers else set()
        assert {"step", "optimizer", "comm"} | trainer <= mine, (rank, mine)
    assert all(e["args"]["comm"] and e["args"]["bytes"] >= 0 for e in spans if e["cat"] == "comm")


def test_sequence_parallelism_trains_like_plain_tensor_parallelism(tmp_path, token_file):
    job = os.path.join(REPO, "jobs", "gpt-tp.toml")
    common = ["parallel.tp=2", "parallel.dp=2", "model.n_layer=2", "model.n_embd=32", "train.steps=5",
              "train.log_interval=1", "train.eval_interval=0", "train.sample_tokens=0", "checkpoint.interval=0"]
    losses = {}
    for sequence_parallel in ("false", "true"):
        folder = tmp_path / sequence_parallel
        proc = train(job, folder, token_file, *common, f"parallel.sequence_parallel={sequence_parallel}")
        assert proc.returncode == 0, proc.stdout + proc.stderr
        losses[sequence_parallel] = [json.loads(line)["loss"] for line in open(folder / "metrics.jsonl")
                                     if '"loss"' in line]
    assert len(losses["true"]) == 5
    np.testing.assert_allclose(losses["true"], losses["false"], rtol=1e-5)  # float32: sums in another order


def test_dropout_masks_are_the_same_in_every_layout_of_a_job(tmp_path, token_file):
    """Dropout 0.1 through `hpcpar train`: dp 4 with 2 accumulation slices, and pp 2 x tp 2 with
    sequence parallelism, interleaved, draw the same masks (the loop keys them by step and row):
    the same losses up to float32 rounding (differing masks move them by ~1e-3)."""
    job = os.path.join(REPO, "jobs", "gpt-dp.toml")
    common = ["model.dropout=0.1", "model.n_layer=2", "model.n_embd=32", "data.batch_size=8", "train.steps=4",
              "train.log_interval=1", "train.eval_interval=0", "train.sample_tokens=0", "checkpoint.interval=0"]
    layouts = {"dp": ["parallel.micro_batches=2"],
               "pp-tp": ["parallel.dp=1", "parallel.pp=2", "parallel.tp=2", "parallel.sequence_parallel=true",
                         'parallel.schedule="interleaved"', "parallel.chunks=2", "parallel.micro_batches=2"]}
    losses = {}
    for name, overrides in layouts.items():
        proc = train(job, tmp_path / name, token_file, *common, *overrides)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        losses[name] = [json.loads(line)["loss"] for line in open(tmp_path / name / "metrics.jsonl") if '"loss"' in line]
    assert len(losses["dp"]) == 4
    np.testing.assert_allclose(losses["pp-tp"], losses["dp"], rtol=2e-6)


def test_parameter_server_checkpoints_resume_exactly_and_load_into_all_reduce(tmp_path, token_file):
    """The servers write their ranges and optimizer state: a synchronous run stopped at step 4 and
    resumed ends bitwise where an uninterrupted one does, and the checkpoint also resumes as an
    all-reduce job on the 3 workers' layout (the same mathematics: losses agree in float32)."""
    job = os.path.join(REPO, "jobs", "gpt-ps.toml")
    common = ["parallel.staleness=0", "model.n_embd=32", "train.log_interval=1", "train.eval_interval=0",
              "train.sample_tokens=0", "checkpoint.interval=4"]
    straight = train(job, tmp_path / "straight", token_file, *common, "train.steps=8")
    assert straight.returncode == 0, straight.stdout + straight.stderr
    for resumed_as in ("ps", "allreduce"):
        folder = tmp_path / resumed_as
        shutil.copytree(tmp_path / "straight" / "ckpt" / "step-00000004", folder / "ckpt" / "step-00000004")
        (folder / "ckpt" / "latest").write_text("step-00000004\n")
        mode = [] if resumed_as == "ps" else ["parallel.mode=\"allreduce\"", "parallel.dp=3"]
        resumed = train(job, folder, token_file, *common, "train.steps=8", *mode, ranks=4 if resumed_as == "ps" else 3)
        assert resumed.returncode == 0, resumed.stdout + resumed.stderr
        assert "resumed from" in resumed.stdout and "step     8/8" in resumed.stdout
    a, b = final_parameters(tmp_path / "straight" / "ckpt"), final_parameters(tmp_path / "ps" / "ckpt")
    for name in a:
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)
    losses = {run: [json.loads(line)["loss"] for line in open(tmp_path / run / "metrics.jsonl") if '"loss"' in line]
              for run in ("straight", "allreduce")}
    np.testing.assert_allclose(losses["allreduce"], losses["straight"][4:], rtol=1e-4)


@pytest.mark.parametrize("layout", [["parallel.dp=2", "parallel.pp=2"], ["parallel.dp=2", "parallel.pp=2", "parallel.zero=true"],
                                    ["parallel.dp=2", "parallel.tp=2", "parallel.pp=1", "parallel.zero=true"],
                                    ["parallel.dp=4", "parallel.pp=1", "parallel.mode=\"local_sgd\"",
                                     "parallel.local_steps=2", "parallel.micro_batches=1",
                                     "parallel.average_optimizer_state=true"]],
                         ids=["dp2-pp2", "dp2-pp2-zero", "dp2-tp2-zero", "local-sgd"])
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

    # the same job interrupted after its step-4 checkpoint: that checkpoint alone, then resume
    shutil.copytree(tmp_path / "straight" / "ckpt" / "step-00000004", tmp_path / "stopped" / "ckpt" / "step-00000004")
    (tmp_path / "stopped" / "ckpt" / "latest").write_text("step-00000004\n")
    resumed = train(job, tmp_path / "stopped", token_file, *common, "train.steps=8")
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert "resumed from" in resumed.stdout and "step     8/8" in resumed.stdout
    a, b = final_parameters(tmp_path / "straight" / "ckpt"), final_parameters(tmp_path / "stopped" / "ckpt")
    assert a.keys() == b.keys() and all(a[k].dtype == np.float32 for k in a)
    for name in a:
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)


@pytest.mark.parametrize("layout", [["parallel.dp=4", "parallel.pp=1", 'parallel.compression="topk"',
                                     "parallel.compression_ratio=0.05"],
                                    ["parallel.dp=2", "parallel.pp=2", 'parallel.compression="powersgd"'],
                                    ["parallel.dp=4", "parallel.pp=1", 'parallel.compression="powersgd"'],
                                    ["parallel.dp=2", "parallel.pp=2", 'parallel.compression="topk"'],
                                    ["parallel.dp=4", "parallel.pp=1", 'parallel.compression="topk"',
                                     'train.precision="bf16"'],
                                    ["parallel.dp=2", "parallel.pp=2", 'parallel.compression="powersgd"',
                                     'train.precision="bf16"'],
                                    ["parallel.dp=4", "parallel.pp=1", 'parallel.compression="powersgd"',
                                     'train.precision="fp16"'],
                                    ["parallel.dp=2", "parallel.pp=1", "parallel.tp=2", 'parallel.compression="topk"']],
                         ids=["topk-dp4", "powersgd-dp2-pp2", "powersgd-dp4", "topk-dp2-pp2", "topk-dp4-bf16",
                              "powersgd-dp2-pp2-bf16", "powersgd-dp4-fp16", "topk-dp2-tp2"])
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

    shutil.copytree(tmp_path / "straight" / "ckpt" / "step-00000004", tmp_path / "stopped" / "ckpt" / "step-00000004")
    (tmp_path / "stopped" / "ckpt" / "latest").write_text("step-00000004\n")
    resumed = train(job, tmp_path / "stopped", token_file, *common, "train.steps=8")
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert "resumed from" in resumed.stdout and "step     8/8" in resumed.stdout
    a, b = final_parameters(tmp_path / "straight" / "ckpt"), final_parameters(tmp_path / "stopped" / "ckpt")
    assert a.keys() == b.keys() and all(a[k].dtype == np.float32 for k in a)
    assert any(not np.array_equal(a[k], a[k].astype(ml_dtypes_bfloat16()).astype(np.float32)) for k in a)  # masters
    for name in a:
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)


def ml_dtypes_bfloat16():
    import ml_dtypes

    return ml_dtypes.bfloat16


def test_checkpoints_keep_weight_decay_groups_and_a_resume_cannot_change_them(tmp_path, token_file):
    job = os.path.join(REPO, "jobs", "demo.toml")  # weight_decay 0.01, no_decay: biases, LayerNorms, embeddings
    common = ["model.n_layer=2", "model.n_embd=32", "train.log_interval=1", "train.eval_interval=0",
              "train.sample_tokens=0", "checkpoint.interval=0"]
    first = train(job, tmp_path, token_file, *common, "train.steps=2")
    assert first.returncode == 0, first.stdout + first.stderr
    with open(tmp_path / "ckpt" / "step-00000002" / "manifest.json") as f:
        scalars = json.load(f)["scalars"]
    assert scalars["weight_decay/blocks.0.ln_1.weight"] == 0.0 and scalars["weight_decay/embed.wte.weight"] == 0.0
    assert scalars["weight_decay/blocks.1.mlp.fc.weight"] == 0.01
    inspect = subprocess.run([sys.executable, "-m", "hpcpar", "ckpt", "inspect", str(tmp_path / "ckpt")],
                             capture_output=True, text=True, timeout=120)
    assert "weight_decay 0.01: 8 parameter(s)" in inspect.stdout, inspect.stdout  # 2 blocks x 4 matrices
    changed = train(job, tmp_path, token_file, *common, "train.steps=3", "optimizer.no_decay=[]", timeout=60)
    assert changed.returncode != 0 and "Traceback" not in changed.stderr
    assert "optimizer.no_decay: the checkpoint in" in changed.stderr and "another weight decay for" in changed.stderr
    same = train(job, tmp_path, token_file, *common, "train.steps=3")
    assert same.returncode == 0 and "resumed from" in same.stdout, same.stdout + same.stderr


@pytest.mark.parametrize("overrides, message", [
    (["parallel.tpp=2"], "parallel.tpp"),
    (["train.steps=\"many\""], "train.steps"),
    (["parallel.tp=3"], "parallel.tp"),
    (["data.path=\"/nonexistent/tokens.h5\"", "data.prepare_if_missing=false"], "data.path"),
])
def test_bad_job_files_fail_before_any_rank_waits(tmp_path, token_file, overrides, message):
    # a rank left waiting would outlive the timeout (which fails the test): no timed assertion needed
    proc = train(os.path.join(REPO, "jobs", "gpt-dp.toml"), tmp_path, token_file, *overrides, timeout=60)
    assert proc.returncode != 0
    errors = [line for line in proc.stderr.splitlines() if line.startswith("hpcpar train: error")]
    assert len(errors) == 1 and message in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr


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


def test_compare_plot_and_generate(tmp_path, token_file):
    job = os.path.join(REPO, "jobs", "gpt-dp.toml")
    small = ["--set", "model.n_layer=2", "--set", "model.n_embd=32", "--set", f'data.path="{token_file}"']
    proc = subprocess.run([venv_bin("mpiexec"), "-n", "2", sys.executable, "-m", "hpcpar", "compare", job,
                           "--steps", "2", "--out", str(tmp_path), *small], capture_output=True, text=True,
                          timeout=240, env={**os.environ, "OPENBLAS_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for name in ("1x1x1 one rank", "2x1x1 pure data", "1x2x1 pure pipeline", "1x1x2 pure tensor"):
        assert name in proc.stdout
    results = json.load(open(tmp_path / "compare.json"))["results"]
    assert [r["layout"] for r in results] == [[1, 1, 1], [2, 1, 1], [1, 2, 1], [1, 1, 2]]
    assert results[0]["bytes_per_step"] == 0 and all(r["bytes_per_step"] > 0 for r in results[1:])
    for r in results:  # where the time goes: compute, communication and idle partition the step
        shares = (r["compute_share"], r["comm_share"], r["bubble_share"])
        assert all(0 <= share <= 1 for share in shares) and abs(sum(shares) - 1) < 1e-9, r
    assert "2 ranks on" in proc.stdout and "BLAS thread(s) per rank" in proc.stdout
    assert os.path.getsize(tmp_path / "compare.png") > 10_000

    run = train(job, tmp_path / "run", token_file, "train.steps=4", "train.log_interval=2", "model.n_layer=2",
                "model.n_embd=32", "train.eval_interval=2", ranks=2)
    assert run.returncode == 0, run.stdout + run.stderr
    plot = subprocess.run([sys.executable, "-m", "hpcpar", "plot", str(tmp_path / "run" / "metrics.jsonl")],
                          capture_output=True, text=True, timeout=120)
    assert plot.returncode == 0 and os.path.getsize(tmp_path / "run" / "metrics.png") > 10_000, plot.stdout
    generate = subprocess.run([sys.executable, "-m", "hpcpar", "generate", str(tmp_path / "run" / "ckpt"),
                               "--tokens", "20", "--prompt", "def "], capture_output=True, text=True, timeout=120)
    assert generate.returncode == 0 and generate.stdout.startswith("def ") and len(generate.stdout) >= 20
    twice = subprocess.run([venv_bin("mpiexec"), "-n", "2", sys.executable, "-m", "hpcpar", "generate",
                            str(tmp_path / "run" / "ckpt"), "--tokens", "20", "--prompt", "def "],
                           capture_output=True, text=True, timeout=120)
    assert twice.returncode == 0 and twice.stdout == generate.stdout  # rank 0 alone prints
    missing = subprocess.run([sys.executable, "-m", "hpcpar", "generate", str(tmp_path / "nowhere")],
                             capture_output=True, text=True, timeout=120)
    assert missing.returncode == 2 and "no committed checkpoint" in missing.stderr


def test_compare_measures_each_precision_beside_float32(tmp_path, token_file):
    pytest.importorskip("ml_dtypes")
    job = os.path.join(REPO, "jobs", "gpt-dp.toml")
    small = ["--set", "model.n_layer=2", "--set", "model.n_embd=32", "--set", f'data.path="{token_file}"']
    proc = subprocess.run([sys.executable, "-m", "hpcpar", "compare", job, "--steps", "2", "--out", str(tmp_path),
                           "--precision", "bf16", *small], capture_output=True, text=True, timeout=240,
                          env={**os.environ, "OPENBLAS_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    results = json.load(open(tmp_path / "compare.json"))["results"]
    assert [(r["layout"], r["precision"]) for r in results] == [([1, 1, 1], "fp32"), ([1, 1, 1], "bf16")]
    fp32, bf16 = results
    # tracemalloc, not timing; 0.61 at this width (the float32 loss weighs more), 0.52 for the bench GPT
    assert bf16["activations_vs_fp32"] <= 0.7 and fp32["activations_vs_fp32"] == 1.0
    assert bf16["param_state_mb_per_rank"] > fp32["param_state_mb_per_rank"]  # 16-bit weights + float32 masters
    assert "1x1x1 one rank bf16" in proc.stdout and "NumPy has no 16-bit GEMM" in proc.stdout
