"""The planner's Mixture of Experts (hpcpar.plan.moe): bytes per op of a small MoE job worked out by
hand, the activations an MoE block keeps against the real graph's count, the parameters against
the real GPT's, memory falling with ep, the ep layouts listed, and a dense job's predictions as
they were before MoE (jobs/gpt-dp.toml on 4 ranks)."""
import os
from dataclasses import replace

import numpy as np
import pytest

from hpcpar.autograd.memory import kept_for_backward
from hpcpar.nn.gpt import GPT, GPTConfig
from hpcpar.nn.moe import MoEConfig
from hpcpar.plan import machine as machines
from hpcpar.plan.cli import table
from hpcpar.plan.layouts import plan_layouts
from hpcpar.plan.inventory import layers
from hpcpar.plan.model import Experts, Shape, Work
from hpcpar.plan.predict import StepPlan, work_seconds
from hpcpar.train.config_load import load_job
from hpcpar.train.validate import validate

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# 2 blocks, block 1 with 4 experts (every = 2), 16 sequences of 16 tokens, width 32, fp32
JOB = """[model]\nkind = "gpt"\nblock_size = 16\nn_layer = 2\nn_head = 4\nn_embd = 32\n[model.moe]\nexperts = 4\n
every = 2\n[data]\nbatch_size = 16\nprepare_if_missing = true\n[parallel]\npp = 1\ntp = 1\n[optimizer]\ngrad_clip = 1.0\n
[train]\nsteps = 2\n"""


@pytest.fixture
def job_file(tmp_path):
    path = tmp_path / "moe.toml"
    path.write_text(JOB)
    return str(path)


def plan(job_file, world, *overrides, machine="dgx-a100"):
    return StepPlan(validate(load_job(job_file, list(overrides)), world), machines.load_machine(machine))


def test_the_bytes_per_op_of_a_small_moe_job_are_the_hand_counted_ones(job_file):
    """dp 4, ep 2: each rank has 4 sequences, N = 64 tokens, A = N k = 128 rows of 32 float32 (128
    bytes) to move per all-to-all. One step, summed over the 4 ranks (the all-to-alls' wire bytes
    assume uniform routing: half the rows leave the rank; the others equal the counters exactly)."""
    traffic = plan(job_file, 4, "parallel.ep=2").predict().traffic.by_comm()
    # the E = 4 int64 counts once per rank (wire: the other rank's half); dispatch and combine, each way
    assert traffic["ep"]["alltoall"] == (4, 4 * 32, 4 * 16)
    assert traffic["ep"]["alltoallv"] == (4 * 4, 16 * 128 * 128, 16 * 128 * 128 // 2)
    assert traffic["ep"]["allreduce"] == (4, 4 * 8, 4 * 8)  # the clipping norm's experts' squares over ep
    # dense parameters per rank: wte 8192 + wpe 512 + block 0 12704 + block 1 without its experts
    # (LayerNorms 128, attention 3168 + 1056, router 32 x 4) + ln_f 64 = 25952, one bucket over dp
    dense = (8192 + 512 + 12704 + 128 + 3168 + 1056 + 128 + 64) * 4
    assert traffic["dp"]["iallreduce"] == (4, 4 * dense, 4 * 2 * 3 * dense // 4)
    # this rank's 2 experts: fc 2 x (32 x 128 + 128), proj 2 x (128 x 32 + 32), over edp (2 ranks)
    experts = (2 * (32 * 128 + 128) + 2 * (128 * 32 + 32)) * 4
    assert traffic["edp"]["iallreduce"] == (4, 4 * experts, 4 * experts)


def test_an_moe_block_s_tensor_parallel_and_expert_parallel_messages():
    """tp 2 with sequence parallelism, ep 2, one micro-batch of 4 x 16 tokens (N = 64, A = 128), h = 32,
    fp32: attention's gather and reduce-scatter as a dense block's, then the router's scores
    gathered (32 x 4 float32), the tokens gathered, the experts' partial sums all-reduced (A rows)."""
    shape = Shape("gpt", 4, "fp32", 2, True, 16, 2, 4, 32, 256, moe=Experts(4, 2, None, 2, ep=2))
    block = layers(shape)[2]
    assert block.name == "blocks.1" and layers(shape)[1].ep_forward == []  # block 0 is dense
    assert block.tp_forward == [("allgather", 4096), ("reduce_scatter", 8192), ("allgather", 512), ("allgather", 4096),
                                ("allreduce", 16384)]
    assert block.tp_backward == [("reduce_scatter", 8192), ("allgather", 4096), ("reduce_scatter", 8192),
                                 ("allgather", 4096)]
    assert block.ep_forward == [("alltoall", 32), ("alltoallv", 16384), ("alltoallv", 16384)]
    assert block.ep_backward == [("alltoallv", 16384), ("alltoallv", 16384)]
    # capacity factor 0.5: each expert takes ceil(16 x 2 x 0.5 / 4) = 4 of a sequence's 32 assignments / 4
    capped = replace(shape, moe=Experts(4, 2, 0.5, 2, ep=2))
    assert capped.moe.assignments(4, 16) == 4 * 16 and layers(capped)[2].ep_forward[1] == ("alltoallv", 8192)


def _dtypes():
    ml_dtypes = pytest.importorskip("ml_dtypes")
    return {"fp32": np.float32, "fp64": np.float64, "bf16": ml_dtypes.bfloat16}


@pytest.mark.parametrize("precision", ["fp32", "fp64", "bf16"])
@pytest.mark.parametrize("mode", ["none", "selective", "full"])
@pytest.mark.parametrize("experts, top_k", [(4, 2), (8, 1)])
def test_an_moe_gpt_s_kept_bytes_and_parameters_are_the_real_graph_s(precision, mode, experts, top_k):
    """Dropless routing keeps N k rows whatever the router chooses: the count is exact (one dense block
    and one MoE block, the embedding and the head), and the parameters are the real GPT's."""
    config = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=4, n_embd=32,
                       moe=MoEConfig(experts=experts, top_k=top_k, every=2))
    model = GPT(config, _dtypes()[precision])
    model.recompute = mode
    ids = np.ascontiguousarray(np.random.default_rng(0).integers(0, 64, (4, 16)))
    with kept_for_backward(model.parameters()) as kept:
        model.loss(ids, ids)
    planned = layers(Shape("gpt", 4, precision, 1, False, 16, 2, 4, 32, 64, moe=Experts(experts, top_k, None, 2)))
    assert sum(layer.kept_by_recompute.get(mode, layer.saved_bytes) for layer in planned) == kept.bytes
    listed = [(n, e) for layer in planned for n, e, _ in layer.params if not (layer.name == "head" and n == "embed.wte.weight")]
    assert listed == [(n, p.size) for n, p in model.named_parameters()]


@pytest.mark.parametrize("zero", [0, 1, 3])
def test_memory_per_rank_falls_as_ep_grows(job_file, zero):
    """dp 8, 8 experts in each of 4 blocks: each ep holds 8 / ep experts per block (their gradients,
    and Adam's state over the 8 / ep ranks that share them under ZeRO-1; ZeRO-3: their parameters too)."""
    overrides = ["model.n_layer=4", "model.moe.experts=8", "model.moe.every=1", "data.batch_size=32",
                 f"parallel.zero={zero}"]
    memory = [plan(job_file, 8, *overrides, f"parallel.ep={ep}").memory() for ep in (1, 2, 4, 8)]
    for less, more in zip(memory[1:], memory):
        assert less.total < more.total and less.params < more.params and less.optimizer <= more.optimizer
    # uniform routing: the same rows at any ep (beside them the ep index rows, the graph's ops per local
    # expert); under ZeRO-3 a backward's gradients go into their buckets as it makes them, so with few
    # expert gradients (ep 8) the peak is backward's start, all activations kept: totals compare alone
    activations = [m.activations for m in memory]
    assert zero == 3 or max(activations) < 1.15 * min(activations)


def test_zero1_shards_the_experts_state_over_edp_and_the_rest_over_dp(job_file):
    """dp 4, ep 2, AdamW in fp32: 2 moments of ceil(25952 / 4) dense and 16704 / 2 expert elements."""
    memory = plan(job_file, 4, "parallel.ep=2", "parallel.zero=1").memory()
    assert memory.optimizer == 2 * 4 * (-(-25952 // 4) + 16704 // 2)


def test_zero3_shards_the_experts_over_edp_and_gathers_them_as_a_unit_of_their_own(job_file):
    """dp 4, ep 2, fp32: the state as ZeRO-1's; the parameters are the two shards (ceil(25952 / 4)
    dense, 16704 / 2 expert elements) and the units gathered at the peak: of the dense ones the
    kept embedding and head (8768) with both blocks (running and prefetched), and the MoE block's
    experts (16704), a unit over edp gathered twice a micro-batch."""
    job = plan(job_file, 4, "parallel.ep=2", "parallel.zero=3")
    assert [(comm, elements) for comm, elements, _ in job.zero3_units(0)] == [
        ("dp", 8768), ("dp", 12704), ("dp", 4480), ("edp", 16704)]
    assert job.zero3_units(0)[-1][2] == 2
    memory = job.memory()
    assert memory.optimizer == 2 * 4 * (-(-25952 // 4) + 16704 // 2)
    assert memory.params == 4 * (-(-25952 // 4) + 16704 // 2) + 4 * (25952 + 16704)


def test_the_router_s_product_runs_at_the_float32_rate_under_16_bits():
    machine = machines.load_machine("dgx-h100")
    fp32, bf16 = machine.compute["fp32"], machine.compute["bf16"]
    seconds = work_seconds(Work().add("router", 1e12), machine, "bf16")
    assert seconds == pytest.approx(1e12 / fp32.gemm_flops * bf16.model_factor)
    assert seconds > work_seconds(Work().add("gemm", 1e12), machine, "bf16")


def test_plan_lists_every_ep_that_divides_dp_and_the_experts(job_file):
    job = load_job(job_file, ["model.moe.experts=6", "model.n_layer=4"])
    ranked = plan_layouts(job, 8, machines.load_machine("dgx-a100"))
    grids = {q.label.split()[0] for q in ranked.predictions}
    assert {"8x1x1", "8x1x1-ep2", "4x1x2-ep2", "4x2x1-ep2", "2x1x4-ep2"} <= grids
    assert not [g for g in grids if "-ep4" in g or "-ep8" in g or "-ep3" in g]  # 6 experts: ep 1, 2 (3 does not divide dp)
    assert not [g for g in grids if "-cp" in g]  # MoE routes whole sequences
    assert "z3" in " ".join(q.label for q in ranked.predictions if "-ep" in q.label)  # ZeRO-3 with ep > 1 too
    assert "layout dp x pp x tp[-cp][-ep]" in table(job, 8, machines.load_machine("dgx-a100"), ranked, 3)


# jobs/gpt-dp.toml on 4 ranks of dgx-a100 as the planner predicted it before it knew MoE:
# (step seconds, memory per rank, wire bytes per step)
DENSE = {"4x1x1": (0.004016791713388485, 38240256, 20023344),  # memory: dropout scales and GELU's tanh not kept
         "2x1x2 sp z2": (0.0017013192794175843, 32846848, 44656752),
         "2x2x1 1f1b m4 z1": (0.003670518391852754, 19571712, 9558288),
         "1x1x4": (0.004321814633422816, 39781248, 113393760),
         "2x1x1-cp2 z3": (0.002094533541715935, 19646208, 71483488)}


def test_a_dense_job_s_predictions_are_what_they_were():
    ranked = plan_layouts(load_job(os.path.join(REPO, "jobs", "gpt-dp.toml")), 4, machines.load_machine("dgx-a100"))
    assert len(ranked.predictions) == 288 and len(ranked.excluded) == 6
    assert not [q for q in ranked.predictions if q.layout.ep != 1 or not ranked.fits[id(q)]]
    found = {q.label: q for q in ranked.predictions}
    for label, (step, memory, wire) in DENSE.items():
        q = found[label]
        assert (q.step_s, q.memory.total, q.traffic.wire()) == (pytest.approx(step, rel=1e-12), memory, wire), label
