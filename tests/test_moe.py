"""Mixture of Experts (`[model.moe]`) and expert parallelism (`parallel.ep`) through `hpcpar train`:
float64 with dropout 0.1, five steps in every layout equal one process, dropless and with capacity
1.25, and so do the expert load and the auxiliary losses in the metrics; an ep 4 checkpoint
continues exactly at ep 1 and ep 2; a dense checkpoint upcycles into the experts; the routing's
pieces (capacity order, permute and unpermute, grouped GEMMs, the gradients of the auxiliary
losses) against their definitions; impossible settings are one line each. (Bytes on the ep
communicator: test_moe_mpi.py.)"""
import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest

from conftest import final_parameters, venv_bin
from hpcpar.autograd import Tensor
from hpcpar.autograd.ops import experts as moe_ops
from hpcpar.nn.gpt import GPT, GPTConfig
from hpcpar.nn.moe import MoEConfig, route
from hpcpar.train.config import JobError
from hpcpar.train.config_load import load_job
from hpcpar.train.validate import validate
from test_zero2 import COMMON, JOB, largest_difference, resumed_from_step_3, run

MOE = ["model.moe.experts=4"]
CAPACITIES = {"dropless": [], "capacity-1.25": ["model.moe.capacity_factor=1.25"]}
LAYOUTS = {  # ranks, overrides
    "ep2": (2, ["parallel.ep=2"]),
    "ep4": (4, ["parallel.ep=4"]),
    "ep2-dp2": (4, ["parallel.ep=2", "parallel.bucket_mb=0.01"]),  # edp of 2, many buckets
    "ep2-tp2-sp": (4, ["parallel.ep=2", "parallel.tp=2", "parallel.sequence_parallel=true"]),
    "ep2-pp2": (4, ["parallel.ep=2", "parallel.pp=2", "parallel.micro_batches=2"]),
    "ep2-zero1": (4, ["parallel.ep=2", "parallel.zero=1"]),
    "ep2-zero2": (4, ["parallel.ep=2", "parallel.zero=2", "parallel.bucket_mb=0.01"]),
    "ep2-zero3": (4, ["parallel.ep=2", "parallel.zero=3", "parallel.bucket_mb=0.01"]),  # experts a unit each, over edp
    "ep2-tp2-sp-zero3-full": (4, ["parallel.ep=2", "parallel.tp=2", "parallel.sequence_parallel=true", "parallel.zero=3",
                                  'model.recompute="full"']),
    "ep2-pp2-zero3": (4, ["parallel.ep=2", "parallel.pp=2", "parallel.micro_batches=2", "parallel.zero=3"]),
    "ep2-pp2-zb1-full": (4, ["parallel.ep=2", "parallel.pp=2", "parallel.micro_batches=2", 'parallel.schedule="zb1"',
                             'model.recompute="full"']),  # weight gradients deferred; blocks rerun in backward
}


def moe_records(folder) -> list[dict]:
    return [r["moe"] for r in map(json.loads, open(folder / "m.jsonl")) if "moe" in r]


def moe_run(folder, token_file, ranks, *overrides):
    return run(folder, token_file, ranks, *MOE, f'train.metrics="{folder}/m.jsonl"', *overrides)


@pytest.fixture(scope="module")
def one_process(tmp_path_factory, token_file):
    """{capacity: (final parameters, moe records)} of one process."""
    results = {}
    for name, capacity in CAPACITIES.items():
        folder = tmp_path_factory.mktemp(f"one-{name}")
        moe_run(folder, token_file, 1, *capacity, "checkpoint.interval=5")
        results[name] = final_parameters(str(folder / "ckpt")), moe_records(folder)
    return results


def assert_same_load(records, reference):
    assert [r["tokens"] for r in records] == [r["tokens"] for r in reference]  # the same routing, token for token
    for mine, theirs in zip(records, reference):
        assert mine["dropped"] == theirs["dropped"] and mine["blocks"] == theirs["blocks"]
        assert abs(mine["aux_loss"] - theirs["aux_loss"]) <= 1e-12 and abs(mine["z_loss"] - theirs["z_loss"]) <= 1e-12


@pytest.mark.parametrize("capacity", list(CAPACITIES))
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_moe_equals_one_process_in_every_layout(tmp_path, token_file, one_process, layout, capacity):
    ranks, overrides = LAYOUTS[layout]
    proc = moe_run(tmp_path, token_file, ranks, *CAPACITIES[capacity], *overrides, "checkpoint.interval=5")
    ep = next(o for o in overrides if o.startswith("parallel.ep="))[-1]
    assert f"expert parallel: 4 experts per MoE block over ep = {ep} ranks" in proc.stdout, proc.stdout
    progress = [line for line in proc.stdout.splitlines() if line.startswith("step ")]
    assert progress and all(re.search(r"  experts \d+\.\d\dx  drop \d+\.\d%  aux ", line) for line in progress)
    parameters, records = one_process[capacity]
    assert largest_difference(final_parameters(str(tmp_path / "ckpt")), parameters) <= 1e-12
    assert len(records) == 5
    assert_same_load(moe_records(tmp_path), records)
    if capacity != "dropless":
        assert any(d > 0 for r in records for d in r["dropped"])  # capacity 1.25 did drop tokens


def test_zero_3_on_the_device_path_equals_one_process_there(tmp_path, token_file):
    """ZeRO-3 with ep 2 on the CuPy path (the transfer guard's device: its units, the experts' over
    edp too, rerun in backward instead of dropping pages) ends where one process on that path ends."""
    device = ['train.device="guard"', "model.moe.capacity_factor=1.25", "checkpoint.interval=5"]
    moe_run(tmp_path / "one", token_file, 1, *device)
    proc = moe_run(tmp_path / "zero3", token_file, 4, *device, "parallel.ep=2", "parallel.zero=3")
    assert "ZeRO-3: 2 unit(s) resharded after forward (recomputed)" in proc.stdout, proc.stdout  # the experts' store
    assert largest_difference(final_parameters(str(tmp_path / "zero3" / "ckpt")),
                              final_parameters(str(tmp_path / "one" / "ckpt"))) <= 1e-12


def test_an_ep_4_checkpoint_continues_exactly_at_ep_1_and_ep_2(tmp_path, token_file, one_process):
    """Experts are saved as global (experts, ...) tensors: stopped after step 3 at ep 4, the run
    ends at ep 1 (one process) and at ep 2 (dp 2) as the uninterrupted one does; one process
    samples from it."""
    capacity = CAPACITIES["capacity-1.25"]
    moe_run(tmp_path / "straight", token_file, 4, *capacity, "parallel.ep=4", "checkpoint.interval=3")
    straight = final_parameters(str(tmp_path / "straight" / "ckpt"))
    assert straight["blocks.0.mlp.fc.weight"].shape == (4, 32, 128)  # every expert, whatever ep saved it
    for ranks, ep in ((1, 1), (2, 2)):
        folder = tmp_path / f"ep{ep}"
        resumed = resumed_from_step_3(tmp_path / "straight", folder, token_file, ranks, *MOE, *capacity,
                                      f"parallel.ep={ep}", f'train.metrics="{folder}/m.jsonl"')
        assert largest_difference(resumed, straight) <= 1e-12
    sample = subprocess.run([sys.executable, "-m", "hpcpar", "generate", str(tmp_path / "straight" / "ckpt"), "--tokens", "8",
                             "--prompt", "def "], capture_output=True, text=True, timeout=120)
    assert sample.returncode == 0 and sample.stdout.startswith("def "), sample.stdout + sample.stderr  # all experts here


def test_a_zero_3_ep_2_pipeline_resumes_bitwise_and_continues_at_ep_1(tmp_path, token_file):
    """ZeRO-3 with ep 2 on a 2-stage pipeline (its tied embedding saved by the first stage alone,
    the experts by their edp shards), stopped after step 3: resumed in its layout it ends bit for
    bit as the uninterrupted run; resumed in one process, within float64's rounding of it."""
    layout = ["parallel.ep=2", "parallel.pp=2", "parallel.micro_batches=2", "parallel.zero=3"]
    capacity = CAPACITIES["capacity-1.25"]
    moe_run(tmp_path / "straight", token_file, 4, *capacity, *layout, "checkpoint.interval=3")
    straight = final_parameters(str(tmp_path / "straight" / "ckpt"))
    for ranks, overrides in ((4, layout), (1, [])):
        folder = tmp_path / f"resumed-{ranks}"
        resumed = resumed_from_step_3(tmp_path / "straight", folder, token_file, ranks, *MOE, *capacity, *overrides,
                                      f'train.metrics="{folder}/m.jsonl"')
        assert largest_difference(resumed, straight) <= (0.0 if ranks == 4 else 1e-12)


def test_a_dense_checkpoint_upcycles_into_every_expert(tmp_path, token_file):
    """``--load-weights-only`` from a dense GPT: each expert starts as the dense MLP, the routers as
    initialised; with top-2 gates summing to one and no drops the MoE model is the dense one (the
    same dropout masks too), so its first loss is the dense model's on the same batch."""
    run(tmp_path / "dense", token_file, 1, "checkpoint.interval=5")
    weights = [f'checkpoint.resume="{tmp_path / "dense" / "ckpt" / "step-00000005"}"', "train.steps=1"]
    dense = weights_only_run(tmp_path / "again", token_file, 1, *weights)
    moe = weights_only_run(tmp_path / "moe", token_file, 2, *MOE, "parallel.ep=2", *weights)
    assert "upcycled: 8 expert tensors from the dense MLPs" in moe.stdout and "2 router(s) initialised anew" in moe.stdout
    loss = [line.split("loss ")[1].split()[0] for proc in (dense, moe) for line in proc.stdout.splitlines()
            if line.startswith("step     1/1")]
    assert len(loss) == 2 and loss[0] == loss[1], (dense.stdout[-500:], moe.stdout[-500:])


def weights_only_run(folder, token_file, ranks, *overrides):
    """``hpcpar train --load-weights-only`` with the test jobs' keys."""
    args = [venv_bin("mpiexec"), "-n", str(ranks), sys.executable, "-m", "hpcpar", "train", JOB, "--load-weights-only"]
    for item in (*COMMON, f'checkpoint.dir="{folder}/ckpt"', f'data.path="{token_file}"', *overrides):
        args += ["--set", item]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=300, env={**os.environ, "OPENBLAS_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc


def test_capacity_keeps_first_choices_before_second_in_position_order():
    probs = np.array([[[0.6, 0.3, 0.1], [0.5, 0.4, 0.1], [0.2, 0.7, 0.1], [0.45, 0.45, 0.1]]])  # (1, 4, 3)
    routing = route(probs, top_k=2, capacity=2)
    assert routing.experts.tolist() == [[0, 1], [0, 1], [1, 0], [0, 1]]  # a tie goes to the lower expert
    # expert 0: first choices at positions 0, 1, 3 keep 0 and 1, then position 2's second choice is over;
    # expert 1: position 2's first choice, then second choices in position order: 0 stays, 1 and 3 drop
    assert routing.kept.tolist() == [[True, True], [True, False], [True, False], [False, False]]
    assert routing.routed.tolist() == [4, 4, 0] and routing.counts.tolist() == [2, 2, 0]
    assert route(probs, top_k=2, capacity=None).kept.all()
    assert MoEConfig(experts=8, top_k=2, capacity_factor=1.25).capacity(128) == 40  # ceil(128 * 2 * 1.25 / 8)


def test_permute_then_unpermute_restores_the_input_and_its_gradient():
    rng = np.random.default_rng(0)
    x = Tensor(rng.normal(size=(6, 3)), requires_grad=True)
    order = rng.permutation(6)
    back = moe_ops.unpermute_rows(moe_ops.permute_rows(x, order), order, 6)
    np.testing.assert_array_equal(back.data, x.data)
    seed = rng.normal(size=(6, 3))
    back.backward(seed)
    np.testing.assert_array_equal(x.grad, seed)
    # a token sent to two experts gets both gradients back; a slot nothing fills is zero
    rows = moe_ops.permute_rows(x, np.array([2, 2, 5]))
    placed = moe_ops.unpermute_rows(rows, np.array([0, 3, 1]), 4)
    assert placed.data[2].tolist() == [0.0, 0.0, 0.0]
    x.grad = None
    placed.backward(np.ones((4, 3)))
    assert x.grad[2].tolist() == [2.0, 2.0, 2.0] and x.grad[5].tolist() == [1.0, 1.0, 1.0] and x.grad[0].sum() == 0


def test_grouped_linear_is_each_experts_own_product_with_its_gradients():
    rng = np.random.default_rng(1)
    counts = [2, 0, 3]
    x = Tensor(rng.normal(size=(5, 4)), requires_grad=True)
    w = Tensor(rng.normal(size=(3, 4, 2)), requires_grad=True)
    b = Tensor(rng.normal(size=(3, 2)), requires_grad=True)
    y = moe_ops.grouped_linear(x, w, b, counts)
    experts = [0, 0, 2, 2, 2]
    expected = np.stack([x.data[i] @ w.data[e] + b.data[e] for i, e in enumerate(experts)])
    np.testing.assert_allclose(y.data, expected, rtol=1e-14)
    seed = rng.normal(size=(5, 2))
    y.backward(seed)
    np.testing.assert_allclose(x.grad, np.stack([seed[i] @ w.data[e].T for i, e in enumerate(experts)]), rtol=1e-14)
    np.testing.assert_allclose(w.grad[2], x.data[2:].T @ seed[2:], rtol=1e-14)
    assert not w.grad[1].any() and not b.grad[1].any()  # the expert without rows
    np.testing.assert_allclose(b.grad[0], seed[:2].sum(axis=0), rtol=1e-14)


@pytest.mark.parametrize("capacity", [None, 1.25])
def test_moe_gradients_with_the_auxiliary_losses_equal_finite_differences(capacity):
    """float64: the GPT's loss plus 0.01 x aux + 0.001 x z (what backward sees) by central differences."""
    config = GPTConfig(vocab_size=32, block_size=16, n_layer=2, n_head=2, n_embd=8,
                       moe=MoEConfig(experts=4, top_k=2, capacity_factor=capacity))
    model = GPT(config, dtype=np.float64)
    rng = np.random.default_rng(0)
    ids, targets = rng.integers(0, 32, (3, 16)), rng.integers(0, 32, (3, 16))
    model.loss(ids, targets).backward()
    params = dict(model.named_parameters())

    def total() -> float:
        for _, moe in model.moe_blocks():
            moe.load.reset()
        loss = float(model.loss(ids, targets).data)
        return loss + sum(0.01 * moe.load.aux / moe.load.sequences + 0.001 * moe.load.z / moe.load.sequences
                          for _, moe in model.moe_blocks())

    for name in ("blocks.0.mlp.fc.weight", "blocks.1.mlp.router.weight", "blocks.0.mlp.proj.bias", "blocks.0.ln_2.weight"):
        param = params[name]
        index = tuple(int(rng.integers(0, n)) for n in param.shape)
        value, analytic = param.data[index], param.grad[index]
        param.data[index] = value + 1e-6
        up = total()
        param.data[index] = value - 1e-6
        down = total()
        param.data[index] = value
        assert abs((up - down) / 2e-6 - analytic) <= 1e-8 * max(1.0, abs(analytic)), name


def test_every_k_th_block_has_experts_and_the_others_dense_mlps():
    config = GPTConfig(vocab_size=16, block_size=8, n_layer=4, n_head=1, n_embd=4, moe=MoEConfig(experts=2, every=2))
    model = GPT(config)
    assert [index for index, _ in model.moe_blocks()] == [1, 3]
    assert model.blocks[0].mlp.fc.weight.shape == (4, 16) and model.blocks[1].mlp.fc.weight.shape == (2, 4, 16)


def test_top_1_gates_are_router_probabilities_and_top_2_sum_to_one():
    probs = np.random.default_rng(2).dirichlet(np.ones(4), size=(2, 8))  # (B, T, E)
    for top_k, expected in ((1, probs.max(axis=-1).reshape(16)), (2, np.ones(16))):
        config = GPTConfig(vocab_size=16, block_size=8, n_layer=1, n_head=1, n_embd=4,
                           moe=MoEConfig(experts=4, top_k=top_k))
        moe = GPT(config, dtype=np.float64).moe_blocks()[0][1]
        ones = Tensor(np.ones((16 * top_k, 1)))  # every expert's output 1: the output is the sum of the gates
        gates = moe._combine(ones, Tensor(probs), route(probs, top_k, None), 16).data
        np.testing.assert_allclose(gates[:, 0], expected, rtol=1e-14)


@pytest.mark.parametrize("overrides, ranks, key, text", [
    (["model.moe.experts=3", "parallel.ep=2"], 2, "parallel.ep", "3 experts do not split over ep = 2"),
    (["model.moe.experts=4", "parallel.ep=4"], 2, "parallel.ep", "ep = 4 does not divide dp = 2"),
    (["model.moe.experts=1", "model.moe.top_k=2"], 1, "model.moe.top_k", "2 is more than the 1 experts"),
    (["parallel.ep=2"], 2, "parallel.ep", "model.moe.experts = 0"),
    (["model.moe.experts=4", "parallel.ep=2", "parallel.zero=2", "parallel.shard_size=1"], 2, "parallel.shard_size",
     "hybrid sharding with expert parallelism"),
    (["model.moe.experts=4", "parallel.cp=2"], 2, "parallel.cp", "routes and balances whole sequences"),
    (["model.moe.experts=4", 'parallel.mode="local_sgd"'], 2, "parallel.mode", "allreduce"),
])
def test_impossible_moe_settings_are_one_line_each(token_file, overrides, ranks, key, text):
    job = load_job(None, [f'data.path="{token_file}"', "model.n_layer=2", "model.block_size=16", *overrides])
    with pytest.raises(JobError) as error:
        validate(job, ranks)
    assert any(k == key and text in problem for k, problem in error.value.problems), error.value.problems


def test_moe_keys_are_a_nested_table_and_do_nothing_without_experts(tmp_path):
    path = tmp_path / "job.toml"
    path.write_text("[model]\nn_layer = 2\n[model.moe]\nexperts = 8\ntop_k = 1\ncapacity_factor = 1.5\n")
    job = load_job(str(path))
    assert job.moe_config() == MoEConfig(experts=8, top_k=1, capacity_factor=1.5)
    assert "[model.moe]\nexperts = 8\ntop_k = 1\ncapacity_factor = 1.5" in job.describe()
    with pytest.raises(JobError, match=r"model.moe.top_k \(--set\): 1 has no effect with model.moe.experts = 0; it applies only with model.moe.experts > 0"):
        load_job(None, ["model.moe.top_k=1"])
    with pytest.raises(JobError, match="model.moe.experts .--set.: 4 has no effect with model.kind = .cnn."):
        load_job(None, ['model.kind="cnn"', 'data.kind="digits"', "model.moe.experts=4"])
    path.write_text("[moe]\nexperts = 8\n")
    with pytest.raises(JobError, match=r"did you mean \[model.moe\]"):
        load_job(str(path))
