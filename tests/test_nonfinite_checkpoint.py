"""A checkpoint with a non-finite weight or optimizer value is never committed: the save checks
every floating piece in the pass that computes its CRC-32s (natively; NumPy where the library is
not built), refuses on every rank naming the tensor, and ``latest`` stays on the previous step."""
import os

import numpy as np
import pytest

import hpcpar
from dp_reference import DataParallelRun
from hpcpar import checkpoint
from hpcpar.checkpoint import NonFiniteCheckpoint, crc


def shared_dir(world, tmp_path_factory, name):
    path = str(tmp_path_factory.mktemp(name)) if world.Get_rank() == 0 else None
    return world.bcast(path, root=0)


def poison(run, value=np.nan, which=-1):
    """``value`` into one entry of a parameter on every replica (the rank that writes it finds it)."""
    name, param = list(run.model.named_parameters())[which]
    param.data.reshape(-1)[3] = value
    return name


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf])
def test_a_non_finite_weight_on_any_rank_is_never_committed(world, tmp_path_factory, value):
    root = shared_dir(world, tmp_path_factory, "nonfinite")
    ctx = hpcpar.init(device="cpu")
    run = DataParallelRun(ctx)
    checkpoint.save(root, 1, run.model, run.optimizer, ctx, extra=run.extra(), keep=1)
    run.train(range(1))
    name = poison(run, value)
    with pytest.raises(NonFiniteCheckpoint, match=rf"model/{name} \(1 of \d+\).*latest stays step-00000001"):
        checkpoint.save(root, 2, run.model, run.optimizer, ctx, extra=run.extra(), keep=1)
    ctx.world.barrier()
    assert checkpoint.list_steps(root) == [1] and checkpoint.latest_step(root) == 1  # keep = 1 kept step 1
    assert not os.path.exists(os.path.join(root, "step-00000002.tmp"))


@pytest.mark.mpi(min_size=2)
def test_an_asynchronous_save_of_non_finite_values_fails_on_wait(world, tmp_path_factory):
    root = shared_dir(world, tmp_path_factory, "nonfinite_async")
    ctx = hpcpar.init(device="cpu")
    run = DataParallelRun(ctx)
    checkpoint.save(root, 1, run.model, run.optimizer, ctx, extra=run.extra())
    poison(run, which=0)
    with pytest.raises(NonFiniteCheckpoint):  # raised by wait(), or by save where MPI threads cannot call MPI
        checkpoint.save(root, 2, run.model, run.optimizer, ctx, extra=run.extra(), asynchronous=True)
        checkpoint.wait()
    assert checkpoint.latest_step(root) == 1


def test_the_fused_check_counts_what_numpy_counts_at_any_offset():
    rng = np.random.default_rng(0)
    data = rng.integers(0, 256, (5 << 20) + 12345, dtype=np.uint8)
    ranges, expected = [], []
    for start, dtype, size in [(1001, np.float32, 300_000), (1_500_000, np.int64, 10),
                               (2_000_003, np.float64, 200_000), (4_000_001, np.float16, 100_000)]:
        values = rng.standard_normal(size).astype(dtype)
        if values.dtype.kind == "f":
            values[rng.choice(size, 5, replace=False)] = [np.nan, np.inf, -np.inf, np.nan, 1.0]
        data[start: start + values.nbytes] = values.view(np.uint8)
        ranges.append((start, size, values.dtype.name))
        expected.append(size - int(np.count_nonzero(np.isfinite(values))) if values.dtype.kind == "f" else 0)
    whole = [crc.crc32(data[at: at + (1 << 20)]) for at in range(0, data.size, 1 << 20)]
    native = crc.crc32_chunks_and_nonfinite(data, 1 << 20, ranges)
    assert native == (whole, expected)
    assert crc.crc32_chunks_and_nonfinite(data, 3 << 19, ranges)[1] == expected  # not a whole block: NumPy


def test_verify_reports_the_non_finite_tensors_of_a_checkpoint_written_without_the_check(tmp_path, monkeypatch):
    """A checkpoint from before the check (made here by leaving it out) verifies as NOT valid,
    one line per piece with inf or NaN; a finite one verifies as valid."""
    import subprocess
    import sys

    from hpcpar.checkpoint import writer

    ctx = hpcpar.init(device="cpu")
    run = DataParallelRun(ctx)
    checkpoint.save(str(tmp_path), 1, run.model, run.optimizer, ctx, extra=run.extra())
    name = poison(run, np.inf)
    monkeypatch.setattr(writer, "float_ranges", lambda pieces, offsets: [])
    checkpoint.save(str(tmp_path), 2, run.model, run.optimizer, ctx, extra=run.extra())

    def verify(step):
        return subprocess.run([sys.executable, "-m", "hpcpar", "ckpt", "verify", str(tmp_path / f"step-0000000{step}")],
                              capture_output=True, text=True, timeout=120)

    bad, good = verify(2), verify(1)
    assert bad.returncode == 1 and f"model/{name}: 1 of " in bad.stdout and "are inf or NaN" in bad.stdout, bad.stdout
    assert "1 tensor piece(s) with inf or NaN" in bad.stderr
    assert good.returncode == 0 and "every float finite" in good.stdout, good.stdout + good.stderr
