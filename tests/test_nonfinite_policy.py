"""``train.on_nonfinite``: a diverging run stops, skips or rewinds, and never commits a non-finite value.

The diverging job is the one the issue found: a small GPT with lr = 1e4 and no clipping, 6
steps, a checkpoint every 2 (a 6-step warm-up so that step 2 is still finite and saved; fp64
needs lr = 1e100 to leave its range). Each policy runs in fp32, bf16 and fp64 at 2 ranks
through ``hpcpar train``; the checkpoints are then read with plain h5py.
"""
import glob
import json
import os
import re
import subprocess
import sys

import h5py
import numpy as np
import pytest

from conftest import venv_bin
from hpcpar.optim import FullPrecision, SGD
from hpcpar.optim.finite import GRADIENTS, LOSS, StepHealth, check_step
from hpcpar.train.config import JobError
from hpcpar.train.config_load import load_job
from hpcpar.train.nonfinite import CONTINUE, REWIND, STOP, NonFinitePolicy
from hpcpar.train.validate import validate

DIVERGING = """[model]\nkind = "gpt"\nvocab_size = 256\nblock_size = 32\nn_layer = 2\nn_head = 2\nn_embd = 32
dropout = 0.0\n[data]\nkind = "text"\npath = "{path}"\nbatch_size = 8\neval_batches = 1\n[parallel]\ndp = 2
[optimizer]\ngrad_clip = 0.0\n[lr_schedule]\nwarmup_steps = 6\n[train]\nsteps = 6\nlog_interval = 1
[checkpoint]\ninterval = 2\n"""
LR = {"fp32": 1e4, "bf16": 1e4, "fp64": 1e100}  # 1e4 leaves an fp64 run's losses near 2e9, finite
CASES = [(policy, precision, keep) for policy, keeps in (("stop", (1, 3, 1)), ("skip", (3, 1, 3)), ("rewind", (1, 3, 1)))
         for precision, keep in zip(("fp32", "bf16", "fp64"), keeps)]


def train_diverging(tmp_path, token_file, policy: str, precision: str, keep: int):
    job = tmp_path / "diverging.toml"
    job.write_text(DIVERGING.format(path=token_file))
    sets = [f'checkpoint.dir="{tmp_path}/ckpt"', f"checkpoint.keep={keep}",
            f'train.metrics="{tmp_path}/metrics.jsonl"', f'train.precision="{precision}"',
            f'train.on_nonfinite="{policy}"', f"optimizer.lr={LR[precision]}"]
    return subprocess.run([venv_bin("mpiexec"), "-n", "2", sys.executable, "-m", "hpcpar", "train", str(job), "--progress",
                           "log", *[a for s in sets for a in ("--set", s)]], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "OPENBLAS_NUM_THREADS": "1"})


def committed_steps(root) -> list[int]:
    return sorted(int(os.path.basename(d).split("-")[1]) for d in glob.glob(os.path.join(root, "step-*"))
                  if not d.endswith(".tmp") and os.path.exists(os.path.join(d, "manifest.json")))


def nonfinite_tensors(step_dir) -> list[str]:
    """Every floating dataset of every HDF5 file of a step folder that holds inf or NaN (plain h5py)."""
    found = []
    for path in glob.glob(os.path.join(step_dir, "*.h5")):
        with h5py.File(path, "r") as f:
            def visit(name, item):
                if isinstance(item, h5py.Dataset) and item.dtype.kind == "f" and not np.isfinite(item[...]).all():
                    found.append(f"{os.path.basename(path)}:{name}")
            f.visititems(visit)
    return found


def events(tmp_path) -> list[dict]:
    with open(tmp_path / "metrics.jsonl") as f:
        return [json.loads(line) for line in f]


@pytest.mark.parametrize("policy,precision,keep", CASES, ids=[f"{p}-{q}-keep{k}" for p, q, k in CASES])
def test_a_diverging_run_never_commits_a_non_finite_value(tmp_path, token_file, policy, precision, keep):
    result = train_diverging(tmp_path, token_file, policy, precision, keep)
    output = result.stdout + result.stderr
    root = tmp_path / "ckpt"
    steps = committed_steps(root)
    for step in steps:
        assert nonfinite_tensors(root / f"step-{step:08d}") == [], (step, output)
    assert "Traceback" not in output, output
    failed = re.search(r"hpcpar train: step (\d+): the (loss|gradient norm) is not finite", output)
    rewinds = [e for e in events(tmp_path) if e.get("event") == "rewind"]
    if policy == "skip":  # 6 steps, fewer than train.max_skipped in a row: the run ends, its weights finite
        assert result.returncode == 0 and not failed, output
        assert re.search(r"step \d+: the (loss|gradient norm) is not finite .*the step was skipped", output), output
        assert steps == ([2, 4, 6] if keep == 3 else [6]), (steps, output)
        return
    if policy == "rewind":
        assert rewinds and [e["rewinds"] for e in rewinds] == list(range(1, len(rewinds) + 1)), output
        assert all(e["skipped_batches"] == e["step"] - e["to_step"] > 0 for e in rewinds), rewinds
    if result.returncode == 0:  # rewound past the divergence: the run ends, its weights finite
        assert policy == "rewind" and not failed and steps[-1] == 6, output
        with open(root / "step-00000006" / "manifest.json") as f:  # the data position a resume continues from
            data = json.load(f)["extra"]["data"]["state_dict"]
        assert data["skipped"] == sum(e["skipped_batches"] for e in rewinds) and data["step"] == 6
        return
    assert result.returncode == 3 and failed and output.count("hpcpar train: step") == 1, output
    failed_at = int(failed.group(1))
    newest_finite = 2 * ((failed_at - 1) // 2)  # the last checkpoint before the failure (step 0: rewind's)
    if policy == "rewind":  # every attempt diverged again: the rewinds ran out
        assert "3 rewind(s) made (train.max_rewinds = 3)" in output and len(rewinds) == 3, output
    assert steps[-1:] == ([newest_finite] if newest_finite or policy == "rewind" else []), (steps, output)
    assert len(steps) <= keep  # retention kept the newest finite step and no more
    assert f"the latest checkpoint is step {newest_finite}" in output or (not steps and "no checkpoint" in output)


# ----- the policy's decisions -------------------------------------------------------------------

def policy(**train):
    job = validate(load_job(None, [f"train.{k}={json.dumps(v)}" for k, v in train.items()]), 1)
    return NonFinitePolicy(job.train)


BAD_LOSS, BAD_GRADS, OVERFLOW = StepHealth(LOSS), StepHealth(GRADIENTS), StepHealth(GRADIENTS, overflow=True)
FINE = StepHealth()


def test_stop_stops_at_the_first_non_finite_step_but_not_at_a_loss_scalers_overflow():
    p = policy(on_nonfinite="stop", max_skipped=2)
    assert [p.decide(h) for h in (FINE, OVERFLOW, OVERFLOW, FINE, OVERFLOW, OVERFLOW, OVERFLOW)] == \
        [CONTINUE, CONTINUE, CONTINUE, CONTINUE, CONTINUE, CONTINUE, STOP]  # a collapsing scale stops
    assert p.decide(BAD_LOSS) == STOP and "the loss is not finite" in p.why


def test_skip_skips_up_to_max_skipped_in_a_row_then_stops():
    p = policy(on_nonfinite="skip", max_skipped=2)
    assert [p.decide(h) for h in (BAD_GRADS, BAD_LOSS, FINE, BAD_GRADS, BAD_GRADS, BAD_GRADS)] == \
        [CONTINUE, CONTINUE, CONTINUE, CONTINUE, CONTINUE, STOP]
    assert p.skipped == 5 and "3 steps skipped in a row (train.max_skipped = 2)" in p.why


def test_rewind_counts_its_rewinds_and_a_checkpoints_older_count_never_lowers_them():
    p = policy(on_nonfinite="rewind", max_rewinds=2)
    assert p.decide(BAD_LOSS) == REWIND and p.may_rewind()
    older = p.state_dict()
    p.rewound()
    p.load_state_dict(json.loads(json.dumps(older)))  # a rewind's load (the state is JSON in the manifest)
    assert p.rewinds == 1 and p.may_rewind()
    p.rewound()
    assert not p.may_rewind()


def test_the_spike_trigger_rewinds_on_a_loss_far_above_the_window_and_only_with_rewind():
    p = policy(on_nonfinite="rewind", spike_zscore=4.0, spike_window=4)
    decisions = [p.decide(FINE, loss) for loss in (3.0, 3.1, 2.9, 3.0, 3.05, 9.0)]
    assert decisions == [CONTINUE] * 5 + [REWIND] and "a loss spike: 9" in p.why
    assert list(p.losses) == [3.1, 2.9, 3.0, 3.05]  # the spike did not enter the window
    with pytest.raises(JobError, match="train.spike_zscore.*applies only with train.on_nonfinite"):
        policy(spike_zscore=4.0)
    with pytest.raises(JobError, match="train.max_rewinds"):
        policy(on_nonfinite="skip", max_rewinds=5)


def test_rewind_is_refused_with_a_parameter_server():
    job = load_job(None, ['parallel.mode="ps"', 'train.on_nonfinite="rewind"', "parallel.dp=1"])
    with pytest.raises(JobError, match='train.on_nonfinite.*"rewind" is not supported with parallel.mode = "ps"'):
        validate(job, 2)


# ----- the check a step makes ---------------------------------------------------------------------

def test_the_check_names_a_non_finite_loss_first_and_the_first_bad_gradient():
    grads = [("a", np.ones(3)), ("b", np.array([1.0, np.nan])), ("c", np.array([np.inf]))]
    health = check_step(np.float64(np.nan), grads)
    assert health == StepHealth(LOSS, parameter="b")
    assert check_step(1.0, grads) == StepHealth(GRADIENTS, parameter="b")
    assert check_step(1.0, grads[:1]).taken
    assert check_step(1.0, grads[:1], agree=lambda value: max(value, 2.0)) == StepHealth(LOSS)  # another rank's loss


def test_gradients_too_large_to_square_fail_the_check_though_each_is_finite():
    """What the diverging fp32 job hit first: Adam's second moment overflowed to inf, the weights did not."""
    big = [("w", np.full(4, 2e19, dtype=np.float32))]
    assert np.isfinite(big[0][1]).all()
    assert check_step(np.float32(1.0), big) == StepHealth(GRADIENTS)
    assert check_step(np.float32(1.0), big, norm=3.0).taken  # a clipping norm, when given, is what counts


def test_full_precision_skips_a_non_finite_step():
    from hpcpar.autograd import Parameter

    weight = Parameter(np.ones(3), name="w")
    full = FullPrecision([("w", weight)])
    optimizer = SGD([("w", weight)], lr=0.1)
    weight.grad = np.array([1.0, np.inf, 0.0])
    assert full.step(optimizer, loss=1.0) == StepHealth(GRADIENTS, parameter="w")
    np.testing.assert_array_equal(weight.data, np.ones(3))
    weight.grad = np.ones(3)
    assert full.step(optimizer, loss=1.0).taken
    np.testing.assert_allclose(weight.data, np.full(3, 0.9))
