"""``hpcpar compare``'s loop: layout after layout in one MPI job (2 and 4 ranks).

For each layout the first dp x pp x tp ranks split a group off the world, build the context,
model and strategy, train, and free the group, while the other ranks wait; then the next layout.
Every rank must build the same job in every layout: ``bench/plan_validation.py`` once had each
rank rewrite one shared job file while others read it, a rank read it half written and built the
default model, and MPICH failed the parameter broadcast ("Other MPI error") in one run of two.
Each rank now reads its own file, and compare checks that every rank holds the same job before a
layout runs (``JobsDiffer``, one clear report instead of an MPI error).
"""
import importlib.util
import math
import os

import pytest
from conftest import REPO, world_token_file
from mpi4py import MPI

from hpcpar import compare
from hpcpar.runtime.comm import Communicator
from hpcpar.train.config import JobError
from hpcpar.train.config_load import load_job

TINY = ["model.n_layer=2", "model.n_embd=32", "model.n_head=4", "model.block_size=16", "data.batch_size=16",
        'train.device="cpu"']


@pytest.fixture(scope="module")
def tokens():
    return world_token_file("compare-loop-")


@pytest.fixture
def plan_validation(monkeypatch):
    """bench/plan_validation.py as a module (the environment it sets on import is put back afterwards)."""
    for name in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "HPCPAR_STALL_S"):
        monkeypatch.setenv(name, os.environ.get(name, "0" if name == "HPCPAR_STALL_S" else "1"))
    spec = importlib.util.spec_from_file_location("plan_validation", os.path.join(REPO, "bench", "plan_validation.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.mpi(min_size=2)
def test_every_layout_is_built_trained_and_torn_down_in_one_job(tokens):
    world = MPI.COMM_WORLD
    waiting = Communicator(world, "world", wait_policy="yield")
    job = load_job(None, TINY + [f'data.path="{tokens}"'])
    layouts = [(1, 1, 1, 1)] + compare.factorisations(world.Get_size())
    measured = []
    for _ in range(2):  # the second round's groups reuse the first round's freed context ids
        for layout in layouts:
            try:
                layout_run = compare.layout_job(job, layout, steps=1)
            except JobError:
                continue
            figures = compare.measure_on_first_ranks(layout_run, world, steps=1)
            inside = world.Get_rank() < math.prod(layout)
            assert (figures is not None) == inside
            if world.Get_rank() == 0:
                measured.append(tuple(figures["layout"]))
            waiting.barrier()
    if world.Get_rank() == 0:
        assert measured == 2 * layouts


@pytest.mark.mpi(min_size=2)
def test_the_validation_jobs_are_read_alike_on_every_rank(plan_validation):
    world = MPI.COMM_WORLD
    for _ in range(20):  # a shared file raced within a few rounds at 2 ranks
        for name, text in plan_validation.HELD_OUT:
            job = plan_validation.job_from(text, name).to_dict()
            assert all(other == job for other in world.allgather(job)), f"{name}: ranks read different jobs"


@pytest.mark.mpi(min_size=2)
def test_ranks_holding_different_jobs_are_told_so_before_any_layout_runs(tokens):
    world = MPI.COMM_WORLD
    width = "model.n_embd=32" if world.Get_rank() == 0 else "model.n_embd=64"  # as a half-read job file gave
    job = compare.layout_job(load_job(None, TINY + [width, f'data.path="{tokens}"']), (world.Get_size(), 1, 1), steps=1)
    with pytest.raises(compare.JobsDiffer, match=r"world rank\(s\) \[1(, \d)*\] hold another job than rank 0") as raised:
        compare.measure_on_first_ranks(job, world, steps=1)
    assert raised.value.report_elsewhere == (world.Get_rank() != 0)  # one report, from rank 0


def test_each_layout_is_built_with_the_jobs_communication_keys(monkeypatch):
    """``hpcpar compare JOB --set parallel.shm=false`` measured with the shared-memory collectives on
    (and parallel.node_size, backend, device_nonblocking were dropped too): its contexts took only
    the grid and the device from the job."""
    made = []

    def recording_init(**kwargs):
        ctx = compare_init(**kwargs)
        made.append((kwargs, ctx.shm, ctx.shm_node_size))
        return ctx

    compare_init = compare.init
    monkeypatch.setattr(compare, "init", recording_init)
    cnn = ["model.kind=cnn", "data.kind=digits", "data.batch_size=8", 'train.device="cpu"']
    cases = ((["parallel.shm=false"], False, None), (["parallel.shm=true", "parallel.node_size=1"], True, 1))
    for keys, shm, node_size in cases:
        job = compare.layout_job(load_job(None, cnn + keys), (1, 1, 1), steps=1)
        compare.measure(job, MPI.COMM_SELF, steps=1)
        kwargs, got_shm, got_node_size = made.pop()
        assert (got_shm, got_node_size) == (shm, node_size)
        assert kwargs["backend"] == "auto" and kwargs["device_nonblocking"] is None


@pytest.mark.mpi(min_size=2)
def test_a_pipeline_with_dropout_is_measured_with_the_step_s_masks(tokens):
    """compare (and the planner's counted step) trained steps outside the training loop, which alone
    set the step's dropout key: a pipeline of a job with dropout (whose engine runs the stages'
    layers, not the GPT's keyed forward) ended in 'Dropout in training mode draws the masks of a
    dropout key'."""
    from hpcpar.plan.measure import counted_step

    world = MPI.COMM_WORLD
    job = compare.layout_job(load_job(None, TINY + [f'data.path="{tokens}"', "model.dropout=0.1"]), (1, 2, 1), steps=1)
    figures = compare.measure_on_first_ranks(job, world, steps=1)
    assert (figures is not None) == (world.Get_rank() < 2)
    Communicator(world, "world", wait_policy="yield").barrier()
    pair = world.Split(0 if world.Get_rank() < 2 else MPI.UNDEFINED)
    if pair != MPI.COMM_NULL:
        counts = counted_step(job, pair)
        assert (counts is not None) == (world.Get_rank() == 0)
        pair.Free()
