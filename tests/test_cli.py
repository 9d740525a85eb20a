"""The hpcpar command line as a user meets it: help at every level, usage errors of one line
with exit status 2 (under mpiexec too), --version, log lines by rank, plots of metrics files."""
import argparse
import importlib.metadata
import importlib.util
import json
import os
import pathlib
import re
import subprocess
import sys

import pytest

import hpcpar
from conftest import REPO, venv_bin
from hpcpar import cli, plot

ENV = {**os.environ, "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}


def hpcpar_command(*args, ranks=None, env=None, timeout=120):
    command = [sys.executable, "-m", "hpcpar", *map(str, args)]
    if ranks is not None:
        command = [venv_bin("mpiexec"), "-n", str(ranks), *command]
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout, cwd=REPO, env={**ENV, **(env or {})})


def command_paths(parser, words=()):
    """Every command and sub-command: (words, parser), the top first."""
    yield words, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, child in action.choices.items():
                yield from command_paths(child, (*words, name))


PATHS = list(command_paths(cli.build_parser("*")))


def test_every_command_is_reached():
    names = {" ".join(words) for words, _ in PATHS}
    assert {"train", "compare", "info", "run", "plot", "generate", "data prepare", "ckpt ls", "ckpt export",
            "bench allreduce", "bench async"} <= names


@pytest.mark.parametrize("words", [words for words, _ in PATHS], ids=[" ".join(w) or "hpcpar" for w, _ in PATHS])
def test_help_works_at_every_level_without_a_positional(words, capsys):
    with pytest.raises(SystemExit) as stop:
        cli.build_parser("*").parse_args([*words, "--help"])
    assert stop.value.code == 0
    assert capsys.readouterr().out.startswith("usage: hpcpar" + "".join(f" {w}" for w in words))


def test_every_option_has_help_text_with_its_default():
    for words, parser in PATHS:
        formatter = parser._get_formatter()
        for action in parser._actions:
            if not action.option_strings or isinstance(action, (argparse._HelpAction, argparse._VersionAction)):
                continue
            where = f"hpcpar {' '.join(words)} {action.option_strings[0]}"
            assert action.help, f"{where} has no help text"
            if action.default is not False:  # a switch: off unless given
                assert "default" in formatter._get_help_string(action), f"{where} does not say its default"


def test_the_real_entry_point_and_bench_help_list_every_bench():
    top = subprocess.run([venv_bin("hpcpar"), "--help"], capture_output=True, text=True, timeout=60, env=ENV)
    assert top.returncode == 0 and all(name in top.stdout for name in cli.COMMANDS)
    bench = hpcpar_command("bench", "--help")
    from hpcpar.bench import BENCHMARKS

    assert bench.returncode == 0
    for name, text in BENCHMARKS.items():  # one line each: the name and the start of its description
        assert any(line.split()[:1] == [name] for line in bench.stdout.splitlines()), bench.stdout


def test_version_is_the_package_metadata():
    proc = hpcpar_command("--version")
    assert proc.returncode == 0
    assert proc.stdout.strip() == f"hpcpar {importlib.metadata.version('hpcpar')}" == f"hpcpar {hpcpar.__version__}"


@pytest.fixture(scope="module")
def corrupt_metrics(tmp_path_factory):
    path = tmp_path_factory.mktemp("plot") / "metrics.jsonl"
    path.write_text('{"step": 1, "loss": 5.0, "lr": 0.001, "tokens_per_s": 100}\n{"step": 2, "loss": 4.\n')
    return str(path)


USAGE_ERRORS = [
    ([], "hpcpar: error: the following arguments are required: COMMAND"),
    (["compare"], "hpcpar compare: error: the following arguments are required: job"),
    (["train", "jobs/gpt-dp.toml", "--stpes", "3"], "hpcpar train: error: unrecognized arguments: --stpes"),
    (["bench", "foo"], "hpcpar bench: error: argument BENCHMARK: invalid choice: 'foo'"),
    (["run", "/nope.py"], "hpcpar run: error: no such script '/nope.py'"),
    (["plot"], "hpcpar plot: error: the following arguments are required: path"),
    (["generate", "/nope"], "hpcpar generate: error: /nope:"),
    (["info", "--tp", "0"], "hpcpar info: error: tp must be a positive integer, got 0"),
    (["ckpt", "ls"], "hpcpar ckpt ls: error: the following arguments are required: root"),
    (["data", "prepare", "--max-mb", "x"], "hpcpar data prepare: error: argument --max-mb: invalid float value"),
    (["train", "/nope.toml"], "hpcpar train: error: /nope.toml: no such job file"),
    (["compare", "jobs/gpt-dp.toml", "--set", "parallel.tpp=2"], "hpcpar compare: error: jobs/gpt-dp.toml: "
                                                                 "parallel.tpp (--set): unknown key; did you mean 'tp'?"),
    (["info", "--log-ranks", "x"], "hpcpar info: error: argument --log-ranks: log ranks must be 'all'"),
    (["compare", "jobs/gpt-ps.toml"], "hpcpar compare: error: jobs/gpt-ps.toml: parallel.servers: 1 server(s) leave "
                                      "no worker among 1 ranks"),  # no one-rank baseline to measure against
    (["plot", "CORRUPT"], "hpcpar plot: error: CORRUPT, line 2: not JSON"),
    (["compare", "jobs/gpt-dp.toml", "--steps", "0"], "hpcpar compare: error: --steps must be >= 1"),
    (["train", "jobs/gpt-dp.toml", "--machine", "m.toml"], "hpcpar train: error: jobs/gpt-dp.toml: --machine: the "
                                                           "machine file is read by --dry-run and by parallel.layout"),
     # training in the job's own layout never reads it
    (["train", "jobs/gpt-dp.toml", "--dry-run", "--resume", "must", "--overwrite"],
     "hpcpar train: error: --resume, --overwrite do nothing with --dry-run"),  # they were ignored, exit 0
    (["train", "jobs/gpt-dp.toml", "--list-keys"], "hpcpar train: error: --list-keys prints every key and reads "
                                                   "no job"),  # the job and --set were ignored, exit 0
    (["generate", "/nope", "--top-k", "0"], "hpcpar generate: error: --tokens must be >= 0, --top-k >= 1"),  # 0 sampled every token
    (["compare", "jobs/gpt-dp.toml", "--set", 'train.device="guard"', "--precision", "bf16"],
     "hpcpar compare: error: precision bf16 on the GPU needs bfloat16 arrays"),  # before any layout runs
]


@pytest.mark.parametrize("args, start", USAGE_ERRORS, ids=[" ".join(a) or "no command" for a, _ in USAGE_ERRORS])
def test_a_usage_error_is_one_line_and_exit_status_2(args, start, corrupt_metrics):
    args = [corrupt_metrics if word == "CORRUPT" else word for word in args]
    proc = hpcpar_command(*args)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stdout == "" and "Traceback" not in proc.stderr
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(start.replace("CORRUPT", corrupt_metrics)), proc.stderr


@pytest.mark.parametrize("args, start", [(["info", "--tp", "3"], "hpcpar info: error: world size 4 is not divisible"),
                                         (["bench", "foo"], "hpcpar bench: error: argument BENCHMARK"),
                                         (["compare", "--steps", "2"], "hpcpar compare: error: the following"),
                                         (["compare", "jobs/gpt-ps.toml"], "hpcpar compare: error: jobs/gpt-ps.toml"),
                                         (["data", "prepare", "--out", "runs/never.h5", "/nope.txt"],
                                          "hpcpar data prepare: error: no such file '/nope.txt'")])  # was once per rank
def test_a_usage_error_under_mpiexec_is_one_line_from_rank_0(args, start):
    proc = hpcpar_command(*args, ranks=4)
    assert proc.returncode == 2 and "Traceback" not in proc.stdout + proc.stderr, proc.stdout + proc.stderr
    assert proc.stdout == "" and proc.stderr.splitlines() == [proc.stderr.splitlines()[0]]
    assert proc.stderr.startswith(start)


# ----------------------------------------------------------------------------------------
# Logging by rank
# ----------------------------------------------------------------------------------------
LOGGING_SCRIPT = """
from hpcpar import log
rank = log.world_rank()
log.get_logger("example").info(f"hello from {rank}")
log.get_logger("example").warning(f"careful on {rank}")
"""


@pytest.mark.parametrize("options, env, out, err", [
    ([], {}, ["hello from 0"], ["warning: careful on 0"]),
    (["--log-ranks", "all"], {}, ["[rank 0] hello from 0", "[rank 1] hello from 1"],
     ["[rank 0] warning: careful on 0", "[rank 1] warning: careful on 1"]),
    ([], {"HPCPAR_LOG_RANKS": "1"}, ["hello from 1"], ["warning: careful on 1"]),
    (["--log-level", "warning"], {}, [], ["warning: careful on 0"]),
    (["--log-level", "error"], {"HPCPAR_LOG_RANKS": "all"}, [], []),
])
def test_log_lines_come_from_the_ranks_asked_for(tmp_path, options, env, out, err):
    script = tmp_path / "logs.py"
    script.write_text(LOGGING_SCRIPT)
    proc = hpcpar_command("run", *options, script, ranks=2, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert sorted(proc.stdout.splitlines()) == out and sorted(proc.stderr.splitlines()) == err


@pytest.mark.parametrize("variable", ["HPCPAR_LOG_LEVEL", "HPCPAR_LOG_RANKS"])
def test_a_bad_log_variable_is_a_usage_line(variable):  # was a ValueError traceback
    proc = hpcpar_command("plot", "/nope.jsonl", env={variable: "bogus"})
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.startswith("hpcpar: error: log ") and "from the environment" in proc.stderr
    assert len(proc.stderr.splitlines()) == 1, proc.stderr


@pytest.mark.parametrize("variable, value", [("HPCPAR_STALL_S", "x"), ("HPCPAR_STALL_ABORT_S", "-1"),
                                             ("HPCPAR_ABORT_GRACE_S", "nan")])
def test_a_bad_waiting_time_variable_is_a_usage_line(variable, value):
    """Read deep inside a run (the first wait, the first abort): a traceback there, or an abort
    that failed in its own error path; now one line before the command runs."""
    proc = hpcpar_command("plot", "/nope.jsonl", env={variable: value})
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    expected = f"{variable} must be {'>= 0 seconds' if value != 'x' else 'a number of seconds'}, got {value!r}"
    assert proc.stderr.startswith(f"hpcpar: error: {expected}"), proc.stderr
    assert len(proc.stderr.splitlines()) == 1, proc.stderr


@pytest.mark.parametrize("variable, value, message", [("HPCPAR_DEVICE", "gpu", "device must be one of"),
                                                     ("HPCPAR_SHM", "maybe", "HPCPAR_SHM must be 0 or 1"),
                                                     ("HPCPAR_NODE_SIZE", "x", "HPCPAR_NODE_SIZE must be a positive")])
def test_hpcpar_info_names_a_bad_environment_variable(monkeypatch, variable, value, message):  # was a traceback
    from hpcpar.runtime.failfast import UsageError

    monkeypatch.setenv(variable, value)
    parsed = cli.build_parser("info").parse_args(["info"])
    with pytest.raises(UsageError, match=f"hpcpar info: error: {message}"):
        parsed.func(parsed)


def test_log_options_are_checked():
    from hpcpar import log

    assert log.parse_ranks("all") is None and log.parse_ranks("0, 3") == {0, 3}
    for bad in ("", "x", "-1", "1,,2"):
        with pytest.raises(ValueError, match="log ranks must be"):
            log.parse_ranks(bad)
    with pytest.raises(ValueError, match="log level must be one of"):
        log.configure(level="loud")


# ----------------------------------------------------------------------------------------
# Metrics files and plots
# ----------------------------------------------------------------------------------------
def records(first_step, last_step, lr=1e-3, **start):
    lines = [{"event": "start", "step": first_step - 1, **start}] if start else []
    for step in range(first_step, last_step + 1):
        lines.append({"step": step, "loss": 5.0 / step, "lr": lr * step, "tokens_per_s": 1000.0 + step})
    lines.append({"step": last_step, "val_loss": 4.0})
    return lines


def test_two_runs_and_a_resumed_segment_are_split():
    start = {"job": "demo", "layout": {"dp": 2, "pp": 2, "tp": 1, "world": 4}, "unit": "tokens"}
    old = records(1, 5)  # a file written before start records existed: split where the step goes back
    again = records(1, 3, **start)
    resumed = records(4, 6, **start, resumed_from="runs/demo/checkpoints/step-00000003")
    segments = plot.split_segments(old + again + resumed)
    assert [[r["step"] for r in s.train] for s in segments] == [[1, 2, 3, 4, 5], [1, 2, 3], [4, 5, 6]]
    assert [len(s.val) for s in segments] == [1, 1, 1]
    assert plot.title_of("m.jsonl", segments) == "demo: dp 2 x pp 2 x tp 1 on 4 ranks"
    assert plot.throughput_unit(segments) == "tokens"
    assert plot._label(3, segments[2], 3) == "segment 3 (resumed at step 4)"
    assert plot._label(2, segments[1], 3) == "segment 2"


def test_the_throughput_unit_of_a_file_without_start_records():
    cnn = records(1, 3)
    cnn[-1]["val_accuracy"] = 0.9
    assert plot.throughput_unit(plot.split_segments(cnn)) == "images"
    assert plot.throughput_unit(plot.split_segments(records(1, 3))) == "tokens"


def test_plot_draws_a_file_of_two_runs(tmp_path):
    pytest.importorskip("matplotlib")
    path = tmp_path / "metrics.jsonl"
    start = {"job": "demo", "layout": {"dp": 2, "pp": 2, "tp": 1, "world": 4}, "unit": "tokens"}
    path.write_text("".join(json.dumps(r) + "\n" for r in records(1, 5, **start) + records(1, 5, **start)))
    proc = hpcpar_command("plot", path)
    assert proc.returncode == 0 and proc.stdout.strip() == f"wrote {tmp_path / 'metrics.png'}", proc.stderr
    assert os.path.getsize(tmp_path / "metrics.png") > 10_000


def test_plot_draws_the_load_per_expert_of_each_moe_block(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    lines = records(1, 4)
    for r in lines:
        if "loss" in r:  # block 1's expert 2 takes ever more of the tokens
            r["moe"] = {"blocks": [1, 3], "experts": 4, "tokens": [[10, 10, 10, 10], [5, 5, 20 + r["step"], 10]],
                        "dropped": [0.0, 0.1], "aux_loss": 2.0, "z_loss": 1.0, "steps": 1}
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in lines))
    drawn = {}
    monkeypatch.setattr(plot, "_save", lambda plt, fig, out: drawn.setdefault("axes", fig.axes) and out)
    assert plot.plot_metrics(str(path)) == str(tmp_path / "metrics.png")
    titles = [ax.get_title() for ax in drawn["axes"]]
    assert titles == ["loss", "throughput", "learning rate", "block 1: load per expert", "block 3: load per expert"]
    stacked = drawn["axes"][4].collections  # one band per expert, stacked to 100 % at every record
    assert len(stacked) == 4
    top = stacked[-1].get_paths()[0].vertices[:, 1].max()
    assert top == pytest.approx(100)


@pytest.mark.parametrize("text, problem", [("not json\n", "line 1: not JSON"),
                                           ('{"step": 1, "loss": 2}\n[1, 2]\n', "line 2: not a metrics record"),
                                           ('{"step": 1, "val_loss": 2}\n', "no training records")])
def test_a_bad_metrics_file_is_named(tmp_path, text, problem):
    path = tmp_path / "metrics.jsonl"
    path.write_text(text)
    with pytest.raises(ValueError, match=problem):
        plot.plot_metrics(str(path))


def test_plot_checks_its_input_and_its_png_before_drawing(tmp_path, monkeypatch):
    """A folder as input was a traceback; --out odir wrote odir.png and said 'wrote odir'; --out into a missing
    folder or under a file was a traceback after drawing; a compare.json that is not an object a traceback."""
    from hpcpar.runtime.failfast import UsageError

    monkeypatch.chdir(tmp_path)
    pathlib.Path("m.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records(1, 3)))
    pathlib.Path("list.json").write_text("[1, 2]")
    pathlib.Path("text.json").write_text("xx")
    pathlib.Path("afile").write_text("x")
    for name in ("folder.jsonl", "shots.png"):
        os.mkdir(name)
    for path, out, message in (("folder.jsonl", None, "folder.jsonl is a folder, not a file"),
                               ("m.jsonl", "odir", "--out odir: not a .png file name; give one such as odir.png"),
                               ("m.jsonl", "shots.png", "--out shots.png is a folder; give the path of a file"),
                               ("m.jsonl", "afile/m.png", f"--out afile/m.png cannot be made: {tmp_path}/afile is a file"),
                               ("list.json", None, "list.json: not the compare.json of `hpcpar compare`"),
                               ("text.json", None, "text.json: not JSON (Expecting value")):
        with pytest.raises(UsageError) as caught:
            plot.run(argparse.Namespace(path=path, out=out))
        assert str(caught.value).startswith(f"hpcpar plot: error: {message}"), caught.value
    assert sorted(os.listdir()) == ["afile", "folder.jsonl", "list.json", "m.jsonl", "shots.png", "text.json"]
    if importlib.util.find_spec("matplotlib"):
        plot.run(argparse.Namespace(path="m.jsonl", out="new/folder/m.png"))  # a missing folder is made
        assert os.path.isfile("new/folder/m.png")


@pytest.mark.parametrize("change, message", [
    ({"prompt": ""}, "--prompt is empty; give the text the sample continues"),  # was an IndexError traceback
    ({"temperature": float("nan")}, "--temperature a number >= 0, got --tokens 5 --top-k 40 --temperature nan"),  # sampled
    ({"checkpoint": "FILE"}, "FILE: a file, not a folder; give a checkpoint root")])  # was an errno line about FILE/latest
def test_generate_refuses_bad_flags_and_a_file_as_checkpoint(tmp_path, change, message):
    from hpcpar import generate
    from hpcpar.runtime.failfast import UsageError

    (tmp_path / "FILE").write_text("x")
    args = argparse.Namespace(**{"checkpoint": "/nope", "tokens": 5, "prompt": "def ", "temperature": 0.8, "top_k": 40,
                                 "seed": 0, **change})
    args.checkpoint = args.checkpoint.replace("FILE", str(tmp_path / "FILE"))
    with pytest.raises(UsageError) as caught:
        generate.run(args)
    text = str(caught.value)
    assert text.startswith("hpcpar generate: error: ") and message.replace("FILE", str(tmp_path / "FILE")) in text, text


def test_compare_names_a_bad_environment_variable_before_measuring(tmp_path, monkeypatch):  # was a traceback
    from hpcpar.runtime.failfast import UsageError

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HPCPAR_SHM", "maybe")
    parsed = cli.build_parser("compare").parse_args(["compare", os.path.join(REPO, "jobs", "gpt-dp.toml")])
    with pytest.raises(UsageError, match="parallel.shm: unset, so the environment decides, and HPCPAR_SHM must be"):
        parsed.func(parsed)


def test_compare_checks_its_out_folder_before_measuring(tmp_path, monkeypatch):
    """--out under a file was a traceback once every layout had been measured."""
    from hpcpar.runtime.failfast import UsageError

    monkeypatch.chdir(tmp_path)
    (tmp_path / "afile").write_text("x")
    parsed = cli.build_parser("compare").parse_args(["compare", os.path.join(REPO, "jobs", "gpt-dp.toml"),
                                                     "--out", "afile/out"])
    with pytest.raises(UsageError, match=f"hpcpar compare: error: --out afile/out cannot be made: {tmp_path}/afile is "
                                         f"a file, not a folder"):
        parsed.func(parsed)


@pytest.mark.parametrize("words, message", [  # each was a traceback (or, for --stages 0, an empty table)
    (["step", "--steps", "0"], "argument --steps: must be >= 1, got 0"),
    (["step", "--warmup", "-1"], "argument --warmup: must be >= 0, got -1"),
    (["ckpt", "--repeats", "0"], "argument --repeats: must be >= 1, got 0"),
    (["allreduce", "--rounds", "0"], "argument --rounds: must be >= 1, got 0"),
    (["allreduce", "--max-mib", "-1"], "argument --max-mib: must be > 0, got -1"),
    (["dp", "--bucket-mb", "nan"], "argument --bucket-mb: expected a finite number, got 'nan'"),
    (["pipeline", "--micro", "4", "0"], "argument --micro: must be >= 1, got 0"),
    (["pipeline", "--stages", "0"], "argument --stages: must be >= 1, got 0"),
    (["recompute", "--n-head", "x"], "argument --n-head: expected an integer, got 'x'"),
    (["async", "--slow-rank", "-2"], "argument --slow-rank: must be >= -1, got -2"),
    (["net", "--rounds", "0"], "argument --rounds: must be >= 1, got 0"),
])
def test_bench_counts_out_of_range_are_usage_errors(words, message, capsys):
    with pytest.raises(SystemExit) as stop:
        cli.build_parser("bench").parse_args(["bench", *words])
    lines = capsys.readouterr().err.splitlines()
    assert stop.value.code == 2 and lines[-1].startswith(f"hpcpar bench {words[0]}: error: {message}"), lines


@pytest.mark.parametrize("words, message", [(["--n-head", "3"], "must be divisible by n_head (3)"),
                                            (["--dropout", "1.5"], "GPTConfig.dropout must be in [0, 1), got 1.5")])
def test_bench_recompute_refuses_a_model_that_cannot_be_built(words, message):  # each was a traceback
    from hpcpar.runtime.failfast import UsageError

    parsed = cli.build_parser("bench").parse_args(["bench", "recompute", *words])
    with pytest.raises(UsageError, match=re.escape(message)):
        parsed.func(parsed)


def test_bench_ckpt_needs_an_existing_dir(tmp_path):
    from hpcpar.runtime.failfast import UsageError

    (tmp_path / "afile").write_text("x")
    parsed = cli.build_parser("bench").parse_args(["bench", "ckpt", "--dir", str(tmp_path / "afile")])
    with pytest.raises(UsageError, match=f"--dir {tmp_path}/afile is not a folder"):  # mkdtemp's traceback on rank 0
        parsed.func(parsed)


def test_data_prepare_refuses_a_compressed_file(tmp_path):
    import gzip

    path = tmp_path / "notes.txt.gz"
    path.write_bytes(gzip.compress(b"some text\n" * 100))
    proc = hpcpar_command("data", "prepare", "--out", tmp_path / "t.h5", path)
    assert proc.returncode == 2 and not (tmp_path / "t.h5").exists()
    assert proc.stderr.strip() == (f"hpcpar data prepare: error: {str(path)!r} is gzip-compressed; tokens are the "
                                   f"bytes of plain text: decompress it first (gunzip -k {path})")


def test_jobs_reference_is_current():
    """docs/jobs.md is what `hpcpar train --list-keys` prints (regenerate with `make docs`)."""
    with open(os.path.join(REPO, "docs", "jobs.md")) as f:
        assert f.read() == cli.jobs_reference(), "docs/jobs.md is stale: run `make docs`"
    proc = hpcpar_command("train", "--list-keys")
    assert proc.returncode == 0 and proc.stdout == cli.jobs_reference()
    for key in ("parallel.sequence_parallel", "parallel.compression_ratio", "train.trace", "model.n_embd", "data.path"):
        assert f"| {key} |" in proc.stdout


# ----------------------------------------------------------------------------------------
# compare's CPU budget (MPI: the ranks of one node are counted together)
# ----------------------------------------------------------------------------------------
@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("threads", ["all", 1])
def test_compare_warns_when_the_ranks_threads_exceed_the_usable_cpus(world, monkeypatch, threads):
    from threadpoolctl import threadpool_limits

    from hpcpar import compare, host

    monkeypatch.setattr(host, "share_cores", lambda ranks: None)  # the thread count under test stays
    cpus = host.usable_cpus()
    count = cpus if threads == "all" else 1
    with threadpool_limits(limits=count, user_api="blas"):
        text, problem = compare.cpu_budget(world)
    if world.Get_rank() != 0:
        assert (text, problem) == ("", None)
        return
    assert text.startswith(f"{world.Get_size()} ranks on ") and f", {count} BLAS thread(s) per rank" in text
    if world.Get_size() * count > cpus:  # one node here: all ranks share its usable CPUs
        assert f"{world.Get_size()} ranks with {world.Get_size() * count} BLAS threads in all on {cpus}" in problem
    else:
        assert problem is None
