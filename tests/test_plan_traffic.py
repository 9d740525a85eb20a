"""The planner's bytes per step equal the communicators' counters, call for call (2 and 4 ranks).

For each layout: one real step (``hpcpar.plan.measure.counted_step``: train_step and
finish_step, as ``hpcpar compare`` times them) against ``hpcpar.plan.traffic`` — per
communicator and operation, the calls, the bytes given and the wire bytes, summed over ranks.
"""
import os

import pytest
from conftest import world_token_file
from mpi4py import MPI

from hpcpar.plan.machine import load_machine
from hpcpar.plan.measure import counted_step
from hpcpar.plan.predict import StepPlan
from hpcpar.train.config_load import load_job
from hpcpar.train.validate import validate

GPT = """[model]\nkind = "gpt"\nblock_size = 16\nn_layer = 3\nn_head = 4\nn_embd = 32\n
[data]\npath = "{path}"\nbatch_size = 16\n[parallel]\npp = 1\ntp = 1\n[optimizer]\ngrad_clip = 1.0\n
[train]\nsteps = 2\ndevice = "cpu"\n"""
CNN = """[model]\nkind = "cnn"\n[data]\nkind = "digits"\nbatch_size = 32\n[parallel]\npp = 1\ntp = 1\n[train]\nsteps = 2\n"""

LAYOUTS = {  # world size -> [(model, overrides)]
    2: [("gpt", ["parallel.dp=2"]),
        ("gpt", ["parallel.dp=2", "parallel.bucket_mb=0.01", "parallel.micro_batches=2"]),
        ("gpt", ["parallel.pp=2", "parallel.micro_batches=4", 'parallel.schedule="gpipe"']),
        ("gpt", ["parallel.tp=2", "parallel.sequence_parallel=true"]),
        ("gpt", ["parallel.dp=2", "parallel.zero=1"]),
        ("gpt", ["parallel.dp=2", "parallel.zero=2", "parallel.bucket_mb=0.01"]),
        ("gpt", ["parallel.dp=2", "parallel.zero=3", "parallel.bucket_mb=0.01", "parallel.micro_batches=2"]),
        ("gpt", ["parallel.dp=2", "parallel.zero=3", "parallel.reshard_after_forward=false"]),
        ("gpt", ["parallel.tp=2", "model.tie_weights=false", "model.bias=false"]),
        ("gpt", ["parallel.tp=2", 'model.recompute="full"', "model.dropout=0.1"]),
        ("gpt", ["parallel.pp=2", "parallel.micro_batches=2", 'model.recompute="selective"']),
        ("cnn", ["parallel.pp=2", "parallel.micro_batches=2"]),
        # context parallelism: ring attention's K/V blocks and dK/dV on "cp", gradients on "dp*cp"
        ("gpt", ["parallel.cp=2"]),
        ("gpt", ["parallel.cp=2", 'model.recompute="selective"', "model.dropout=0.1"])],
    4: [("gpt", ["parallel.dp=2", "parallel.pp=2", 'parallel.schedule="interleaved"', "parallel.chunks=2",
                 "parallel.micro_batches=4"]),
        ("gpt", ["parallel.pp=2", "parallel.tp=2", 'parallel.schedule="zb1"', "parallel.micro_batches=4",
                 "parallel.sequence_parallel=true"]),
        ("gpt", ["parallel.dp=2", "parallel.tp=2", "parallel.zero=1", 'model.recompute="full"']),
        ("gpt", ["parallel.dp=2", "parallel.tp=2", "parallel.zero=2", "parallel.sequence_parallel=true"]),
        ("gpt", ["parallel.dp=2", "parallel.pp=2", "parallel.zero=2", "parallel.micro_batches=2"]),
        ("gpt", ["parallel.dp=2", "parallel.tp=2", "parallel.zero=3", "parallel.sequence_parallel=true"]),
        ("gpt", ["parallel.dp=2", "parallel.pp=2", "parallel.zero=3", "parallel.micro_batches=2",
                 "parallel.reshard_after_forward=true"]),
        ("gpt", ["parallel.pp=4", "parallel.micro_batches=8", 'parallel.schedule="1f1b"']),
        ("gpt", ["parallel.dp=4", "parallel.bucket_mb=0.02"]),
        ("cnn", ["parallel.dp=2", "parallel.pp=2", "parallel.micro_batches=2", "parallel.zero=1"]),
        # stage 2 holds only a ReLU and a pooling layer: ZeRO-1 over no parameters
        ("cnn", ["parallel.pp=4", "parallel.micro_batches=4", "parallel.zero=1"]),
        ("cnn", ["parallel.dp=2", "parallel.pp=2", "parallel.micro_batches=2", "parallel.zero=2"]),
        ("cnn", ["parallel.dp=4", "parallel.zero=3"]),
        ("gpt", ["parallel.dp=4", "parallel.zero=3", "parallel.shard_size=2", "parallel.micro_batches=2"]),
        ("gpt", ["parallel.dp=4", "parallel.zero=1", "parallel.shard_size=2"]),
        ("gpt", ["parallel.dp=2", "parallel.tp=2", "parallel.zero=2", "parallel.shard_size=1",
                 "parallel.sequence_parallel=true"]),
        ("gpt", ["parallel.cp=2", "parallel.dp=2", "parallel.zero=1"]),
        ("gpt", ["parallel.cp=2", "parallel.tp=2", "parallel.sequence_parallel=true"]),
        ("gpt", ["parallel.cp=2", "parallel.pp=2", "parallel.micro_batches=2"]),
        ("gpt", ["parallel.cp=4"]),
        ("gpt", ["parallel.cp=2", "parallel.dp=2", "parallel.zero=3"]),
        ("gpt", ["parallel.cp=2", "parallel.dp=2", 'model.recompute="full"'])],
}


@pytest.fixture(scope="module")
def job_files():
    world = MPI.COMM_WORLD
    tokens = world_token_file("plan-traffic-")
    folder = os.path.dirname(tokens)
    files = {"gpt": os.path.join(folder, "gpt.toml"), "cnn": os.path.join(folder, "cnn.toml")}
    if world.Get_rank() == 0:
        for name, text in (("gpt", GPT.format(path=tokens)), ("cnn", CNN)):
            with open(files[name], "w") as f:
                f.write(text)
    world.barrier()
    return files


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("case", [(n, i) for n, cases in LAYOUTS.items() for i in range(len(cases))],
                         ids=[f"{n}ranks-{m}-{' '.join(o)}" for n, cases in LAYOUTS.items() for m, o in cases])
def test_bytes_per_step_equal_the_counters(case, job_files):
    world = MPI.COMM_WORLD
    ranks, index = case
    if world.Get_size() != ranks:
        pytest.skip(f"a {ranks}-rank layout")
    model, overrides = LAYOUTS[ranks][index]
    job = validate(load_job(job_files[model], overrides), ranks)
    counted = counted_step(job, world)
    if world.Get_rank() == 0:
        predicted = StepPlan(job, load_machine("dgx-a100")).predict().traffic.by_comm()
        assert predicted == counted


MOE = ["model.moe.experts=4"]  # dropless: the rows per step are known; where they go is the routing's
MOE_LAYOUTS = {2: [["parallel.ep=2"], ["parallel.ep=2", "parallel.zero=2", "parallel.bucket_mb=0.01"],
                   ["parallel.ep=2", "parallel.zero=3", "parallel.micro_batches=2"]],
               4: [["parallel.ep=4"], ["parallel.ep=2", "parallel.dp=4", "parallel.zero=1"],
                   ["parallel.ep=2", "parallel.dp=4", "parallel.zero=3", "parallel.bucket_mb=0.01"],
                   ["parallel.ep=2", "parallel.pp=2", "parallel.micro_batches=2", "parallel.zero=3"],
                   ["parallel.ep=2", "parallel.tp=2", "parallel.sequence_parallel=true"],
                   ["parallel.ep=2", "parallel.pp=2", "parallel.micro_batches=2"]]}


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("case", [(n, i) for n, cases in MOE_LAYOUTS.items() for i in range(len(cases))],
                         ids=[f"{n}ranks-moe-{' '.join(o)}" for n, cases in MOE_LAYOUTS.items() for o in cases])
def test_an_moe_step_s_bytes_equal_the_counters(case, job_files):
    """Every call and byte as counted, and the rows' wire bytes (those that leave their rank, which
    the planner takes as (ep-1)/ep of them: uniform routing) within 5 % of the real ones."""
    world = MPI.COMM_WORLD
    ranks, index = case
    if world.Get_size() != ranks:
        pytest.skip(f"a {ranks}-rank layout")
    job = validate(load_job(job_files["gpt"], [*MOE, *MOE_LAYOUTS[ranks][index]]), ranks)
    counted = counted_step(job, world)
    if world.Get_rank() == 0:
        predicted = StepPlan(job, load_machine("dgx-a100")).predict().traffic.by_comm()
        rows_wire = [(ops["alltoallv"][2], counted[comm]["alltoallv"][2]) for comm, ops in predicted.items()
                     if "alltoallv" in ops]
        assert rows_wire and all(abs(mine - real) <= 0.05 * real for mine, real in rows_wire), rows_wire
        for comm, ops in predicted.items():
            if "alltoallv" in ops:
                ops["alltoallv"] = ops["alltoallv"][:2]
                counted[comm]["alltoallv"] = counted[comm]["alltoallv"][:2]
        assert predicted == counted
