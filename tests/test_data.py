"""Data: `hpcpar data prepare` token files, windowed reads from HDF5, the same global batch at any dp, digits."""
import hashlib
import os
import pickle
import subprocess
import sys

import h5py
import numpy as np
import pytest

from conftest import REPO
from hpcpar.data import prepare as prepare_module
from hpcpar.data.corpus import stdlib_corpus, stdlib_files
from hpcpar.data.digits import DigitsBatches, load_digits_split
from hpcpar.data.loader import TextBatches, TokenDataset, dataset_info
from hpcpar.data.prepare import ensure_prepared, prepare


@pytest.fixture
def text_files(tmp_path):
    """Three small text files with known bytes (including non-ASCII UTF-8)."""
    rng = np.random.default_rng(0)
    contents = [b"def f(x):\n    return x * 2\n" * 40, "caf\u00e9 \u00fcber na\u00efve\n".encode() * 30,
                bytes(rng.integers(32, 127, 3001).astype(np.uint8))]
    paths = []
    for i, content in enumerate(contents):
        path = tmp_path / f"part{i}.txt"
        path.write_bytes(content)
        paths.append(str(path))
    return paths, b"".join(contents)


@pytest.fixture(scope="module")
def token_file(tmp_path_factory):
    """A token file of 0.25 MiB of the standard library, and the bytes it was made from."""
    path = str(tmp_path_factory.mktemp("data") / "stdlib.h5")
    prepare(path, max_mb=0.25, val_fraction=0.1)
    return path, stdlib_corpus(max_bytes=1 << 18)


def read_split(path, split):
    with h5py.File(path, "r") as f:
        return f[split][...]


def test_prepare_splits_the_given_files_into_train_and_val(tmp_path, text_files):
    paths, content = text_files
    out = tmp_path / "sub" / "tokens.h5"  # a missing folder is created
    made = prepare(str(out), paths, max_mb=None, val_fraction=0.1)
    n_val = round(len(content) * 0.1)
    train, val = read_split(out, "train"), read_split(out, "val")
    assert train.dtype == val.dtype == np.uint8
    assert (len(train), len(val)) == (len(content) - n_val, n_val) == (made["train_tokens"], made["val_tokens"])
    assert train.tobytes() + val.tobytes() == content
    with h5py.File(out, "r") as f:
        assert f.attrs["vocab_size"] == 256 and f.attrs["num_files"] == 3 and f.attrs["num_tokens"] == len(content)
        assert f.attrs["sha256"] == hashlib.sha256(content).hexdigest()
        assert [name.decode() for name in f["files"][...]] == paths
    assert os.listdir(out.parent) == ["tokens.h5"], "no temporary file left behind"


def test_prepare_stops_at_max_mb_and_counts_only_the_files_read(tmp_path, text_files):
    paths, content = text_files
    limit_mb = 1500 / (1 << 20)  # inside the second file
    made = prepare(str(tmp_path / "t.h5"), paths, max_mb=limit_mb, val_fraction=0.2)
    assert made["num_tokens"] == 1500 and made["num_files"] == 2
    assert (read_split(tmp_path / "t.h5", "train").tobytes() + read_split(tmp_path / "t.h5", "val").tobytes()
            == content[:1500])


def test_prepare_defaults_to_the_standard_library(token_file):
    path, corpus = token_file
    assert np.array_equal(np.concatenate([read_split(path, "train"), read_split(path, "val")]), corpus)
    info = dataset_info(path)
    assert info["vocab_size"] == 256 and info["train"] + info["val"] == 1 << 18
    assert info["val"] == round(0.1 * (1 << 18)) and "standard library" in info["source"]
    with h5py.File(path, "r") as f:
        names = [name.decode() for name in f["files"][...]]
        assert f.attrs["num_files"] == len(names)
    assert names == stdlib_files()[: len(names)]
    assert sum(os.path.getsize(name) for name in names[:-1]) < 1 << 18 <= sum(map(os.path.getsize, names))


def test_a_failed_prepare_leaves_the_old_file_and_no_temporary(tmp_path, text_files, monkeypatch):
    paths, _ = text_files
    out = tmp_path / "tokens.h5"
    prepare(str(out), paths[:1], max_mb=None)
    before = out.read_bytes()

    def broken(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(prepare_module.os, "fsync", broken)
    with pytest.raises(OSError, match="disk full"):
        prepare(str(out), paths, max_mb=None)
    assert out.read_bytes() == before
    assert sorted(os.listdir(tmp_path)) == ["part0.txt", "part1.txt", "part2.txt", "tokens.h5"]


@pytest.mark.parametrize("kwargs, message", [({"val_fraction": 0.0}, "val_fraction"),
                                             ({"val_fraction": 1.0}, "val_fraction"),
                                             ({"max_mb": 0}, "max_mb"),
                                             ({"max_mb": float("nan")}, "max_mb must be a number > 0, got nan")])
def test_prepare_rejects_bad_options(tmp_path, text_files, kwargs, message):
    with pytest.raises(ValueError, match=message):
        prepare(str(tmp_path / "t.h5"), text_files[0], **kwargs)


def test_prepare_names_a_missing_file_or_a_folder(tmp_path):
    with pytest.raises(FileNotFoundError, match="no such file"):
        prepare(str(tmp_path / "t.h5"), [str(tmp_path / "absent.txt")])
    with pytest.raises(IsADirectoryError, match="folder"):
        prepare(str(tmp_path / "t.h5"), [str(tmp_path)])


def test_prepare_refuses_an_output_it_cannot_write_or_that_is_an_input_before_reading(tmp_path, text_files):
    """A folder or a path under a file as --out failed after the text was read, with an errno line
    ("File exists: ..."); --out one of the inputs replaced that file by the tokens of its own bytes."""
    paths = text_files[0]
    (tmp_path / "afile").write_text("x")
    for out, message in ((tmp_path, "is a folder; give the path of a file"),
                         (tmp_path / "afile" / "t.h5", f"cannot be made: {tmp_path}/afile is a file, not a folder"),
                         (paths[1], "is both the output and one of the text files")):
        with pytest.raises(ValueError, match=message):
            prepare(str(out), paths, max_mb=None)
    os.mkfifo(tmp_path / "pipe.txt")
    with pytest.raises(ValueError, match="pipe.txt' is not a regular file"):
        prepare(str(tmp_path / "t.h5"), [str(tmp_path / "pipe.txt")])
    assert sorted(os.listdir(tmp_path)) == ["afile", "part0.txt", "part1.txt", "part2.txt", "pipe.txt"]


def test_cli_data_prepare(tmp_path, text_files):
    paths, content = text_files
    out = tmp_path / "cli.h5"
    run = subprocess.run([sys.executable, "-m", "hpcpar", "data", "prepare", "--out", str(out),
                          "--val-fraction", "0.25", *paths], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert f"wrote {out}" in run.stdout and f"{len(content):,} byte tokens from 3 files" in run.stdout
    assert len(read_split(out, "val")) == round(0.25 * len(content))

    bad = subprocess.run([sys.executable, "-m", "hpcpar", "data", "prepare", "--out", str(out), "absent.txt"],
                         cwd=REPO, capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2
    assert bad.stderr.strip() == "hpcpar data prepare: error: no such file 'absent.txt'"


def test_ensure_prepared_makes_a_missing_file_once(tmp_path, text_files):
    out = str(tmp_path / "tokens.h5")
    ensure_prepared(out, paths=text_files[0], max_mb=None)
    stamp = os.stat(out).st_mtime_ns
    ensure_prepared(out, paths=text_files[0][:1], max_mb=None)
    assert os.stat(out).st_mtime_ns == stamp, "an existing file is kept"
    info = dataset_info(out)
    assert info["train"] + info["val"] == len(text_files[1])
    with pytest.raises(RuntimeError, match="preparing .* failed: FileNotFoundError"):
        ensure_prepared(str(tmp_path / "other.h5"), paths=[str(tmp_path / "absent.txt")])


def test_dataset_info_rejects_other_hdf5_files(tmp_path):
    path = tmp_path / "other.h5"
    with h5py.File(path, "w") as f:
        f["train"] = np.zeros(10, dtype=np.uint8)
    with pytest.raises(ValueError, match="lacks val, attribute vocab_size"):
        dataset_info(str(path))


# --- TokenDataset ----------------------------------------------------------------------------------------

def test_id_range_and_dataset_info_read_each_version_of_a_file_once(tmp_path):
    """Validation runs once per candidate layout (hpcpar plan: thousands; opening the file each time was
    2.3 of plan's 2.7 s under cProfile at a world of 65536): a file is opened and scanned once per version."""
    from hpcpar.data import loader

    path = str(tmp_path / "wide.h5")
    for tokens in ([1, 5, 3], [7, 9, 8, 8, 8, 8, 8, 8]):  # the second write changes the file's size
        with h5py.File(path, "w") as f:
            f["train"] = f["val"] = np.array(tokens, dtype=np.uint16)
            f.attrs["vocab_size"] = 10
        misses = loader._id_range.cache_info().misses, loader._dataset_info.cache_info().misses
        assert loader.id_range(path, "train") == loader.id_range(path, "train") == (min(tokens), max(tokens))
        first = dataset_info(path)
        first["dtypes"]["train"] = None  # a caller's copy: changing it changes nothing cached
        assert dataset_info(path)["train"] == len(tokens) and dataset_info(path)["dtypes"]["train"] == np.uint16
        assert (loader._id_range.cache_info().misses, loader._dataset_info.cache_info().misses) == \
            (misses[0] + 1, misses[1] + 1)


def test_token_dataset_batches_are_slices_of_the_corpus(token_file):
    path, corpus = token_file
    train = TokenDataset(path, "train")
    assert len(train) == len(corpus) - round(0.1 * len(corpus))
    block = 16
    starts = np.array([5000, 3, 5010, len(train) - block - 1, 3, 120000])  # overlapping, repeated, the last window
    ids, targets = train.batch(starts, block)
    assert ids.shape == targets.shape == (6, block) and ids.dtype == np.int64
    for row, s in enumerate(starts):
        assert np.array_equal(ids[row], corpus[s: s + block])
        assert np.array_equal(targets[row], corpus[s + 1: s + block + 1])
    val = TokenDataset(path, "val")
    ids, targets = val.batch([0, 7], block)
    assert np.array_equal(ids[1], corpus[len(train) + 7: len(train) + 7 + block])


def test_token_dataset_reads_only_the_windows_it_needs(token_file):
    path, _ = token_file
    data = TokenDataset(path)
    block = 32
    data.batch([1000, 50000, 90000, 150000], block)  # far apart: one read each, nothing in between
    assert (data.reads, data.bytes_read) == (4, 4 * (block + 1))
    data.batch([7000, 7010, 7040], block)  # close together: one contiguous read of the span
    assert (data.reads, data.bytes_read) == (5, 4 * (block + 1) + 7040 + block + 1 - 7000)


def test_token_dataset_is_lazy_picklable_and_checks_bounds(tmp_path, token_file):
    path, corpus = token_file
    assert TokenDataset(str(tmp_path / "absent.h5")).path.endswith("absent.h5"), "no file access before use"
    data = TokenDataset(path)
    assert data.num_windows(8) == len(data) - 8 and data.vocab_size == 256
    copy = pickle.loads(pickle.dumps(data))
    assert np.array_equal(copy.batch([4], 8)[0][0], corpus[4:12])
    with pytest.raises(ValueError, match=r"window starts must be in \[0, "):
        data.batch([data.num_windows(8)], 8)
    with pytest.raises(KeyError, match="no split 'test'; it has"):
        len(TokenDataset(path, "test"))


# --- the same global batch at every dp ----------------------------------------------------------------------

def test_text_batches_give_the_same_global_batch_for_any_dp(token_file):
    path, corpus = token_file
    data = TokenDataset(path)
    single = TextBatches(data, block_size=16, global_batch=8, seed=3)
    split2 = [TextBatches(data, 16, 8, dp_rank=r, dp_size=2, seed=3) for r in range(2)]
    split4 = [TextBatches(data, 16, 8, dp_rank=r, dp_size=4, seed=3) for r in range(4)]
    for step in range(5):
        ids, targets = next(single)
        assert ids.shape == (8, 16)
        for ranks in (split2, split4):
            parts = [next(batches) for batches in ranks]
            assert np.array_equal(np.concatenate([p[0] for p in parts]), ids)
            assert np.array_equal(np.concatenate([p[1] for p in parts]), targets)
        starts = single.global_selection(step)
        assert np.array_equal(ids, np.stack([corpus[s: s + 16] for s in starts]))
    assert not np.array_equal(single.batch_at(0)[0], single.batch_at(1)[0]), "each step draws new windows"
    other_seed = TextBatches(data, 16, 8, seed=4)
    assert not np.array_equal(other_seed.batch_at(0)[0], single.batch_at(0)[0])


def test_text_batches_resume_exactly_even_at_another_dp(token_file):
    data = TokenDataset(token_file[0])
    run = TextBatches(data, 16, 8, seed=1)
    for _ in range(3):
        next(run)
    state = run.state_dict()
    expected = [next(run)[0] for _ in range(2)]

    resumed = TextBatches(data, 16, 8, seed=99)
    resumed.load_state_dict(state)
    assert resumed.state_dict() == state
    for batch in expected:
        assert np.array_equal(next(resumed)[0], batch)
    halves = [TextBatches(data, 16, 8, dp_rank=r, dp_size=2) for r in range(2)]
    for half in halves:
        half.load_state_dict(state)
    assert np.array_equal(np.concatenate([next(h)[0] for h in halves]), expected[0])
    with pytest.raises(ValueError, match="global batch of 8, this run has 16"):
        TextBatches(data, 16, 16).load_state_dict(state)


def test_text_batches_reject_a_batch_that_dp_does_not_divide(token_file):
    data = TokenDataset(token_file[0])
    with pytest.raises(ValueError, match="global batch 6 must be a positive multiple of dp = 4"):
        TextBatches(data, 16, 6, dp_rank=0, dp_size=4)
    with pytest.raises(ValueError, match="dp_rank 2 is outside 0..1"):
        TextBatches(data, 16, 6, dp_rank=2, dp_size=2)
    with pytest.raises(ValueError, match="too few for one window"):
        TextBatches(TokenDataset(token_file[0], "val"), 1 << 20, 2)


# --- digits ------------------------------------------------------------------------------------------------

def test_digits_split_shapes_range_and_seed():
    split = load_digits_split(seed=0)
    assert split.x_train.shape == (1438, 1, 8, 8) and split.x_test.shape == (359, 1, 8, 8)
    assert split.y_train.shape == (1438,) and split.y_test.shape == (359,)
    assert split.x_train.dtype == np.float32 and split.y_train.dtype == np.int64
    assert split.x_train.min() == 0.0 and split.x_train.max() == 1.0
    assert set(split.y_test.tolist()) == set(range(10))
    from sklearn.datasets import load_digits

    everything = load_digits().images / 16.0
    together = np.concatenate([split.x_train, split.x_test])[:, 0]
    assert np.allclose(np.sort(together.reshape(len(together), -1), axis=0),
                       np.sort(everything.reshape(len(everything), -1), axis=0)), "train + test = the whole set"
    again, other = load_digits_split(seed=0), load_digits_split(seed=1)
    assert np.array_equal(again.y_test, split.y_test) and not np.array_equal(other.y_test, split.y_test)
    assert load_digits_split(test_fraction=0.5, dtype=np.float64).x_test.shape == (898, 1, 8, 8)


def test_digits_batches_same_global_batch_and_epochs():
    split = load_digits_split(seed=0)
    x, y = split.x_train, split.y_train
    single = DigitsBatches(x, y, global_batch=100, seed=2)
    ranks = [DigitsBatches(x, y, 100, dp_rank=r, dp_size=4, seed=2) for r in range(4)]
    assert single.steps_per_epoch == 14
    seen = []
    for step in range(16):
        images, labels = next(single)
        parts = [next(r) for r in ranks]
        assert images.shape == (100, 1, 8, 8) and parts[0][0].shape == (25, 1, 8, 8)
        assert np.array_equal(np.concatenate([p[0] for p in parts]), images)
        assert np.array_equal(np.concatenate([p[1] for p in parts]), labels)
        seen.append(single.global_selection(step))
    first_epoch = np.concatenate(seen[:14])
    assert len(set(first_epoch.tolist())) == 1400, "no image twice within an epoch"
    assert not np.array_equal(seen[14], seen[0]), "a new order each epoch"

    state = single.state_dict()
    resumed = DigitsBatches(x, y, 100)
    resumed.load_state_dict(state)
    assert np.array_equal(next(resumed)[1], next(single)[1])
    with pytest.raises(ValueError, match="exceeds the 1438 training images"):
        DigitsBatches(x, y, 2000)
