"""``hpcpar ckpt ls | inspect | verify | export`` as a user runs them: a subprocess, exit codes, output."""
import json
import os
import shutil
import subprocess
import sys

import h5py
import numpy as np
import pytest

import hpcpar
from conftest import REPO
from hpcpar import checkpoint
from hpcpar.nn.gpt import GPT, GPTConfig
from hpcpar.optim import AdamW

STEPS = (3, 7)  # two committed steps; 7 is the latest
SHARD = "shard-00000.h5"


def ckpt(*args):
    return subprocess.run([sys.executable, "-m", "hpcpar", "ckpt", *map(str, args)], cwd=REPO,
                          capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A checkpoint root written in this process, and copies of what it holds at the last step."""
    root = tmp_path_factory.mktemp("ckpt") / "root"
    ctx = hpcpar.init(device="cpu")
    model = GPT(GPTConfig(vocab_size=32, block_size=8, n_layer=1, n_head=2, n_embd=16))
    optimizer = AdamW(model.named_parameters(), lr=1e-3)
    ids = np.random.default_rng(0).integers(0, 32, (2, 9))
    for step in STEPS:
        model.loss(ids[:, :-1], ids[:, 1:]).backward()
        optimizer.step()
        optimizer.zero_grad()
        checkpoint.save(str(root), step, model, optimizer, ctx, extra={"data_epoch": 2})
    state = {f"model/{name}": array.copy() for name, array in model.state_dict().items()}
    for name, values in optimizer.state.items():
        state.update({f"optim/{name}/{key}": value.copy() for key, value in values.items() if np.ndim(value)})
    return root, state


@pytest.fixture
def root(saved, tmp_path):
    """A private copy of the checkpoint root (tests damage it)."""
    copy = tmp_path / "root"
    shutil.copytree(saved[0], copy)
    return copy


def latest_dir(root):
    return root / f"step-{STEPS[-1]:08d}"


def test_ls_lists_steps_marks_latest_and_ignores_tmp(root):
    (root / "step-00000011.tmp").mkdir()  # a save that died
    result = ckpt("ls", root)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    rows = {int(line.split()[1] if line.startswith("latest") else line.split()[0]): line
            for line in lines if line.strip() and line.split()[0] in ("latest", "3", "7", "11")}
    assert set(rows) == {3, 7, 11}
    assert rows[7].split()[0] == "latest" and "yes" in rows[7]
    assert "latest" not in rows[3] and "yes" in rows[3]
    assert "1/1/1/1" in rows[7]
    assert "incomplete (ignored)" in rows[11]


def test_ls_reports_a_damaged_step(root):
    os.remove(latest_dir(root) / SHARD)
    result = ckpt("ls", root)
    assert result.returncode == 0
    row = next(line for line in result.stdout.splitlines() if line.startswith("latest"))
    assert "NO" in row
    assert f"hpcpar ckpt verify {latest_dir(root)}" in result.stdout


@pytest.mark.parametrize("where", ["root", "step folder"])
def test_inspect_lists_tensors_with_shapes(root, where):
    result = ckpt("inspect", root if where == "root" else root / "step-00000003")
    assert result.returncode == 0, result.stderr
    assert f"step        {STEPS[-1] if where == 'root' else 3}" in result.stdout
    assert "dp 1 x pp 1 x tp 1 = 1 ranks" in result.stdout
    assert "data_epoch = 2" in result.stdout
    row = next(line for line in result.stdout.splitlines() if line.startswith("model/embed.wte.weight "))
    assert row.split()[1:] == ["32x16", "float32", "1", SHARD]
    row = next(line for line in result.stdout.splitlines() if line.startswith("optim/blocks.0.mlp.fc.weight/exp_avg "))
    assert row.split()[1] == "16x64"


def flip_middle_byte(path):
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))


DAMAGE = {
    "delete shard": (SHARD, lambda path: os.remove(path), "missing"),
    "truncate shard": (SHARD, lambda path: os.truncate(path, os.path.getsize(path) // 2), "truncated"),
    "truncate index": ("index.h5", lambda path: os.truncate(path, 100), "truncated"),
    "flip a shard byte": (SHARD, flip_middle_byte, "checksum"),
}


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_verify_passes_then_names_the_damaged_file(root, damage):
    name, harm, word = DAMAGE[damage]
    result = ckpt("verify", root)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "valid" in result.stdout

    path = latest_dir(root) / name
    harm(path)
    result = ckpt("verify", root)
    assert result.returncode == 1
    problems = result.stdout.splitlines()
    assert problems and all(line.startswith(f"{path}:") for line in problems), problems
    assert word in problems[0]
    assert "Traceback" not in result.stderr
    assert ckpt("verify", root / "step-00000003").returncode == 0  # the other step is untouched


def test_export_writes_plain_datasets_equal_to_the_state(root, saved, tmp_path):
    out = tmp_path / "model.h5"
    result = ckpt("export", root, out)
    assert result.returncode == 0, result.stderr
    state = saved[1]
    with h5py.File(out, "r") as f:
        assert f.attrs["step"] == STEPS[-1]
        assert json.loads(f.attrs["layout"]) == {"dp": 1, "pp": 1, "tp": 1, "world": 1}
        assert json.loads(f.attrs["manifest"])["step"] == STEPS[-1]
        keys = []
        f.visititems(lambda key, obj: keys.append(key) if isinstance(obj, h5py.Dataset) else None)
        assert sorted(keys) == sorted(state)
        for key, expected in state.items():
            assert not f[key].is_virtual
            assert f[key].dtype == expected.dtype
            np.testing.assert_array_equal(f[key][()], expected, err_msg=key)
    shutil.rmtree(root)  # the export stands alone
    with h5py.File(out, "r") as f:
        np.testing.assert_array_equal(f["model/embed.wte.weight"][()], state["model/embed.wte.weight"])


def test_export_refuses_a_damaged_checkpoint(root, tmp_path):
    flip_middle_byte(latest_dir(root) / SHARD)
    out = tmp_path / "model.h5"
    result = ckpt("export", root, out)
    assert result.returncode == 1
    assert "refusing to export" in result.stderr and SHARD in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    assert not out.exists() and not (tmp_path / "model.h5.tmp").exists()


@pytest.mark.parametrize("action", ["inspect", "verify"])
def test_missing_checkpoint_is_one_clear_line(tmp_path, action):
    result = ckpt(action, tmp_path / "nowhere")
    assert result.returncode == 1
    assert result.stderr.strip() == f"hpcpar ckpt {action}: error: {tmp_path / 'nowhere'}: no committed checkpoint here"


def test_ls_of_a_missing_folder_and_usage_errors(tmp_path):
    result = ckpt("ls", tmp_path / "nowhere")
    assert result.returncode == 1 and "no such folder" in result.stderr and "Traceback" not in result.stderr
    result = ckpt("frobnicate")
    assert result.returncode == 2 and "invalid choice" in result.stderr


def ckpt_in_process(capsys, *args):
    """``hpcpar ckpt ARGS`` in this process: (exit status, stderr lines)."""
    from hpcpar import cli

    parsed = cli.build_parser("ckpt").parse_args(["ckpt", *map(str, args)])
    status = parsed.func(parsed)
    return status, capsys.readouterr().err.splitlines()


def test_export_refuses_an_output_it_cannot_write_before_reading_a_tensor(root, tmp_path, capsys):
    """An export onto a step folder's own index.h5 replaced it (exit 0) and the checkpoint no longer
    verified; a folder or a path under a file as OUT was an errno line after the whole copy."""
    before = {name: (latest_dir(root) / name).read_bytes() for name in os.listdir(latest_dir(root))}
    (tmp_path / "afile").write_text("x")
    for out, message in ((latest_dir(root) / "index.h5", "is a checkpoint's step folder, and writing into it "
                                                         "would damage it; write elsewhere"),
                         (root / "step-00000003" / "new.h5", "is a checkpoint's step folder"),
                         (tmp_path, "it is a folder; give the path of a file"),
                         (tmp_path / "afile" / "o.h5", f"it cannot be made: {tmp_path}/afile is a file, not a folder")):
        status, lines = ckpt_in_process(capsys, "export", root, out)
        assert status == 1 and len(lines) == 1 and lines[0].startswith(f"hpcpar ckpt export: error: {out}: "), lines
        assert message in lines[0], lines
    assert {name: (latest_dir(root) / name).read_bytes() for name in os.listdir(latest_dir(root))} == before
    assert sorted(os.listdir(tmp_path)) == ["afile", "root"]
    status, _ = ckpt_in_process(capsys, "export", root, tmp_path / "new" / "model.h5")  # a missing folder is made
    assert status == 0 and (tmp_path / "new" / "model.h5").is_file()


@pytest.mark.parametrize("action", ["ls", "inspect", "verify"])
def test_a_file_given_as_a_checkpoint_is_named_as_such(tmp_path, capsys, action):
    (tmp_path / "job.toml").write_text("")  # was "[Errno 20] Not a directory: 'job.toml/latest'"
    status, lines = ckpt_in_process(capsys, action, tmp_path / "job.toml")
    assert status == 1 and lines == [f"hpcpar ckpt {action}: error: {tmp_path}/job.toml: a file, not a folder; give "
                                     f"a checkpoint root (checkpoint.dir)" + ("" if action == "ls" else " or a step folder")]


def test_under_mpiexec_rank_0_alone_exports_and_speaks(root, tmp_path):
    """Every rank exported to OUT.tmp at once: HDF5's file lock failed all but one, each saying so."""
    from conftest import venv_bin

    out = tmp_path / "model.h5"
    result = subprocess.run([venv_bin("mpiexec"), "-n", "2", sys.executable, "-m", "hpcpar", "ckpt", "export", root, out],
                            cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and result.stderr == "", result.stderr
    assert result.stdout.count("exported step 7") == 1 and out.is_file()
