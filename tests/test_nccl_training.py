"""Training steps through the NCCL communicator, on CPUs: the transfer guard's device and the NCCL
double (tests/nccl_double.py). A few steps of the GPT under DDP, a pipeline, tensor, context and expert parallelism
end exactly where the same job on the MPI communicator ends (also ZeRO-1 and the
interleaved schedule, whose pair of ranks carries several channels), and every NCCL call passed the
double's stream-order checks. Run at 1, 2 and 4 ranks (layouts that do not fit are skipped).
"""
import os
import tempfile

import pytest
from mpi4py import MPI

import nccl_double
from hpcpar.runtime import nccl
from hpcpar.train.config_load import load_job
from hpcpar.train.loop import train
from hpcpar.train.validate import validate

from conftest import REPO

pytestmark = pytest.mark.mpi(min_size=1)
LAYOUTS = {"ddp": ["parallel.pp=1", "parallel.tp=1"],
           "pipeline": ["parallel.pp=2", "parallel.tp=1", 'parallel.schedule="1f1b"'],
           "interleaved": ["parallel.pp=2", "parallel.tp=1", 'parallel.schedule="interleaved"', "parallel.chunks=2",
                           "model.n_layer=4"],
           "tp": ["parallel.pp=1", "parallel.tp=2", "parallel.sequence_parallel=true"],
           "zero": ["parallel.pp=1", "parallel.tp=1", "parallel.zero=1"],
           "cp": ["parallel.pp=1", "parallel.tp=1", "parallel.cp=2"],  # ring attention's isend/irecv pairs
           "moe": ["parallel.pp=1", "parallel.tp=1", "model.moe.experts=4", "parallel.ep=2"],  # all-to-all on ep
           "ps": ["parallel.pp=1", "parallel.tp=1", 'parallel.mode="ps"', "parallel.servers=1", "data.batch_size=6"]}
RANKS_NEEDED = {"ddp": 1, "pipeline": 2, "interleaved": 2, "tp": 2, "zero": 1, "ps": 2, "cp": 2, "moe": 2}


@pytest.fixture(scope="module")
def folder():
    """A folder every rank sees, with a small token file."""
    world = MPI.COMM_WORLD
    path = None
    if world.Get_rank() == 0:
        from hpcpar.data.prepare import prepare

        path = tempfile.mkdtemp(prefix="hpcpar-nccl-")
        prepare(os.path.join(path, "tokens.h5"), max_mb=0.1, val_fraction=0.1)
    return world.bcast(path, root=0)


@pytest.fixture
def double(monkeypatch):
    """``parallel.backend = "nccl"`` finds the double where it would find CuPy's NCCL."""
    monkeypatch.setattr(nccl, "nccl_available", lambda: True)
    monkeypatch.setattr(nccl, "cupy_runtime", nccl_double.runtime)


def run(folder, name, layout, backend):
    size = MPI.COMM_WORLD.Get_size()
    # ps: one server, the rest workers; moe: every rank a replica, experts over pairs of them
    dp = {"ps": size - 1, "moe": size}.get(layout, size // RANKS_NEEDED[layout])
    overrides = [f"parallel.dp={dp}", 
        f"parallel.backend=\"{backend}\"", 'train.device="guard"', "train.steps=3",
        "train.log_interval=1", "model.n_layer=2", "model.n_embd=32", "model.n_head=2", "model.block_size=16",
        "data.batch_size=8", "parallel.micro_batches=2", f'data.path="{folder}/tokens.h5"', "train.eval_interval=0",
        "data.eval_batches=1", "train.sample_tokens=0", f'checkpoint.dir="{folder}/{name}/ckpt"',
        f'train.metrics="{folder}/{name}/metrics.jsonl"', 'checkpoint.resume="never"'] + LAYOUTS[layout]
    job = validate(load_job(os.path.join(REPO, "jobs", "demo.toml"), overrides), MPI.COMM_WORLD.Get_size())
    return train(job, progress="none")


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_training_through_nccl_ends_where_mpi_ends(folder, double, layout):
    size = MPI.COMM_WORLD.Get_size()
    if size < RANKS_NEEDED[layout] or size % RANKS_NEEDED[layout]:
        pytest.skip(f"{layout} needs a multiple of {RANKS_NEEDED[layout]} ranks")
    moved = lambda: sum(n for call, n in nccl_double.calls.items() if call != "init")  # noqa: E731
    before = moved()
    through_nccl = run(folder, f"{layout}-nccl", layout, "nccl")
    if layout != "ps":  # a parameter server's traffic is its own MPI communicator's: it only must keep working
        moved_most = MPI.COMM_WORLD.allreduce(moved() - before, op=MPI.MAX)
        if layout == "ddp" and size == 1:  # one replica: its gradients stay where they are
            assert moved_most == 0
        else:
            assert moved_most > 0  # NCCL moved the step's data
    through_mpi = run(folder, f"{layout}-mpi", layout, "mpi")
    if layout == "ps" and not through_nccl:
        return  # the server rank trains nothing and returns no metrics
    assert through_nccl["loss"] == through_mpi["loss"] and through_nccl["step"] == through_mpi["step"] == 3
