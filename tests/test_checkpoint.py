"""Checkpoints: exact resume, loading into other layouts, the plain-h5py global view, faults."""
import os
import subprocess
import sys

import h5py
import numpy as np
import pytest
from mpi4py import MPI

import hpcpar
from conftest import venv_bin
from dp_reference import DataParallelRun, max_difference
from hpcpar import checkpoint
from hpcpar.checkpoint import CheckpointError

TOTAL, SAVE_AT = 5, 2


def shared_dir(world, tmp_path_factory, name):
    """One folder for all ranks (rank 0 picks it, everyone gets it)."""
    path = str(tmp_path_factory.mktemp(name)) if world.Get_rank() == 0 else None
    return world.bcast(path, root=0)


def sub_context(world, size):
    """A context over the first ``size`` ranks (None on the others)."""
    group = world.Split(0 if world.Get_rank() < size else MPI.UNDEFINED, world.Get_rank())
    return None if group == MPI.COMM_NULL else hpcpar.init(comm=group, device="cpu")


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("zero, asynchronous", [(False, False), (True, False), (False, True)])
def test_resume_is_bitwise_identical(world, tmp_path_factory, zero, asynchronous):
    root = shared_dir(world, tmp_path_factory, "resume")
    ctx = hpcpar.init(device="cpu")
    straight = DataParallelRun(ctx, zero=zero)
    straight_losses = straight.train(range(TOTAL))

    first = DataParallelRun(ctx, zero=zero)
    losses = first.train(range(SAVE_AT))
    handle = checkpoint.save(root, SAVE_AT, first.model, first.optimizer, ctx, extra=first.extra(),
                             asynchronous=asynchronous)
    if asynchronous:
        first.train(range(SAVE_AT, SAVE_AT + 1))  # training goes on while the writer thread works
        handle.wait()

    resumed = DataParallelRun(ctx, zero=zero)
    info = checkpoint.load(root, resumed.model, resumed.optimizer, ctx, extra=resumed.extra())
    assert info["step"] == SAVE_AT
    losses += resumed.train(range(SAVE_AT, TOTAL))
    assert losses == straight_losses  # bitwise
    assert max_difference(resumed.parameters(), straight.parameters()) == 0.0


@pytest.mark.mpi(min_size=2)
def test_a_failed_shard_write_fails_the_save_on_every_rank(world, tmp_path_factory, monkeypatch):
    """A full disk on one rank: every rank raises, nothing is committed, the last checkpoint stays."""
    from hpcpar.checkpoint import writer

    root = shared_dir(world, tmp_path_factory, "disk-full")
    ctx = hpcpar.init(device="cpu")
    run = DataParallelRun(ctx)
    checkpoint.save(root, 1, run.model, run.optimizer, ctx, extra=run.extra())
    if ctx.rank == 1:
        def full_disk(*args):
            raise OSError(28, "No space left on device")
        monkeypatch.setattr(writer, "write_array", full_disk)
    with pytest.raises(CheckpointError, match=r"step-00000002 was not committed: rank 1: OSError: .*No space left"):
        checkpoint.save(root, 2, run.model, run.optimizer, ctx, extra=run.extra())
    world.Barrier()
    assert checkpoint.list_steps(root) == [1] and checkpoint.latest_step(root) == 1
    assert not os.path.exists(os.path.join(root, "step-00000002.tmp"))
    world.Barrier()  # every rank has looked before the next save makes the folder again
    monkeypatch.undo()
    checkpoint.save(root, 2, run.model, run.optimizer, ctx, extra=run.extra())  # the disk has room again
    assert checkpoint.latest_step(root) == 2


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("save_ranks, load_ranks, zero", [(None, 1, True), (None, 2, False), (1, None, False),
                                                         (2, None, True)])
def test_load_into_another_layout(world, tmp_path_factory, save_ranks, load_ranks, zero):
    """Save on one data-parallel width, load on another, continue: equals one process (1e-12), dropout
    included (its masks are keyed by step and sample, not by rank)."""
    size = world.Get_size()
    save_ranks, load_ranks = save_ranks or size, load_ranks or size
    root = shared_dir(world, tmp_path_factory, "relayout")
    reference = DataParallelRun(hpcpar.init(comm=MPI.COMM_SELF, device="cpu"))
    reference_losses = reference.train(range(TOTAL))

    ctx = sub_context(world, save_ranks)
    if ctx is not None:
        run = DataParallelRun(ctx, zero=zero)
        run.train(range(SAVE_AT))
        checkpoint.save(root, SAVE_AT, run.model, run.optimizer, ctx, extra=run.extra())
    world.Barrier()
    ctx = sub_context(world, load_ranks)
    if ctx is not None:
        run = DataParallelRun(ctx, zero=not zero)  # ZeRO <-> plain as well
        checkpoint.load(root, run.model, run.optimizer, ctx, extra=run.extra())
        losses = run.train(range(SAVE_AT, TOTAL))
        np.testing.assert_allclose(losses, reference_losses[SAVE_AT:], rtol=0, atol=1e-12)
        assert max_difference(run.parameters(), reference.parameters()) <= 1e-12
    world.Barrier()


@pytest.mark.mpi(min_size=1)
def test_master_file_is_the_global_state_dict_for_plain_h5py(world, tmp_path_factory):
    root = shared_dir(world, tmp_path_factory, "master")
    ctx = hpcpar.init(device="cpu")
    run = DataParallelRun(ctx, zero=True, dropout=0.0)
    run.train(range(2))
    step_dir = checkpoint.save(root, 2, run.model, run.optimizer, ctx, extra=run.extra())
    if ctx.rank == 0:
        single = DataParallelRun(hpcpar.init(comm=MPI.COMM_SELF, device="cpu"), dropout=0.0)
        single.train(range(2))
        with h5py.File(os.path.join(step_dir, "index.h5"), "r") as f:
            for name, value in single.model.state_dict().items():
                assert f[f"model/{name}"].is_virtual
                np.testing.assert_allclose(f[f"model/{name}"][...], value, rtol=0, atol=1e-12)
            # ZeRO wrote Adam's moments as runs of the flat vector; the view is still per parameter.
            moment = single.optimizer.state["blocks.0.mlp.fc.weight"]["exp_avg"]
            np.testing.assert_allclose(f["optim/blocks.0.mlp.fc.weight/exp_avg"][...], moment, atol=1e-12)
        assert len([n for n in os.listdir(step_dir) if n.startswith("shard-")]) == ctx.world_size
    world.Barrier()


@pytest.mark.mpi(min_size=1)
def test_keep_last_k_and_latest(world, tmp_path_factory):
    root = shared_dir(world, tmp_path_factory, "keep")
    ctx = hpcpar.init(device="cpu")
    run = DataParallelRun(ctx)
    for step in range(1, 5):
        checkpoint.save(root, step, run.model, run.optimizer, ctx, keep=2)
    assert checkpoint.list_steps(root) == [3, 4] and checkpoint.latest_step(root) == 4


# ----- faults: damaged files are named, the newest valid checkpoint is used ---------------
def damage(path, how):
    if how == "delete":
        os.remove(path)
    elif how == "truncate":
        with open(path, "r+b") as f:
            f.truncate(os.path.getsize(path) // 2)
    else:  # flip one byte in the middle
        with open(path, "r+b") as f:
            f.seek(os.path.getsize(path) // 2)
            byte = f.read(1)
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([byte[0] ^ 0xFF]))


@pytest.mark.parametrize("how", ["delete", "truncate", "flip"])
def test_damage_is_detected_by_load_naming_the_file(tmp_path, how):
    ctx = hpcpar.init(device="cpu")
    run = DataParallelRun(ctx)
    checkpoint.save(str(tmp_path), 1, run.model, run.optimizer, ctx, extra=run.extra())
    run.train(range(1))
    checkpoint.save(str(tmp_path), 2, run.model, run.optimizer, ctx, extra=run.extra())
    shard = os.path.join(tmp_path, "step-00000002", "shard-00000.h5")
    damage(shard, how)
    fresh = DataParallelRun(ctx)
    with pytest.raises(CheckpointError, match="shard-00000.h5"):
        checkpoint.load(str(tmp_path), fresh.model, fresh.optimizer, ctx)
    info = checkpoint.load_latest(str(tmp_path), fresh.model, fresh.optimizer, ctx, extra=fresh.extra())
    assert info["step"] == 1


def test_a_checkpoint_with_the_former_dropout_stream_loads_and_resumes_bitwise(tmp_path):
    """Checkpoints of earlier versions carry each rank's dropout generator ("rng"); masks are keyed
    now and nothing reads it, but such a checkpoint loads and the run goes on as if uninterrupted."""
    ctx = hpcpar.init(device="cpu")
    straight = DataParallelRun(ctx)
    straight.train(range(TOTAL))
    first = DataParallelRun(ctx)
    first.train(range(SAVE_AT))
    checkpoint.save(str(tmp_path), SAVE_AT, first.model, first.optimizer, ctx,
                    extra={**first.extra(), "rng": np.random.default_rng(3)})
    resumed = DataParallelRun(ctx)
    assert checkpoint.load(str(tmp_path), resumed.model, resumed.optimizer, ctx, extra=resumed.extra())["step"] == SAVE_AT
    resumed.train(range(SAVE_AT, TOTAL))
    assert max_difference(resumed.parameters(), straight.parameters()) == 0.0


def test_wrong_model_gives_a_clear_error(tmp_path):
    ctx = hpcpar.init(device="cpu")
    run = DataParallelRun(ctx)
    checkpoint.save(str(tmp_path), 1, run.model, None, ctx)
    from hpcpar.nn.gpt import GPT, GPTConfig

    other = GPT(GPTConfig(vocab_size=16, block_size=8, n_layer=2, n_head=2, n_embd=16), dtype=np.float64)
    with pytest.raises(CheckpointError, match=r"embed.wte.weight has global shape \(16, 8\) in the checkpoint but \(16, 16\)"):
        checkpoint.load(str(tmp_path), other, None, ctx)


KILLED_SAVE = """
import os, sys
sys.path.insert(0, {tests!r})
import hpcpar
from hpcpar import checkpoint
from hpcpar.checkpoint import writer as save_module
from dp_reference import DataParallelRun
ctx = hpcpar.init(device="cpu")
run = DataParallelRun(ctx)
checkpoint.save({root!r}, 1, run.model, run.optimizer, ctx, extra=run.extra())
real_sync = save_module.sync_and_checksum
def dying_sync(path, *rest):
    if ctx.rank == 1 and "step-00000002.tmp" in path:
        os._exit(9)   # killed in the middle of the save: its shard is written, nothing committed
    return real_sync(path, *rest)
save_module.sync_and_checksum = dying_sync
run.train(range(1))
checkpoint.save({root!r}, 2, run.model, run.optimizer, ctx, extra=run.extra())
"""


def test_a_rank_killed_during_save_leaves_the_previous_checkpoint(tmp_path):
    root = str(tmp_path / "ckpt")
    script = tmp_path / "killed.py"
    script.write_text(KILLED_SAVE.format(tests=os.path.dirname(__file__), root=root))
    proc = subprocess.run([venv_bin("mpiexec"), "-n", "2", sys.executable, str(script)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0
    assert os.path.isdir(os.path.join(root, "step-00000002.tmp"))
    assert checkpoint.list_steps(root) == [1] and checkpoint.latest_step(root) == 1
    ctx = hpcpar.init(device="cpu")
    fresh = DataParallelRun(ctx)
    assert checkpoint.load_latest(root, fresh.model, fresh.optimizer, ctx)["step"] == 1


@pytest.mark.skipif(h5py.get_config().mpi, reason="this h5py has parallel HDF5")
def test_collective_save_without_parallel_hdf5_is_a_clear_error(tmp_path):
    ctx = hpcpar.init(device="cpu")
    run = DataParallelRun(ctx)
    with pytest.raises(CheckpointError, match="needs h5py built against parallel HDF5"):
        checkpoint.save(str(tmp_path), 1, run.model, run.optimizer, ctx, collective=True)
    assert not os.path.exists(tmp_path / "step-00000001.tmp")  # refused before anything was written
