"""The checkpoint fault campaign: damage, mismatches, killed ranks, full disks, other HDF5 tools.

Every test ends by asserting that nothing was lost: each checkpoint that existed before still
verifies, ``latest`` names a committed step, and (where the scenario allows) a run resumed from
what is left equals an uninterrupted one bitwise.
"""
import json
import os
import shutil
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
from hpcpar.checkpoint import CheckpointError, save_files, writer
from hpcpar.checkpoint.manifest import CheckpointDamaged, verify_files
from services import run_script, unavailable

TESTS = os.path.dirname(os.path.abspath(__file__))
TOTAL = 5


def step_dir(root, step):
    return os.path.join(str(root), f"step-{step:08d}")


def assert_nothing_lost(root, steps):
    """Every step in ``steps`` is still there and verifies; ``latest`` names a committed, valid step."""
    for step in steps:
        assert os.path.isdir(step_dir(root, step)), f"step {step} is gone"
        assert verify_files(step_dir(root, step), checkpoint.read_manifest(step_dir(root, step))) == []
    latest = checkpoint.latest_step(root)
    assert latest in checkpoint.list_steps(root)
    assert verify_files(step_dir(root, latest), checkpoint.read_manifest(step_dir(root, latest))) == []


def saved_run(root, steps=(1, 2)):
    """A single-process run checkpointed after each of ``steps`` (trained one step between saves)."""
    ctx = hpcpar.init(comm=MPI.COMM_SELF, device="cpu")
    run = DataParallelRun(ctx)
    done = 0
    for step in steps:
        run.train(range(done, step))
        done = step
        checkpoint.save(str(root), step, run.model, run.optimizer, ctx, extra=run.extra())
    return ctx, run


def resumes_exactly(root, ctx, expected_step):
    """Load the latest good checkpoint into a fresh run, train to TOTAL: equals an uninterrupted run."""
    straight = DataParallelRun(ctx)
    straight_losses = straight.train(range(TOTAL))
    resumed = DataParallelRun(ctx)
    info = checkpoint.load_latest(str(root), resumed.model, resumed.optimizer, ctx, extra=resumed.extra())
    assert info["step"] == expected_step
    assert resumed.train(range(expected_step, TOTAL)) == straight_losses[expected_step:]
    assert max_difference(resumed.parameters(), straight.parameters()) == 0.0


def snapshot(run):
    """Every byte a load could change: parameters, optimizer state, schedule (dropout is keyed by
    the step and the sample, so no random stream is saved)."""
    state = {f"param {name}": p.data.tobytes() for name, p in run.model.named_parameters()}
    pieces, scalars = run.optimizer.checkpoint_pieces()  # any optimizer, ZeRO's shards too
    for piece in pieces:
        state[f"optim {piece.key} {piece.slab}"] = np.asarray(piece.array).tobytes()
    state["optim scalars"] = json.dumps(scalars, sort_keys=True)
    state["schedule"] = json.dumps(run.schedule.state_dict(), sort_keys=True)
    return state


def damage(path, how, where=0.5):
    if how == "missing":
        os.remove(path)
    elif how == "truncate":
        with open(path, "r+b") as f:
            f.truncate(int(os.path.getsize(path) * where))
    else:  # flip one bit
        with open(path, "r+b") as f:
            f.seek(int(os.path.getsize(path) * where))
            byte = f.read(1)
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([byte[0] ^ 0x10]))


# ----- damage falls back, a mismatch never does ----------------------------------------
@pytest.mark.parametrize("how", ["flip", "truncate", "missing", "manifest"])
def test_damage_falls_back_to_the_previous_step(tmp_path, how):
    ctx, run = saved_run(tmp_path)
    if how == "manifest":
        with open(os.path.join(step_dir(tmp_path, 2), "manifest.json"), "w") as f:
            f.write('{"format": "hpcpar-checkpoint", "vers')
    else:
        damage(os.path.join(step_dir(tmp_path, 2), "shard-00000.h5"), how)
    fresh = DataParallelRun(ctx)
    with pytest.raises(CheckpointDamaged, match="shard-00000.h5" if how != "manifest" else "unreadable manifest"):
        checkpoint.load(str(tmp_path), fresh.model, fresh.optimizer, ctx)
    assert checkpoint.latest_step(str(tmp_path)) == 2  # nothing rewrites latest behind the user's back
    assert_nothing_lost_but(tmp_path, damaged=2, kept=[1])
    resumes_exactly(tmp_path, ctx, expected_step=1)


def assert_nothing_lost_but(root, damaged, kept):
    for step in kept:
        assert verify_files(step_dir(root, step), checkpoint.read_manifest(step_dir(root, step))) == []
    assert os.path.isdir(step_dir(root, damaged))  # a damaged step is reported, never deleted


def test_a_bit_flip_is_found_wherever_it_is(tmp_path):
    """Every MiB a load reads is checked: flips near the start (HDF5's header), the middle and the end."""
    ctx, run = saved_run(tmp_path, steps=(1,))
    shard = os.path.join(step_dir(tmp_path, 1), "shard-00000.h5")
    pristine = open(shard, "rb").read()
    for where in (0.0, 0.3, 0.7, 0.999):
        damage(shard, "flip", where)
        fresh = DataParallelRun(ctx)
        with pytest.raises(CheckpointDamaged, match="checksum"):
            checkpoint.load(str(tmp_path), fresh.model, fresh.optimizer, ctx)
        open(shard, "wb").write(pristine)


@pytest.mark.parametrize("other", ["shape", "dtype", "name"])
def test_a_mismatch_is_an_error_never_a_fallback(tmp_path, other):
    from hpcpar.nn.gpt import GPT, GPTConfig

    ctx, run = saved_run(tmp_path)
    config = {"shape": dict(n_embd=16), "dtype": {}, "name": dict(n_layer=3)}[other]
    model = GPT(GPTConfig(**{**dict(vocab_size=16, block_size=8, n_layer=2, n_head=2, n_embd=8, seed=3), **config}),
                dtype=np.float64)
    if other == "dtype":  # integers where the model has floats (another precision is a cast, allowed)
        manifest_path = os.path.join(step_dir(tmp_path, 2), "manifest.json")
        manifest = json.load(open(manifest_path))
        manifest["tensors"]["model/embed.wte.weight"]["dtype"] = "int64"
        json.dump(manifest, open(manifest_path, "w"))
    before = {name: p.data.tobytes() for name, p in model.named_parameters()}
    expected = {"shape": "global shape", "dtype": "embed.wte.weight is int64 in the checkpoint but float64 here",
                "name": "no tensor 'model/blocks.2"}[other]
    with pytest.raises(CheckpointError, match=expected) as raised:
        checkpoint.load_latest(str(tmp_path), model, None, ctx)
    assert not isinstance(raised.value, CheckpointDamaged)
    assert "step-00000002" in str(raised.value)  # the latest step was refused, not skipped for step 1
    assert {name: p.data.tobytes() for name, p in model.named_parameters()} == before
    assert_nothing_lost(tmp_path, [1, 2])


def test_a_float64_checkpoint_loads_into_a_float32_model(tmp_path):
    """Another precision of the same kind is a cast (hpcpar generate samples any run in float32)."""
    from hpcpar.nn.gpt import GPT, GPTConfig

    ctx, run = saved_run(tmp_path, steps=(1,))
    model = GPT(GPTConfig(vocab_size=16, block_size=8, n_layer=2, n_head=2, n_embd=8, seed=3), dtype=np.float32)
    checkpoint.load(str(tmp_path), model, None, ctx)
    for name, p in model.named_parameters():
        assert p.data.dtype == np.float32
        np.testing.assert_array_equal(p.data, run.model.state_dict()[name].astype(np.float32))


# ----- a failed load changes nothing ---------------------------------------------------
class RefusingState:
    """An ``extra`` whose load_state_dict refuses (after the tensors were read)."""

    def state_dict(self):
        return {"x": 1}

    def load_state_dict(self, state):
        raise ValueError("this scaler cannot take that state")


@pytest.mark.parametrize("failure", ["mismatch", "damage_late", "extra"])
def test_a_failed_load_leaves_every_byte_as_it_was(tmp_path, failure):
    ctx, run = saved_run(tmp_path, steps=(1,))
    checkpoint.save(str(tmp_path), 2, run.model, run.optimizer, ctx,
                    extra={**run.extra(), "scaler": RefusingState()})
    target = DataParallelRun(ctx)
    target.train(range(3))  # a state of its own, different from the checkpoint's
    extra = target.extra()
    if failure == "mismatch":  # one optimizer tensor of another shape, the rest fits
        manifest_path = os.path.join(step_dir(tmp_path, 2), "manifest.json")
        manifest = json.load(open(manifest_path))
        key = sorted(k for k in manifest["tensors"] if k.startswith("optim/"))[-1]
        manifest["tensors"][key]["shape"][0] += 1
        json.dump(manifest, open(manifest_path, "w"))
    elif failure == "damage_late":  # the last bytes read: everything before was already in memory
        damage(os.path.join(step_dir(tmp_path, 2), "shard-00000.h5"), "flip", 0.999)
    else:
        extra["scaler"] = RefusingState()
    before = snapshot(target)
    with pytest.raises(CheckpointError):
        checkpoint.load(str(tmp_path), target.model, target.optimizer, ctx, extra=extra)
    assert snapshot(target) == before


# ----- latest and retention --------------------------------------------------------------
def test_latest_is_the_source_of_truth_and_retention_spares_other_runs(tmp_path):
    """A fresh run into a folder holding steps 50 and 60 writes 10, 20, 30 with keep=2."""
    ctx, run = saved_run(tmp_path, steps=(50, 60))
    for step in (10, 20, 30):
        checkpoint.save(str(tmp_path), step, run.model, run.optimizer, ctx, extra=run.extra(), keep=2)
        assert checkpoint.latest_step(str(tmp_path)) == step
        assert os.path.isdir(step_dir(tmp_path, step))  # never the step just written
    assert checkpoint.list_steps(str(tmp_path)) == [20, 30, 50, 60]
    fresh = DataParallelRun(ctx)
    assert checkpoint.load_latest(str(tmp_path), fresh.model, fresh.optimizer, ctx)["step"] == 30
    assert_nothing_lost(tmp_path, [20, 30, 50, 60])


def test_latest_naming_a_missing_step_falls_back_to_an_older_one(tmp_path):
    ctx, run = saved_run(tmp_path, steps=(1, 2))
    shutil.rmtree(step_dir(tmp_path, 2))
    fresh = DataParallelRun(ctx)
    assert checkpoint.load_latest(str(tmp_path), fresh.model, fresh.optimizer, ctx)["step"] == 1


# ----- index.h5 for every HDF5 tool -----------------------------------------------------
def test_a_missing_shard_reads_as_nan_in_plain_h5py(tmp_path):
    ctx, run = saved_run(tmp_path, steps=(1,))
    os.remove(os.path.join(step_dir(tmp_path, 1), "shard-00000.h5"))
    with h5py.File(os.path.join(step_dir(tmp_path, 1), "index.h5"), "r") as index:
        assert np.isnan(index["model/embed.wte.weight"][...]).all()


@pytest.fixture(scope="module")
def hdf5_tools():
    failure = run_script([os.path.join(TESTS, "hdf5_tools.sh")], "hdf5_tools.sh")
    if failure is not None:
        unavailable("hdf5-tools", failure)


def test_hdf5_1_10_tools_read_the_global_view(tmp_path, hdf5_tools):
    """Debian's h5ls lists every tensor of a real (ZeRO-sharded, 2-rank-like) checkpoint's index.h5,
    and h5dump of one tensor gives the bytes h5py reads."""
    ctx, run = saved_run(tmp_path, steps=(1,))
    folder = step_dir(tmp_path, 1)
    index = os.path.join(folder, "index.h5")
    listing = subprocess.run(["h5ls", "-r", index], capture_output=True, text=True, timeout=60)
    assert listing.returncode == 0, listing.stderr
    assert "*ERROR*" not in listing.stdout
    manifest = checkpoint.read_manifest(folder)
    listed = {line.split()[0].lstrip("/") for line in listing.stdout.splitlines() if "Dataset" in line}
    assert listed == set(manifest["tensors"])
    key = "optim/blocks.0.attn.qkv.weight/exp_avg"
    dumped = tmp_path / "dumped.bin"
    dump = subprocess.run(["h5dump", "-d", f"/{key}", "-b", "LE", "-o", str(dumped), index],
                          capture_output=True, text=True, timeout=60, cwd=folder)
    assert dump.returncode == 0, dump.stderr
    with h5py.File(index, "r") as f:
        expected = f[key][...]
    assert np.fromfile(dumped, dtype="<f8").reshape(expected.shape).tobytes() == expected.tobytes()
    assert not np.isnan(expected).any()


# ----- threads ---------------------------------------------------------------------------
def test_async_without_thread_multiple_is_written_synchronously(tmp_path, monkeypatch, caplog):
    ctx, run = saved_run(tmp_path, steps=(1,))
    monkeypatch.setattr(MPI, "Query_thread", lambda: MPI.THREAD_SERIALIZED)
    monkeypatch.setattr(writer, "_warned_threads", [])
    for step in (2, 3):
        written = checkpoint.save(str(tmp_path), step, run.model, run.optimizer, ctx, asynchronous=True)
        assert written == step_dir(tmp_path, step)  # a committed folder, not a background handle
    assert sum("THREAD_MULTIPLE" in r.getMessage() for r in caplog.records) == 1  # one warning
    assert_nothing_lost(tmp_path, [1, 2, 3])


# ----- a rank killed with SIGKILL in the middle of a save --------------------------------
KILLED = """
import os, signal, sys
sys.path.insert(0, {tests!r})
import hpcpar
from hpcpar import checkpoint
from hpcpar.checkpoint import writer
from dp_reference import DataParallelRun
ctx = hpcpar.init(device="cpu")
run = DataParallelRun(ctx)
run.train(range(1))
checkpoint.save({root!r}, 1, run.model, run.optimizer, ctx, extra=run.extra())
real = writer.sync_and_checksum
def dying(path, *rest):
    if ctx.rank == 1 and "step-00000002.tmp" in path:
        os.kill(os.getpid(), signal.SIGKILL)  # its shard written, not yet synced: nothing committed
    return real(path, *rest)
writer.sync_and_checksum = dying
run.train(range(1, 2))
handle = checkpoint.save({root!r}, 2, run.model, run.optimizer, ctx, extra=run.extra(), asynchronous={asynchronous})
if {asynchronous}:
    run.train(range(2, 3))  # training goes on while the writer thread dies
    handle.wait()
"""


@pytest.mark.parametrize("asynchronous", [False, True])
def test_a_rank_killed_mid_save_loses_nothing(tmp_path, asynchronous):
    root = str(tmp_path / "ckpt")
    script = tmp_path / "killed.py"
    script.write_text(KILLED.format(tests=TESTS, root=root, asynchronous=asynchronous))
    proc = subprocess.run([venv_bin("mpiexec"), "-n", "2", sys.executable, str(script)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert checkpoint.list_steps(root) == [1] and checkpoint.latest_step(root) == 1
    assert_nothing_lost(root, [1])
    resume = tmp_path / "resume.py"  # in the layout that saved (each rank's dropout stream is its own)
    resume.write_text(RESUMED.format(tests=TESTS, root=root))
    proc = subprocess.run([venv_bin("mpiexec"), "-n", "2", sys.executable, str(resume)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.count("resumed exactly") == 2, proc.stdout + proc.stderr


RESUMED = """
import sys
sys.path.insert(0, {tests!r})
import hpcpar
from hpcpar import checkpoint
from dp_reference import DataParallelRun, max_difference
ctx = hpcpar.init(device="cpu")
straight = DataParallelRun(ctx)
losses = straight.train(range(5))
resumed = DataParallelRun(ctx)
assert checkpoint.load_latest({root!r}, resumed.model, resumed.optimizer, ctx, extra=resumed.extra())["step"] == 1
assert resumed.train(range(1, 5)) == losses[1:]
assert max_difference(resumed.parameters(), straight.parameters()) == 0.0
print("resumed exactly")
"""


# ----- a full disk -------------------------------------------------------------------------
@pytest.fixture
def small_disk(tmp_path):
    """A 6 MiB tmpfs (root only: mounted here, unmounted after)."""
    mount = tmp_path / "disk"
    mount.mkdir()
    if os.geteuid() != 0:
        unavailable("tmpfs", "mounting a small tmpfs needs root")
    result = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=6m", "tmpfs", str(mount)],
                            capture_output=True, text=True)
    if result.returncode != 0:
        unavailable("tmpfs", f"mount -t tmpfs failed: {result.stderr.strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", str(mount)], check=True)


def fill(folder, leave):
    """Fill the file system of ``folder`` until ``leave`` bytes are free."""
    stat = os.statvfs(folder)
    free = stat.f_bavail * stat.f_frsize
    with open(os.path.join(folder, "filler"), "ab") as f:
        f.write(b"\0" * max(free - leave, 0))
    stat = os.statvfs(folder)
    return stat.f_bavail * stat.f_frsize


@pytest.mark.parametrize("leave", ["none", "half", "data_only", "enough"])
def test_a_full_disk_fails_before_a_byte_is_written(small_disk, leave):
    root = small_disk / "ckpt"
    ctx, run = saved_run(root, steps=(1,))
    data = sum(os.path.getsize(os.path.join(step_dir(root, 1), n))
               for n in os.listdir(step_dir(root, 1)) if n.startswith("shard-"))
    free = fill(small_disk, {"none": 0, "half": data // 2, "data_only": data + 4096,
                             "enough": data + save_files.MARGIN_BYTES + (1 << 20)}[leave])
    run.train(range(1, 2))
    if leave == "enough":
        checkpoint.save(str(root), 2, run.model, run.optimizer, ctx, extra=run.extra())
        assert_nothing_lost(root, [1, 2])
        return
    with pytest.raises(CheckpointError, match=rf"not enough free space: rank 0 on \S+ need \d+ bytes .*, {free} bytes"):
        checkpoint.save(str(root), 2, run.model, run.optimizer, ctx, extra=run.extra())
    assert sorted(os.listdir(root)) == ["latest", "step-00000001"]  # no .tmp: nothing was written
    assert_nothing_lost(root, [1])
    resumes_exactly(root, ctx, expected_step=1)


def test_a_disk_that_fills_during_the_save_raises_the_designed_error(small_disk, monkeypatch):
    """The space check passed, then the disk filled (another job): CheckpointError naming the
    rank, the .tmp folder removed, latest untouched."""
    root = small_disk / "ckpt"
    ctx, run = saved_run(root, steps=(1,))
    fill(small_disk, 64 << 10)
    monkeypatch.setattr(writer, "free_space", lambda folder: {"fs": ("h", 0), "free": 1 << 40})
    run.train(range(1, 2))
    with pytest.raises(CheckpointError, match=r"step-00000002 was not committed: rank 0: OSError: .*No space left"):
        checkpoint.save(str(root), 2, run.model, run.optimizer, ctx, extra=run.extra())
    assert sorted(os.listdir(root)) == ["latest", "step-00000001"]
    assert_nothing_lost(root, [1])
    resumes_exactly(root, ctx, expected_step=1)


def test_a_failed_fsync_of_a_shard_fails_the_save(tmp_path, monkeypatch):
    """The shard's fsync runs in a thread beside its checksums: an I/O error there fails the save
    (the shard may not be on the disk) rather than being printed by the thread and lost."""
    from hpcpar.checkpoint import manifest

    root = tmp_path / "ckpt"
    ctx, run = saved_run(root, steps=(1,))
    real = manifest.fsync_path

    def failing(path):
        if path.endswith(".h5") and "step-00000002" in path:
            raise OSError(5, "Input/output error")
        real(path)
    monkeypatch.setattr(manifest, "fsync_path", failing)
    run.train(range(1, 2))
    with pytest.raises(CheckpointError, match=r"step-00000002 was not committed: rank 0: OSError: .*Input/output"):
        checkpoint.save(str(root), 2, run.model, run.optimizer, ctx, extra=run.extra())
    assert sorted(os.listdir(root)) == ["latest", "step-00000001"]
    assert_nothing_lost(root, [1])


def test_ranks_on_one_file_system_add_up_their_bytes():
    spaces = [{"fs": ("node", 7), "free": 1000 << 20}, {"fs": ("node", 7), "free": 1000 << 20},
              {"fs": ("other", 7), "free": 1000 << 20}]
    everyone = [[("a", ((0, 1),), (1,), "float32")]] * 3
    assert save_files.space_shortfalls(spaces, [400 << 20, 400 << 20, 400 << 20], everyone) == []
    short = save_files.space_shortfalls(spaces, [600 << 20, 600 << 20, 600 << 20], everyone)
    assert len(short) == 1 and short[0].startswith("ranks 0, 1 on node need")


# ----- many MiBs, pieces across MiB boundaries, loads of other slabs ----------------------
def slab_params(values, cuts):
    """(name, Parameter) pairs holding the row ranges ``cuts`` of the global array ``values``."""
    from hpcpar.autograd.tensor import Parameter

    pairs = []
    for start, stop in zip(cuts[:-1], cuts[1:]):
        param = Parameter(values[start:stop].copy())
        param.global_shape, param.global_start = values.shape, (start, 0)
        pairs.append(("w", param))
    return pairs


def test_pieces_spanning_many_mib_load_into_other_slabs_and_every_mib_is_checked(tmp_path):
    """A 5.3 MiB tensor written as 3 uneven pieces (so pieces and MiB chunks overlap every way)
    loads into 4 other row ranges, exactly; a flipped bit in any MiB a load reads is found."""
    ctx = hpcpar.init(comm=MPI.COMM_SELF, device="cpu")
    values = np.random.default_rng(5).standard_normal((1393, 499))
    checkpoint.save(str(tmp_path), 1, slab_params(values, [0, 201, 1000, 1393]), None, ctx)
    target = slab_params(np.zeros_like(values), [0, 97, 650, 1001, 1393])
    checkpoint.load(str(tmp_path), target, None, ctx)
    assert np.concatenate([p.data for _, p in target]).tobytes() == values.tobytes()
    part = slab_params(np.zeros_like(values), [700, 900])  # reads only the MiBs holding rows 700..900
    checkpoint.load(str(tmp_path), part, None, ctx, strict=False)
    assert part[0][1].data.tobytes() == values[700:900].tobytes()
    shard = os.path.join(step_dir(tmp_path, 1), "shard-00000.h5")
    pristine = open(shard, "rb").read()
    assert len(pristine) > 5 << 20
    for where in (0.001, 0.19, 0.5, 0.81, 0.9999):
        damage(shard, "flip", where)
        fresh = slab_params(np.zeros_like(values), [0, 1393])
        with pytest.raises(CheckpointDamaged, match=r"shard-00000.h5: checksum .* for bytes"):
            checkpoint.load(str(tmp_path), fresh, None, ctx)
        assert not fresh[0][1].data.any()  # nothing went in
        open(shard, "wb").write(pristine)
    with h5py.File(os.path.join(step_dir(tmp_path, 1), "index.h5"), "r") as index:
        assert index["model/w"][...].tobytes() == values.tobytes()  # the global view, through HDF5


# ----- checkpoint.on_error in a training run ------------------------------------------------
@pytest.mark.parametrize("policy", ["warn", "stop"])
def test_a_training_run_on_a_full_disk_warns_or_stops(small_disk, token_file, policy):
    """The job's checkpoints do not fit the 6 MiB disk: "warn" trains to the end (exit 0) with one
    warning per checkpoint, "stop" ends the run with the error; neither leaves anything behind."""
    job = os.path.join(os.path.dirname(TESTS), "jobs", "gpt-dp.toml")
    args = [venv_bin("mpiexec"), "-n", "2", sys.executable, "-m", "hpcpar", "train", job,
            "--set", f'checkpoint.dir="{small_disk}/ckpt"', "--set", f'data.path="{token_file}"',
            "--set", f'train.metrics="{small_disk}/metrics.jsonl"', "--set", f'checkpoint.on_error="{policy}"',
            "--set", "train.steps=4", "--set", "checkpoint.interval=2", "--set", "train.eval_interval=0",
            "--set", "train.sample_tokens=0", "--set", "model.n_embd=256"]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OPENBLAS_NUM_THREADS": "1"})
    output = proc.stdout + proc.stderr
    assert "not enough free space: ranks 0, 1 on" in output, output
    if policy == "warn":
        assert proc.returncode == 0, output
        assert output.count('checkpoint.on_error = "warn"') == 2  # steps 2 and 4, once each (rank 0)
    else:
        assert proc.returncode != 0
        assert "step-00000002 was not written" in output
    assert checkpoint.list_steps(str(small_disk / "ckpt")) == []
    assert not [n for n in os.listdir(small_disk / "ckpt") if n.endswith(".tmp")]


def test_the_native_crc_equals_zlib():
    """build/libhpcpar_crc.so (when built: `make native`) gives zlib's CRC-32 for every length and start."""
    import zlib

    from hpcpar.checkpoint import crc

    rng = np.random.default_rng(3)
    # up to 200 bytes: zlib's tail and the 64-byte folding; 440-720: the 256-byte folding of
    # VPCLMULQDQ (used from 448 bytes) with every remainder; then whole MiBs
    for size in list(range(0, 200)) + list(range(440, 720)) + [4096, (1 << 20) + 13]:
        data = rng.integers(0, 256, size, dtype=np.uint8)
        for start in (0, 0x12345678):
            assert crc.crc32(data, start) == zlib.crc32(data, start)
            assert crc.crc32(data.tobytes(), start) == zlib.crc32(data, start)
    built = (crc.library_path().parent / crc.LIB_NAME).exists()
    cpu = open("/proc/cpuinfo").read() if os.path.exists("/proc/cpuinfo") else ""
    if built and " pclmulqdq" in cpu and " sse4_1" in cpu:
        assert crc._blocks() is not None, "libhpcpar_crc.so is built but failed its check against zlib"


def test_a_format_1_checkpoint_still_loads(tmp_path):
    """Checkpoints written before format 2 (a dataset per piece, one CRC-32 per file) load as
    before, through h5py; one is rebuilt here in that layout from a new one."""
    from hpcpar.checkpoint.manifest import file_checksum

    ctx, run = saved_run(tmp_path, steps=(1,))
    folder = step_dir(tmp_path, 1)
    manifest = checkpoint.read_manifest(folder)
    with h5py.File(os.path.join(folder, "index.h5"), "r") as index:
        tensors = {key: index[key][...] for key in manifest["tensors"]}
    os.remove(os.path.join(folder, "shard-00000.h5"))
    with h5py.File(os.path.join(folder, "shard-00000.h5"), "w") as shard:
        for n, (key, table) in enumerate(sorted(manifest["tensors"].items())):
            (piece,) = table["pieces"]
            piece["dataset"] = f"{n:05d}:{key.replace('/', '|')}"
            del piece["start"]
            shard[piece["dataset"]] = tensors[key]
    manifest["version"] = 1
    for name in ("shard-00000.h5", "index.h5"):
        path = os.path.join(folder, name)
        manifest["files"][name] = {"bytes": os.path.getsize(path), "crc32": file_checksum(path)}
    json.dump(manifest, open(os.path.join(folder, "manifest.json"), "w"))
    fresh = DataParallelRun(ctx)
    checkpoint.load(str(tmp_path), fresh.model, fresh.optimizer, ctx, extra=fresh.extra())
    assert snapshot(fresh) == snapshot(run)
    damage(os.path.join(folder, "shard-00000.h5"), "flip", 0.6)
    with pytest.raises(CheckpointDamaged, match="shard-00000.h5: checksum"):
        checkpoint.load(str(tmp_path), fresh.model, fresh.optimizer, ctx)


def test_a_folder_rank_0_cannot_make_fails_the_save_cleanly(tmp_path):
    """Rank 0 cannot create the step folder (here: a file where the root should be): a
    CheckpointError, not a traceback on rank 0 and the other ranks waiting for it."""
    ctx, run = saved_run(tmp_path / "ckpt", steps=(1,))
    blocked = tmp_path / "not-a-folder"
    blocked.write_text("")
    with pytest.raises(CheckpointError, match="was not written: rank 0 cannot make"):
        checkpoint.save(str(blocked / "ckpt"), 2, run.model, run.optimizer, ctx)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("zero", [False, True])
def test_damage_seen_by_one_rank_fails_the_load_on_every_rank_unchanged(world, tmp_path_factory, zero):
    """Each MiB is checked by one of the ranks reading it: a flip in the last shard fails every
    rank's load (the same error), and no rank changed a byte."""
    root = world.bcast(str(tmp_path_factory.mktemp("one-rank-damage")) if world.Get_rank() == 0 else None)
    ctx = hpcpar.init(device="cpu")
    run = DataParallelRun(ctx, zero=zero)
    run.train(range(2))
    checkpoint.save(root, 2, run.model, run.optimizer, ctx, extra=run.extra())
    world.Barrier()
    if ctx.rank == 0:
        damage(os.path.join(step_dir(root, 2), f"shard-{ctx.world_size - 1:05d}.h5"), "flip", 0.99)
    world.Barrier()
    target = DataParallelRun(ctx, zero=zero)
    target.train(range(3))
    before = snapshot(target)
    with pytest.raises(CheckpointDamaged, match=f"shard-{ctx.world_size - 1:05d}.h5: checksum"):
        checkpoint.load(root, target.model, target.optimizer, ctx, extra=target.extra())
    assert snapshot(target) == before
    world.Barrier()


def test_a_load_into_a_trained_run_fills_its_arrays_in_place(tmp_path):
    """Parameters and the optimizer's current state are read straight into (the same arrays,
    no new memory), byte-exact; an optimizer without state gets new arrays, also exact."""
    ctx, run = saved_run(tmp_path, steps=(2,))
    trained = DataParallelRun(ctx)
    trained.train(range(3))
    arrays = [p.data for p in trained.model.parameters()]
    arrays += [v for state in trained.optimizer.state.values() for v in state.values() if isinstance(v, np.ndarray)]
    checkpoint.load(str(tmp_path), trained.model, trained.optimizer, ctx, extra=trained.extra())
    assert snapshot(trained) == snapshot(run)
    now = [p.data for p in trained.model.parameters()]
    now += [v for state in trained.optimizer.state.values() for v in state.values() if isinstance(v, np.ndarray)]
    assert all(a is b for a, b in zip(arrays, now))
    fresh = DataParallelRun(ctx)
    checkpoint.load(str(tmp_path), fresh.model, fresh.optimizer, ctx, extra=fresh.extra())
    assert snapshot(fresh) == snapshot(run)


def test_the_copy_into_destinations_is_exact_at_any_size_and_alignment():
    """fastcopy.copy_pieces (native streaming stores from 256 KiB, when built) copies every byte
    of every pair, whatever the sizes and the alignment of either side, and nothing around them."""
    from hpcpar.checkpoint import fastcopy

    rng = np.random.default_rng(5)
    source = rng.integers(0, 256, 3 << 20, dtype=np.uint8)
    for size in (0, 1, 15, 100, (256 << 10) - 1, 256 << 10, (256 << 10) + 13, (1 << 20) + 7):
        for shift in (0, 1, 7, 16, 63):
            destination = np.zeros(size + 128, dtype=np.uint8)
            fastcopy.copy_pieces([(destination[shift: shift + size], source[3 - shift % 4: 3 - shift % 4 + size]),
                                  (destination[:0], source[:0])])
            assert np.array_equal(destination[shift: shift + size], source[3 - shift % 4: 3 - shift % 4 + size])
            assert not destination[:shift].any() and not destination[shift + size:].any()


@pytest.mark.parametrize("without", ["mapping", "native copy"])
def test_a_load_without_file_mapping_or_the_native_copy_is_the_same(tmp_path, monkeypatch, without):
    """A file system that cannot map files (the bytes are read instead), or no native library
    (NumPy copies): the same bytes load, and damage is still found."""
    from hpcpar.checkpoint import fastcopy, source

    if without == "mapping":
        def unmappable(*args, **kwargs):
            raise OSError(19, "No such device")
        monkeypatch.setattr(source.mmap, "mmap", unmappable)
    else:
        monkeypatch.setitem(fastcopy._state, "copy", None)
    ctx, run = saved_run(tmp_path, steps=(1,))
    trained = DataParallelRun(ctx)
    trained.train(range(2))
    checkpoint.load(str(tmp_path), trained.model, trained.optimizer, ctx, extra=trained.extra())
    assert snapshot(trained) == snapshot(run)
    damage(os.path.join(step_dir(tmp_path, 1), "shard-00000.h5"), "flip", 0.6)
    before = snapshot(trained)
    with pytest.raises(CheckpointDamaged, match="checksum"):
        checkpoint.load(str(tmp_path), trained.model, trained.optimizer, ctx)
    assert snapshot(trained) == before


def test_a_file_cut_short_after_its_check_is_damage_not_a_crash(tmp_path, monkeypatch):
    """A shard truncated between the check and the copy into the model (the mapping would fault
    past the file's end): a CheckpointDamaged naming it, raised before a byte is copied."""
    from hpcpar.checkpoint import source

    ctx, run = saved_run(tmp_path, steps=(1,))
    shard = os.path.join(step_dir(tmp_path, 1), "shard-00000.h5")
    checked = source.RawSource.read_and_verify

    def check_then_truncate(self, mine):
        problems = checked(self, mine)
        damage(shard, "truncate", 0.5)
        return problems
    monkeypatch.setattr(source.RawSource, "read_and_verify", check_then_truncate)
    trained = DataParallelRun(ctx)
    trained.train(range(2))
    before = snapshot(trained)
    with pytest.raises(CheckpointDamaged, match="shorter than when it was checked"):
        checkpoint.load(str(tmp_path), trained.model, trained.optimizer, ctx)
    assert {k: v for k, v in snapshot(trained).items() if k.startswith("param")} == \
        {k: v for k, v in before.items() if k.startswith("param")}


def test_a_model_that_takes_only_some_tensors_needs_strict_false(tmp_path):
    """``strict``: a checkpoint tensor no rank of the model reads is an error naming it, before
    anything changes; ``strict=False`` loads the rest."""
    from hpcpar.autograd.tensor import Parameter

    ctx = hpcpar.init(comm=MPI.COMM_SELF, device="cpu")
    rng = np.random.default_rng(7)
    saved = [(name, Parameter(rng.standard_normal(3))) for name in ("a", "b", "c")]
    checkpoint.save(str(tmp_path), 1, saved, None, ctx)
    fewer = [(name, Parameter(np.zeros(3))) for name in ("a", "c")]
    with pytest.raises(CheckpointError, match=r"tensors no rank of this model takes: \['model/b'\]"):
        checkpoint.load(str(tmp_path), fewer, None, ctx)
    assert not any(p.data.any() for _, p in fewer)
    checkpoint.load(str(tmp_path), fewer, None, ctx, strict=False)
    assert [p.data.tolist() for _, p in fewer] == [saved[0][1].data.tolist(), saved[2][1].data.tolist()]


def test_the_model_tensors_no_rank_reads_in_either_form_each_rank_sends():
    """Each rank sends the shorter list: the tensors it leaves unread (a replica: none) or those
    it reads (a pipeline stage); the tensors no rank reads are the same either way."""
    from hpcpar.checkpoint.reader import model_keys_taken, unused_model_keys
    from hpcpar.state import Read

    manifest = {"tensors": {f"model/{k}": {} for k in "abcdef"} | {"optim/a/exp_avg": {}}}
    reads = lambda keys: [Read(f"model/{k}", (1,), ((0, 1),), None) for k in keys]  # noqa: E731
    assert model_keys_taken(manifest, reads("abcdef")) == ("unread", [])
    assert model_keys_taken(manifest, reads("ab")) == ("read", ["model/a", "model/b"])
    assert model_keys_taken(manifest, reads("abcd")) == ("unread", ["model/e", "model/f"])
    stages = [model_keys_taken(manifest, reads(keys)) for keys in ("ab", "bcd", "a")]
    assert unused_model_keys(manifest, stages) == ["model/e", "model/f"]
    assert unused_model_keys(manifest, stages + [model_keys_taken(manifest, reads("abcde"))]) == ["model/f"]
