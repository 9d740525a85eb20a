"""`hpcpar train` end to end: every shipped job runs, bad job files fail fast and clearly, checkpoints
keep what a resume must not change, `compare`, `plot` and `generate` run. (Resuming exactly:
test_jobs_resume.py.)"""
import glob
import json
import os
import shutil
import subprocess
import sys

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


def test_compare_plot_and_generate(tmp_path, token_file):
    job = os.path.join(REPO, "jobs", "gpt-dp.toml")
    small = ["--set", "model.n_layer=2", "--set", "model.n_embd=32", "--set", f'data.path="{token_file}"']
    proc = subprocess.run([venv_bin("mpiexec"), "-n", "2", sys.executable, "-m", "hpcpar", "compare", job,
                           "--steps", "2", "--out", str(tmp_path), *small], capture_output=True, text=True,
                          timeout=240, env={**os.environ, "OPENBLAS_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for name in ("1x1x1 one rank", "2x1x1 pure data", "1x2x1 pure pipeline", "1x1x2 pure tensor",
                 "1x1x1-cp2 pure context"):
        assert name in proc.stdout
    results = json.load(open(tmp_path / "compare.json"))["results"]  # dp, pp, tp, cp
    assert [r["layout"] for r in results] == [[1, 1, 1, 1], [2, 1, 1, 1], [1, 2, 1, 1], [1, 1, 2, 1], [1, 1, 1, 2]]
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
    assert [(r["layout"], r["precision"]) for r in results] == [([1, 1, 1, 1], "fp32"), ([1, 1, 1, 1], "bf16")]
    fp32, bf16 = results
    # tracemalloc, not timing; 0.71 at this width (the float32 loss weighs more, and float32 too keeps
    # GELU's input only), 0.65 for the bench GPT at batch 2
    assert bf16["activations_vs_fp32"] <= 0.78 and fp32["activations_vs_fp32"] == 1.0
    assert bf16["param_state_mb_per_rank"] > fp32["param_state_mb_per_rank"]  # 16-bit weights + float32 masters
    assert "1x1x1 one rank bf16" in proc.stdout and "NumPy has no 16-bit GEMM" in proc.stdout
