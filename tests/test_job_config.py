"""Job files: loading, --set overrides, and one clear JobError naming the file and key for each bad job."""
import contextlib
import os
import re
import textwrap
import threading
import tomllib

import h5py
import numpy as np
import pytest

from conftest import REPO
from hpcpar.data.prepare import prepare
from hpcpar.train.config import SECTIONS, Job, JobError, schema_table, section_title
from hpcpar.train.config_load import load_job, parse_override
from hpcpar.train.validate import check_machine, validate

GOOD = """
[model]
kind = "gpt"
block_size = 32
n_layer = 2
n_head = 4
n_embd = 64
dropout = 0.1

[data]
path = "data/stdlib.h5"
batch_size = 16

[parallel]
pp = 2
schedule = "gpipe"
micro_batches = 4

[optimizer]
lr = 1          # an integer where a number is expected is fine
betas = [0.9, 0.95]

[train]
steps = 20
precision = "fp64"
"""


def write_job(tmp_path, text, name="job.toml"):
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return str(path)


def job_error(tmp_path, text, *overrides, world_size=None, machine=False) -> str:
    """The JobError of loading the job (and ``validate`` at ``world_size``, then ``check_machine``)."""
    path = write_job(tmp_path, text)
    with pytest.raises(JobError) as caught:
        job = load_job(path, list(overrides))
        if world_size is not None:
            job = validate(job, world_size)
        if machine:
            check_machine(job)
    message = str(caught.value)
    assert message.startswith(path), "every message names the job file"
    return message


@pytest.fixture(autouse=True)
def in_tmp(tmp_path, monkeypatch):
    """Relative paths in jobs start at the current folder: run each test in its own."""
    monkeypatch.chdir(tmp_path)


def test_a_good_job_loads_with_types_and_defaults(tmp_path):
    job = load_job(write_job(tmp_path, GOOD, "tiny-gpt.toml"))
    assert isinstance(job, Job)
    assert (job.model.n_layer, job.model.dropout, job.model.vocab_size) == (2, 0.1, 256)
    assert job.optimizer.lr == 1.0 and isinstance(job.optimizer.lr, float)
    assert job.optimizer.betas == (0.9, 0.95)
    assert (job.parallel.pp, job.parallel.dp, job.parallel.schedule) == (2, None, "gpipe")
    assert job.train.metrics == "runs/tiny-gpt/metrics.jsonl", "{job} is the job file's name"
    assert job.checkpoint.dir == "runs/tiny-gpt/checkpoints" and job.checkpoint.async_ is False
    assert "model.dropout" in job.given and "model.bias" not in job.given
    assert job.num_layers == 4 and job.gpt_config().n_embd == 64
    assert job.to_dict()["checkpoint"]["async"] is False and job.to_dict()["optimizer"]["betas"] == [0.9, 0.95]


def test_overrides_apply_with_toml_types(tmp_path):
    job = load_job(write_job(tmp_path, GOOD), ["parallel.tp=2", "train.steps=50", "optimizer.betas=[0.9,0.99]",
                                               'checkpoint.dir="x"', "parallel.schedule=1f1b",
                                               "train.trace = out/trace.json", "model.bias=false",
                                               "checkpoint.async=true", "optimizer.lr=3e-4"])
    assert job.parallel.tp == 2 and job.train.steps == 50 and job.optimizer.betas == (0.9, 0.99)
    assert job.checkpoint.dir == "x" and job.parallel.schedule == "1f1b" and job.train.trace == "out/trace.json"
    assert job.model.bias is False and job.checkpoint.async_ is True and job.optimizer.lr == 3e-4
    assert {"parallel.tp", "train.trace"} <= job.given


def test_parse_override():
    assert parse_override("parallel.tp=2") == ("parallel", "tp", 2)
    assert parse_override("data.path=a=b.h5") == ("data", "path", "a=b.h5")
    assert parse_override('train.metrics=""') == ("train", "metrics", "")
    for bad in ("parallel.tp", "tp=2", "a.b.c=1", ".tp=1"):
        with pytest.raises(JobError, match="expected section.key=value"):
            parse_override(bad)


def test_defaults_alone_make_a_valid_job():
    job = validate(load_job(None), world_size=2)
    assert (job.parallel.dp, job.world_size) == (2, 2)


def test_unknown_key_names_it_suggests_and_lists_the_allowed(tmp_path):
    message = job_error(tmp_path, GOOD.replace("pp = 2", "tpp = 2"))
    assert "parallel.tpp: unknown key; did you mean 'tp'?" in message
    assert "[parallel] keys are dp, pp, tp, cp, schedule" in message
    message = job_error(tmp_path, GOOD, "parallel.micro_batch=2")
    assert "parallel.micro_batch (--set): unknown key; did you mean 'micro_batches'?" in message
    assert "train.lr: unknown key; did you mean optimizer.lr?" in job_error(tmp_path, GOOD + "lr = 0.1\n")
    message = job_error(tmp_path, GOOD.replace("[model]", "[modle]"))
    assert "[modle]: unknown section; did you mean 'model'? sections are model, model.moe, data, parallel" in message
    assert "steps: a key outside any section; did you mean train.steps?" in job_error(tmp_path, "steps = 3\n" + GOOD)


@pytest.mark.parametrize("change, expected", [
    (('steps = 20', 'steps = "ten"'), 'train.steps: expected an integer, got "ten"'),
    (('steps = 20', 'steps = 20.0'), "train.steps: expected an integer, got 20.0"),
    (('n_layer = 2', 'n_layer = true'), "model.n_layer: expected an integer, got true"),
    (('betas = [0.9, 0.95]', 'betas = 0.9'), "optimizer.betas: expected a list of 2 finite numbers, got 0.9"),
    (('dropout = 0.1', 'dropout = "0.1"'), 'model.dropout: expected a finite number, got "0.1"'),
    (('lr = 1 ', 'lr = inf '), "optimizer.lr: expected a finite number, got inf"),  # trained on NaNs, exit 0
    (('lr = 1 ', 'lr = 1' + '0' * 400 + ' '), "optimizer.lr: expected a finite number, got 1000"),  # OverflowError
    (('betas = [0.9, 0.95]', 'betas = [0.9, nan]'), "optimizer.betas: expected a list of 2 finite numbers, got [0.9, nan]"),
    (('pp = 2', 'pp = 0'), "parallel.pp: 0 must be >= 1"),
    (('dropout = 0.1', 'dropout = 1.0'), "model.dropout: 1.0 must be in [0.0, 1.0)"),
    (('precision = "fp64"', 'precision = "fp8"'), 'train.precision: "fp8" is not one of fp32, fp16, bf16, fp64'),
    (('schedule = "gpipe"', 'schedule = "gpip"'), "did you mean 'gpipe'?"),
    (('schedule = "gpipe"', 'schedule = "zb2"'), 'parallel.schedule: "zb2" is not one of gpipe, 1f1b, interleaved, zb1'),
    (('micro_batches = 4', 'micro_batches = 4\npartition = "even"'), "parallel.partition: \"even\" must be one of"),
    (('micro_batches = 4', 'micro_batches = 4\nstaleness = 2'),
     'parallel.staleness: 2 has no effect with parallel.mode = "allreduce"; it applies only with parallel.mode '
     '= "ps"'),
    (('kind = "gpt"', 'kind = "gpt"\nchannels = [8, 8]'), "model.channels: [8, 8] has no effect"),
    (('micro_batches = 4', 'micro_batches = 4\nmode = "ps"\n[checkpoint]\nasync = true'),  # the servers write in step
     'checkpoint.async: true has no effect with parallel.mode = "ps"; it applies only with parallel.mode = '
     '"allreduce" or "local_sgd"'),
])
def test_bad_values_name_the_key_and_what_is_allowed(tmp_path, change, expected):
    assert expected in job_error(tmp_path, GOOD.replace(*change))


def test_bad_override_values_are_reported_as_from_the_command_line(tmp_path):
    assert 'train.steps (--set): expected an integer, got "ten"' in job_error(tmp_path, GOOD, "train.steps=ten")


def test_all_problems_of_a_file_are_reported_together(tmp_path):
    message = job_error(tmp_path, GOOD.replace("pp = 2", "pp = -1").replace("steps = 20", "steps = 'x'"))
    assert "2 problems:" in message and "parallel.pp: -1 must be >= 1" in message and "train.steps" in message


def test_malformed_toml_gives_the_line(tmp_path):
    message = job_error(tmp_path, GOOD.replace("n_head = 4", "n_head = = 4"))
    line = textwrap.dedent(GOOD).splitlines().index("n_head = 4") + 1
    assert "invalid TOML" in message and f"line {line}" in message and "n_head = = 4" in message


def test_a_missing_job_file(tmp_path):
    with pytest.raises(JobError, match="absent.toml: no such job file"):
        load_job(str(tmp_path / "absent.toml"))


def test_a_job_file_that_is_a_folder_or_a_named_pipe_is_refused_unread(tmp_path):
    """A folder was a traceback (IsADirectoryError); a named pipe blocked the read until someone wrote to it."""
    (tmp_path / "jobs").mkdir()
    with pytest.raises(JobError, match="jobs: the job file is a folder, not a file; give a TOML file"):
        load_job("jobs")
    os.mkfifo(tmp_path / "job.fifo")
    with unblocking(tmp_path / "job.fifo"), pytest.raises(JobError, match="job.fifo: the job file is not a regular"):
        load_job("job.fifo")


@contextlib.contextmanager
def unblocking(fifo):
    """A writer that ends a read of ``fifo`` (so that reading it fails the test instead of blocking it),
    and is itself released when nothing read."""
    writer = threading.Thread(target=lambda: open(fifo, "w").close(), daemon=True)
    writer.start()
    try:
        yield
    finally:
        while writer.is_alive():  # until the writer has opened: a reader gone before its open would block it forever
            os.close(os.open(fifo, os.O_RDONLY | os.O_NONBLOCK))  # the writer's open returns
            writer.join(timeout=0.05)


# --- validate: the keys together and the world -------------------------------------------------------------

def test_validate_fills_dp_and_describe_round_trips(tmp_path):
    job = validate(load_job(write_job(tmp_path, GOOD)), world_size=4)
    assert (job.parallel.dp, job.parallel.pp, job.world_size) == (2, 2, 4)
    text = job.describe()
    assert text.startswith(f"# job {job.source}, 4 ranks as dp 2 x pp 2 x tp 1")
    assert "vocab_size = 256" in text and "channels" not in text, "keys without effect are left out"
    again = load_job(write_job(tmp_path, text, "again.toml"))
    assert again.to_dict() == job.to_dict()
    assert tomllib.loads(text)["optimizer"]["betas"] == [0.9, 0.95]


@pytest.mark.parametrize("overrides, world, expected", [
    (["parallel.tp=3"], 4, "parallel.pp, parallel.tp: world size 4 is not divisible by pp x tp = 2 x 3 = 6"),
    (["parallel.dp=3"], 4, "parallel.dp, parallel.pp, parallel.tp: dp x pp x tp = 3 x 2 x 1 = 6 does not equal "
                           "the world size 4"),
    (["model.n_head=6", "model.n_embd=96", "parallel.pp=1", "parallel.tp=4", "parallel.micro_batches=1"], 4,
     "parallel.tp: n_head = 6 is not divisible by tp = 4: each tp rank holds whole heads; use tp in 1, 2, 3, 6"),
    (["model.vocab_size=250", "parallel.tp=4", "parallel.pp=1", "parallel.micro_batches=1"], 4,
     "parallel.tp: vocab_size = 250 is not divisible by tp = 4"),
    (["model.n_head=5"], 2, "model.n_head: n_embd = 64 is not divisible by n_head = 5"),
    (["parallel.micro_batches=3"], 4, "parallel.micro_batches: each of the dp = 2 replicas gets 8 samples, not "
                                      "divisible into 3 micro-batches"),
    (["data.batch_size=10"], 8, "data.batch_size: 10 is not divisible by dp = 4"),
    (["parallel.schedule=interleaved", "parallel.chunks=2", "parallel.micro_batches=2", "model.n_layer=6",
      "parallel.pp=4"], 4, "parallel.micro_batches: the interleaved schedule needs micro_batches divisible by pp: "
                           "2 % 4 != 0; use 4"),
    (["parallel.pp=5"], 5, "parallel.pp: pp x chunks = 5 x 1 = 5 stages, but the model has only 4 layers"),
    (["parallel.pp=4", "parallel.schedule=interleaved", "parallel.chunks=2"], 4,
     "parallel.pp: pp x chunks = 4 x 2 = 8 stages, but the model has only 4 layers to cut (n_layer + 2 = 2 + 2)"),
    (["parallel.partition=[1, 2]"], 2, "parallel.partition: per-stage counts [1, 2] add up to 3, but the model "
                                       "has 4 layers"),
    (["parallel.partition=[4]"], 2, "parallel.partition: 1 per-stage counts for pp x chunks = 2 stages"),
    (["parallel.pp=4", 'parallel.partition="blocks"'], 4, 'parallel.partition: partition = "blocks" gives each of '
                                                          "pp x chunks = 4 stages a block, but the model has 2"),
    (["parallel.mode=ps"], 4, 'parallel.mode: "ps" runs data parallel only, but pp = 2'),
    (["parallel.mode=ps", "parallel.pp=1", "parallel.servers=2", "parallel.micro_batches=1"], 2,
     "parallel.servers: 2 server(s) leave no worker among 2 ranks"),
    (["parallel.zero=1", "parallel.compression=fp16"], 2, "parallel.zero: ZeRO reduce-scatters gradients"),
    (["parallel.sequence_parallel=true"], 4, "parallel.sequence_parallel: splits activations over the tp ranks; "
                                             "with tp = 1 there is nothing to split"),
    (["parallel.sequence_parallel=true", "parallel.tp=2", "parallel.pp=1", "model.block_size=33"], 2,
     "parallel.sequence_parallel: block_size = 33 tokens do not split over tp = 2 ranks"),
    (["parallel.mode=local_sgd", "parallel.pp=1", "parallel.compression=topk", "parallel.micro_batches=1"], 2,
     'parallel.compression: compression hooks into the gradient all-reduce; mode = "local_sgd"'),
    (["data.kind=digits"], 2, 'data.kind: model.kind = "gpt" trains on data.kind = "text", got "digits"'),
    (['optimizer.no_decay=["*.bias", "*.baises"]'], 2, 'optimizer.no_decay: "*.baises" match(es) no parameter of '
                                                        'the gpt; its names look like embed.wte.weight'),
    (["model.kind=cnn", "data.kind=digits", "parallel.pp=1", "parallel.tp=2", "model.block_size=128",
      "model.n_layer=4", "model.n_head=4", "model.n_embd=256", "model.dropout=0.0"], 2,
     'parallel.tp: tensor parallelism splits the GPT\'s heads and MLP; model.kind = "cnn" needs tp = 1'),
])
def test_validate_names_the_key_the_numbers_and_the_fix(tmp_path, overrides, world, expected):
    assert expected in job_error(tmp_path, GOOD, *overrides, world_size=world)


@pytest.mark.parametrize("job, module, expected", [
    ("gpt-dp.toml", "ml_dtypes", "train.precision: \"bf16\" needs the ml_dtypes package: pip install 'hpcpar[bf16]'"),
    ("cnn-digits-dp.toml", "sklearn", "data.kind: \"digits\" needs the sklearn package: pip install 'hpcpar[digits]'"),
])
def test_an_optional_package_the_job_needs_is_named_before_anything_runs(monkeypatch, job, module, expected):
    """bf16 on the host needs ml_dtypes and the digits need scikit-learn, neither a dependency of
    hpcpar: without them the job is refused in one line naming the extra to install."""
    import importlib.util

    find = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *args: None if name == module else find(name, *args))
    with pytest.raises(JobError, match=re.escape(expected)):
        validate(load_job(os.path.join(REPO, "jobs", job), ['train.precision="bf16"']), 2)


def test_validate_accepts_what_it_should(tmp_path):
    path = write_job(tmp_path, GOOD)
    ps = validate(load_job(path, ["parallel.mode=ps", "parallel.pp=1", "parallel.servers=1",
                                  "parallel.micro_batches=1", "data.batch_size=15", "parallel.staleness=2"]), 4)
    assert (ps.parallel.dp, ps.parallel.staleness) == (3, 2), "servers come out of the world: dp = 4 - 1"
    assert "4 ranks as dp 3 x pp 1 x tp 1 + 1 server(s)" in ps.describe()
    interleaved = validate(load_job(path, ["parallel.schedule=interleaved", "parallel.chunks=2",
                                           "parallel.partition=[1, 1, 1, 1]"]), 2)
    assert interleaved.parallel.partition == (1, 1, 1, 1)
    cnn = validate(load_job(path, ["model.kind=cnn", "data.kind=digits", "model.block_size=128", "model.n_layer=4",
                                   "model.n_head=4", "model.n_embd=256", "model.dropout=0.0", "parallel.pp=8",
                                   "model.channels=[8, 16]"]), 8)
    assert cnn.num_layers == 8 and cnn.parallel.dp == 1


def test_the_data_file_must_exist_unless_it_may_be_prepared(tmp_path):
    message = job_error(tmp_path, GOOD, "data.prepare_if_missing=false", world_size=2)
    assert 'data.path: "data/stdlib.h5" does not exist' in message
    assert os.path.join(str(tmp_path), "data", "stdlib.h5") in message
    assert "hpcpar data prepare --out data/stdlib.h5" in message
    validate(load_job(write_job(tmp_path, GOOD)), 2)  # prepare_if_missing = true (the default)


def test_only_the_builtin_corpus_at_its_default_path_is_prepared(tmp_path):
    """A typo in data.path is an error naming the command that makes the file, never a silent
    preparation of the standard library under the typo's name."""
    typo = str(tmp_path / "data" / "typo2.h5")
    message = job_error(tmp_path, GOOD, f'data.path="{typo}"', world_size=2)
    assert f"hpcpar data prepare --out {typo}" in message and "Only the built-in corpus" in message


def test_checkpoint_resume_takes_a_policy_or_a_step_folder(tmp_path):
    assert load_job(write_job(tmp_path, GOOD)).checkpoint.resume == "auto"
    for value in ("never", "must", "runs/x/checkpoints/step-00000100"):
        assert load_job(write_job(tmp_path, GOOD), [f'checkpoint.resume="{value}"']).checkpoint.resume == value
    message = job_error(tmp_path, GOOD, "checkpoint.resume=true")  # the old boolean: one line with the new names
    assert 'checkpoint.resume (--set): expected auto, never, must or a step folder' in message
    assert 'the old true is "auto", false "never"' in message


def test_an_existing_data_file_is_checked_against_the_model(tmp_path):
    text = tmp_path / "text.txt"
    text.write_bytes(b"x = 1\n" * 100)  # 600 bytes: 48 of them for val
    prepare("data/small.h5", [str(text)], max_mb=None, val_fraction=0.08)
    job = load_job(write_job(tmp_path, GOOD), ["data.path=data/small.h5"])
    assert validate(job, 2).data.path == "data/small.h5"
    message = job_error(tmp_path, GOOD, "data.path=data/small.h5", "model.block_size=64", "model.vocab_size=128",
                        world_size=2)
    assert "model.vocab_size: 128 is smaller than the vocab_size 256 of data/small.h5" in message
    assert "data.path: the val split of data/small.h5 has 48 tokens, not more than model.block_size = 64" in message
    (tmp_path / "data" / "junk.h5").write_bytes(b"not hdf5")
    assert "data.path: \"data/junk.h5\" is not a token file" in job_error(tmp_path, GOOD, "data.path=data/junk.h5",
                                                                          world_size=2)


def token_file(path, train, val=None, vocab_size=256):
    with h5py.File(path, "w") as f:
        f["train"], f["val"] = train, train if val is None else val
        f.attrs["vocab_size"] = vocab_size
    return str(path)


def test_a_data_file_that_cannot_feed_the_model_is_refused_before_the_run(tmp_path):
    """Each was found mid-run or never: a folder (two lines of HDF5 error), a named pipe (h5py's open
    blocked), float tokens (trained on silently, cast to int), 2-D tokens and ids >= vocab_size (a
    traceback after the run folder was written)."""
    def problem(path):
        return job_error(tmp_path, GOOD, f'data.path="{path}"', "parallel.pp=1", world_size=1)

    os.mkdir("folder.h5")
    assert 'data.path: "folder.h5" is a folder, not a file; give the token file' in problem("folder.h5")
    os.mkfifo("pipe.h5")
    with unblocking("pipe.h5"):
        assert 'data.path: "pipe.h5" is not a regular file' in problem("pipe.h5")
    message = problem(token_file("float.h5", np.full(100, 0.5)))
    assert "is not a token file of `hpcpar data prepare`: its train split holds float64 of shape (100,), " \
           "not 1-D integer token ids" in message
    assert "holds uint8 of shape (100, 2)" in problem(token_file("wide.h5", np.zeros((100, 2), np.uint8)))
    big = token_file("big.h5", np.arange(100, dtype=np.uint16), np.full(100, 900, np.uint16))
    assert ("data.path: the val split of big.h5 holds token id 900, outside 0..model.vocab_size-1 = 0..255; "
            "set model.vocab_size >= 901") in problem(big)
    assert "holds token id -1" in problem(token_file("negative.h5", np.full(100, -1, np.int32)))
    fits = token_file("fits.h5", np.full(100, 255, np.int64))  # a wide dtype whose ids all fit
    validate(load_job(write_job(tmp_path, GOOD), [f'data.path="{fits}"', "parallel.pp=1"]), 1)


def test_a_path_the_run_writes_that_cannot_be_made_is_refused_before_the_run(tmp_path):
    """Each was a traceback: checkpoint.dir and train.metrics after the run folder was written,
    train.trace after the whole run (leaving TRACE.tmp behind). check_machine refuses them;
    validate alone (plans and dry runs, for other machines) does not look."""
    def problem(*overrides):
        return job_error(tmp_path, GOOD, 'data.path="tokens.h5"', "parallel.pp=1", *overrides, world_size=1,
                         machine=True)

    token_file("tokens.h5", np.zeros(100, np.uint8))
    open("afile", "w").close()
    os.mkdir("folder")
    where = os.path.join(str(tmp_path), "afile")
    assert f'checkpoint.dir: "afile/ck" cannot be made: {where} is a file, not a folder; give a path under a folder' \
           in problem('checkpoint.dir="afile/ck"')
    assert 'checkpoint.dir: "afile" is a file, not a folder' in problem('checkpoint.dir="afile"')
    assert f'train.metrics: "afile/m/metrics.jsonl" cannot be made: {where} is a file' \
           in problem('train.metrics="afile/m/metrics.jsonl"')
    assert 'train.metrics: "folder" is a folder; give the path of a file' in problem('train.metrics="folder"')
    assert 'train.trace: "folder" is a folder' in problem('train.trace="folder"')
    message = problem('train.trace="afile/t.json"', 'checkpoint.dir="afile"')
    assert "2 problems" in message and "train.trace: " in message and "checkpoint.dir: " in message
    check_machine(validate(load_job(write_job(tmp_path, GOOD), ['data.path="tokens.h5"', "parallel.pp=1",
                                                                'train.metrics="new/deeper/m.jsonl"',
                                                                'checkpoint.dir="folder"']), 1))
    validate(load_job(write_job(tmp_path, GOOD), ['data.path="tokens.h5"', "parallel.pp=1", 'checkpoint.dir="afile/ck"']), 1)


def test_a_path_the_run_writes_may_not_replace_what_it_reads_or_another_output(tmp_path):
    """Each ran with exit 0: train.metrics on the token file renamed it aside as an old metrics file; the
    trace replaced the token file, the job file or the metrics at the end; checkpoint.dir = "" was a
    traceback, and a step folder as checkpoint.dir got a second root written inside it."""
    def problem(*overrides):
        return job_error(tmp_path, GOOD, 'data.path="tokens.h5"', "parallel.pp=1", *overrides, world_size=1,
                         machine=True)

    token_file("tokens.h5", np.zeros(100, np.uint8))
    assert 'train.metrics: "tokens.h5" is also data.path, which writing it would replace' in \
        problem('train.metrics="tokens.h5"')
    assert 'train.trace: "./job.toml" is also the job file' in problem('train.trace="./job.toml"')
    assert 'train.trace: "m.jsonl" is also train.metrics' in problem('train.metrics="m.jsonl"', 'train.trace="m.jsonl"')
    assert 'checkpoint.dir (--set): "" must be a folder name' in job_error(tmp_path, GOOD, 'checkpoint.dir=""')
    os.makedirs("ck/step-00000002")
    open("ck/step-00000002/manifest.json", "w").close()
    assert 'checkpoint.dir: "ck/step-00000002" is a step folder of a checkpoint; give a checkpoint root (such as ck)' \
        in problem('checkpoint.dir="ck/step-00000002"')


def test_an_output_may_not_take_a_name_the_checkpoint_writes(tmp_path):
    """A metrics file named checkpoint.dir/latest replaced the pointer as the run began (exit 0, and no
    step of that root loaded again); a trace inside a step folder went with the step when it retired."""
    def problem(*overrides):
        return job_error(tmp_path, GOOD, 'data.path="tokens.h5"', "parallel.pp=1", 'checkpoint.dir="ck"', *overrides,
                         world_size=1, machine=True)

    token_file("tokens.h5", np.zeros(100, np.uint8))
    assert ('train.metrics: "ck/latest" lies at \'latest\' in checkpoint.dir, a name its checkpoints write (the '
            "pointer 'latest', the step folders), so a checkpoint there would be lost") in problem('train.metrics="ck/latest"')
    assert "train.trace: \"ck/./step-00000003.tmp/t.json\" lies at 'step-00000003.tmp'" in \
        problem('train.trace="ck/./step-00000003.tmp/t.json"')
    assert 'train.metrics: "ck/" is checkpoint.dir itself' in problem('train.metrics="ck/"')
    os.makedirs("ck")
    check_machine(validate(load_job(write_job(tmp_path, GOOD), ['data.path="tokens.h5"', "parallel.pp=1",
                                                                'checkpoint.dir="ck"', 'train.metrics="ck/m.jsonl"',
                                                                'train.trace="ck/latest-trace.json"']), 1))


def test_a_model_whose_weights_cannot_fit_in_memory_is_refused_before_it_is_built(tmp_path):
    """n_embd = 1e8 was a MemoryError traceback while the model was built; a job that fits is not refused."""
    job = validate(load_job(write_job(tmp_path, GOOD), ["model.n_embd=100000000", "model.n_head=1"]), 2)
    with pytest.raises(JobError) as caught:  # the planner may plan it for a bigger machine; training here cannot
        check_machine(job)
    message = str(caught.value)
    assert "job.toml: model.n_embd, model.n_layer, model.vocab_size: a GPT of about 2.4e+17 parameters" in message
    assert "on each of the pp x tp = 2 ranks that split it, beyond this machine's" in message
    check_machine(validate(load_job(write_job(tmp_path, GOOD)), 2))
    job = validate(load_job(write_job(tmp_path, GOOD), ["data.batch_size=4000000000", "parallel.pp=1"]), 2)
    with pytest.raises(JobError, match="data.batch_size, model.block_size: one micro-batch of 16,000,000,000 tokens "
                                       "has logits of 15,259 GiB"):  # its first step never ended
        check_machine(job)


@pytest.mark.parametrize("variable, value, expected", [
    ("HPCPAR_DEVICE", "gpu", "train.device: \"auto\" takes $HPCPAR_DEVICE, which is 'gpu', not one of auto, cpu"),
    ("HPCPAR_SHM", "maybe", "parallel.shm: unset, so the environment decides, and HPCPAR_SHM must be 0 or 1"),
    ("HPCPAR_NODE_SIZE", "x", "parallel.node_size: unset, so the environment decides, and HPCPAR_NODE_SIZE must be"),
    ("HPCPAR_DEVICE_NONBLOCKING", "perhaps", "parallel.device_nonblocking: unset, so the environment decides")])
def test_a_bad_environment_variable_behind_an_unset_key_is_refused_before_the_run(tmp_path, monkeypatch, variable,
                                                                                  value, expected):
    """Each was a ValueError traceback while the run's context was built."""
    job = validate(load_job(write_job(tmp_path, GOOD)), 2)
    monkeypatch.setenv(variable, value)
    with pytest.raises(JobError, match=re.escape(expected)):
        check_machine(job)


def test_job_error_is_a_value_error_with_its_problems():
    error = JobError("jobs/x.toml", [("parallel.tp", "too big"), ("train.steps", "too small")])
    assert isinstance(error, ValueError) and error.problems[0] == ("parallel.tp", "too big")
    assert str(error) == "jobs/x.toml: 2 problems:\n  parallel.tp: too big\n  train.steps: too small"


def test_schema_table_lists_every_key():
    table = schema_table()
    defaults = Job().to_dict()
    assert list(defaults) == list(SECTIONS)
    for name, keys in defaults.items():
        for key in keys:
            assert f"| {section_title(name)}.{key} |" in table
    assert len(table.splitlines()) == 2 + sum(len(keys) for keys in defaults.values())
    assert "| checkpoint.async | true or false | `false` |" in table


def test_no_decay_patterns_default_to_biases_norms_and_embeddings(tmp_path):
    path = write_job(tmp_path, GOOD)
    assert validate(load_job(path), 2).optimizer.no_decay == ("*.bias", "*ln_*", "embed.*")
    assert validate(load_job(path, ["optimizer.no_decay=[]"]), 2).optimizer.no_decay == ()
    assert "expected a list of non-empty strings" in job_error(tmp_path, GOOD, 'optimizer.no_decay="*.bias"',
                                                               world_size=2)
    # the defaults need not all match (a model without biases): only patterns the job gives are checked
    validate(load_job(path, ["model.bias=false"]), 2)


def test_the_old_schedule_section_is_read_with_a_notice(tmp_path):
    path = tmp_path / "old.toml"
    path.write_text("[schedule]\nwarmup_steps = 7\n")
    job = load_job(str(path), ["schedule.min_lr=0.0001"])
    assert job.lr_schedule.warmup_steps == 7 and job.lr_schedule.min_lr == 1e-4
    assert any("[schedule] is deprecated" in n and "[lr_schedule]" in n for n in job.notices)
    assert any("--set lr_schedule.min_lr" in n for n in job.notices)
    path.write_text("[schedule]\nwarmup_steps = 7\n[lr_schedule]\nmin_lr = 0.0\n")
    with pytest.raises(JobError, match=r"\[schedule\]: is the old name of \[lr_schedule\]"):
        load_job(str(path))
