"""No rank waits forever: where ranks see different things (a file one node has and another
lacks, a node's own environment), every rank reaches the same verdict or the job aborts.

Each test starts a job whose ranks differ the way nodes can (MPMD: a working directory and
environment per rank, so a relative path names a node-local file) under a short timeout; the
code before each fix left some ranks in a collective forever and the run timed out (once, it
ended without a word of why). On a timeout the whole process group is killed, so no rank stays
behind.
"""
import json
import os
import shutil
import signal
import subprocess
import sys

import pytest

from conftest import venv_bin

HANG = None  # run_ranks' exit status of a job that was still running at its timeout


def run_ranks(ranks, timeout=30):
    """Run one rank per ``(folder, env, argv)`` of ``ranks`` in one MPI job; (exit status, or HANG
    when the job outlived ``timeout`` seconds, and its output)."""
    args = [venv_bin("mpiexec")]
    for folder, env, argv in ranks:
        args += [":"] if len(args) > 1 else []
        args += ["-n", "1", "-wdir", str(folder)] + [word for item in env.items() for word in ("-env", *item)] + argv
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
                            env={**os.environ, "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"})
    try:
        output, _ = proc.communicate(timeout=timeout)
        return proc.returncode, output
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # mpiexec and every rank: none may stay behind
        output, _ = proc.communicate()
        return HANG, output


def tiny_job(folder, token_file, **sections) -> str:
    """A GPT job of a few seconds in ``folder``/job.toml; ``sections`` adds TOML lines per section."""
    text = {"model": 'kind = "gpt"\nblock_size = 16\nn_layer = 1\nn_head = 2\nn_embd = 16',
            "data": f'path = "{token_file}"\nbatch_size = 4',
            "train": "steps = 2\neval_interval = 0\nsample_tokens = 0\nlog_interval = 1",
            "checkpoint": "interval = 0"}
    for name, lines in sections.items():
        text[name] += "\n" + lines
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, "job.toml")
    with open(path, "w") as f:
        f.write("".join(f"[{name}]\n{body}\n" for name, body in text.items()))
    return path


def hpcpar(*words):
    return [sys.executable, "-m", "hpcpar", *words]


@pytest.mark.parametrize("command, missing", [("train", "job"), ("compare", "job"), ("train", "data"),
                                              ("train --dry-run", "job")])
def test_a_file_only_one_node_has_is_refused_on_every_rank(tmp_path, token_file, command, missing):
    """Rank 0's folder holds job.toml (or the job's data file), rank 1's does not: rank 1 exited 2
    alone and rank 0 waited in its first collective forever (--dry-run has none: rank 0 printed
    its prediction and the job ended 2 with no message); now both exit 2 with one line naming the
    rank that lacks it."""
    for node in ("node1", "node2"):
        tiny_job(tmp_path / node, "tokens.h5")  # data.path relative: each rank's own folder
    shutil.copy(token_file, tmp_path / "node1" / "tokens.h5")  # node2 has no data file
    if missing == "job":
        os.remove(tmp_path / "node2" / "job.toml")
    command, *options = command.split()
    extra = ["--steps", "1", "--out", str(tmp_path / "out")] if command == "compare" else options
    status, output = run_ranks([(tmp_path / node, {}, hpcpar(command, "job.toml", *extra))
                                for node in ("node1", "node2")])
    assert status == 2, output
    errors = [line for line in output.splitlines() if f"hpcpar {command}: error" in line]
    expected = "no such job file" if missing == "job" else "tokens.h5"
    assert len(errors) == 1 and expected in errors[0] and "found by rank 1" in errors[0], output
    assert "Traceback" not in output


@pytest.mark.parametrize("device, message", [
    ("cuda", "device='cuda' was requested but"),  # no GPU on this machine: rank 1's node cannot give one
    ("guard", "means different things on different ranks: cpu on rank 0"),
])
@pytest.mark.parametrize("command", ["train", "info", "compare"])
def test_a_device_one_node_cannot_give_is_refused_on_every_rank(tmp_path, token_file, device, message, command):
    """HPCPAR_DEVICE set on rank 1's node alone (as a node's environment module might): rank 1 raised
    DeviceError alone (in init under hpcpar train, in its own check under hpcpar info), exited 2,
    and rank 0 waited in init's first collective forever (or the ranks went on with different
    devices); now every rank exits 2 with one line."""
    tiny_job(tmp_path, token_file)
    words = {"train": ["job.toml"], "info": [], "compare": ["job.toml", "--steps", "1", "--out", str(tmp_path)]}
    argv = hpcpar(command, *words[command])
    status, output = run_ranks([(tmp_path, {"HPCPAR_DEVICE": "cpu"}, argv),
                                (tmp_path, {"HPCPAR_DEVICE": device}, argv)])
    assert status == 2, output
    errors = [line for line in output.splitlines() if f"hpcpar {command}: error" in line]
    assert len(errors) == 1 and message in errors[0] and "rank 1" in errors[0], output
    assert "Traceback" not in output


def break_version(folder) -> None:
    """The manifests under ``folder`` claim a version no reader knows (a CheckpointError, not damage)."""
    for step in os.listdir(folder):
        path = os.path.join(folder, step, "manifest.json")
        if os.path.isfile(path):
            with open(path) as f:
                manifest = json.load(f)
            manifest["version"] = 999
            with open(path, "w") as f:
                json.dump(manifest, f)


@pytest.mark.parametrize("node2", ["empty", "another-version"])
@pytest.mark.parametrize("resume", ["auto", "ckpt/step-00000002"])
def test_a_checkpoint_folder_only_one_node_has_is_refused_on_every_rank(tmp_path, token_file, node2, resume):
    """checkpoint.dir on node-local storage: rank 0's node holds a checkpoint, rank 1's has none (or
    one it cannot read). Rank 0 decided to resume, rank 1 found no 'latest' (or no step folder, or
    a manifest of another version) and was refused alone (exit 2) while rank 0 waited in the
    load's all-gather forever; now every rank reads the step rank 0 names, rank 1's failure is
    every rank's, and all exit 2 with one line."""
    for node in ("node1", "node2"):
        tiny_job(tmp_path / node, token_file, checkpoint='dir = "ckpt"')
    status, output = run_ranks([(tmp_path / "node1", {}, hpcpar("train", "job.toml"))] * 2, timeout=120)
    assert status == 0, output  # a checkpoint on node1 alone
    if node2 == "another-version":
        shutil.copytree(tmp_path / "node1" / "ckpt", tmp_path / "node2" / "ckpt")
        break_version(tmp_path / "node2" / "ckpt")
    status, output = run_ranks([(tmp_path / node, {}, hpcpar("train", "job.toml", "--resume", resume))
                                for node in ("node1", "node2")])
    assert status == 2, output
    errors = [line for line in output.splitlines() if "hpcpar train: error" in line]
    assert len(errors) == 1 and "nothing was" in errors[0] and "(rank 1)" in output, output
    assert "Traceback" not in output


ONE_RANK_FAILS = """
import sys
from mpi4py import MPI
import hpcpar.bench.ckpt as bench

def raw_write(path, data):
    raise OSError(28, "No space left on device (injected on rank 1)")

if MPI.COMM_WORLD.Get_rank() == 1:
    bench.raw_write = raw_write
from hpcpar.cli import main
main(sys.argv[1:])
"""


def test_hpcpar_bench_ckpt_aborts_when_one_rank_fails(tmp_path):
    """A write that fails on rank 1 alone: rank 1 went into the cleanup's barrier while rank 0 waited in
    the timing's all-reduce, and neither ever left; now rank 1's error aborts the job, one traceback."""
    script = tmp_path / "bench.py"
    script.write_text(ONE_RANK_FAILS)
    argv = [sys.executable, str(script), "bench", "ckpt", "--repeats", "1", "--n-layer", "1", "--n-embd", "32",
            "--dir", str(tmp_path)]
    status, output = run_ranks([(tmp_path, {}, argv)] * 2)
    assert status not in (HANG, 0), output
    assert "rank 1 of 2 failed" in output and "injected on rank 1" in output and output.count("Traceback") == 1


ASYNC_SAVE_FAILS = """
import sys
import numpy as np
import hpcpar
from hpcpar import checkpoint
from hpcpar.checkpoint import writer
from hpcpar.nn.gpt import GPT, GPTConfig

ctx = hpcpar.init()
model = GPT(GPTConfig(vocab_size=256, block_size=8, n_layer=1, n_head=2, n_embd=8), dtype=np.float32)

def write_array(fd, arrays, offset):
    raise MemoryError("injected on rank 1")

if ctx.rank == 1:
    writer.write_array = write_array
checkpoint.save(sys.argv[1], 1, model, None, ctx, asynchronous=True)
# the script ends here: the pending save is waited for at exit (atexit), as the writer promises
"""


def test_an_asynchronous_save_that_fails_on_one_rank_fails_on_every_rank(tmp_path):
    """An error of another type than OSError, ValueError or RuntimeError in rank 1's writer thread
    stayed rank 1's: rank 0's writer waited for rank 1 in the save's barrier forever (at exit too,
    where the save is waited for); now every rank's save fails with the error naming rank 1, and
    the job's status says so (Python ignores an error raised at exit: it ended with status 0)."""
    script = tmp_path / "save.py"
    script.write_text(ASYNC_SAVE_FAILS)
    status, output = run_ranks([(tmp_path, {}, [sys.executable, str(script), str(tmp_path / "ckpt")])] * 2)
    assert status not in (HANG, 0), output
    assert output.count("rank 1: MemoryError: injected on rank 1") == 2, output  # heard on both ranks
    assert output.count("saved in the background failed while the process was ending") == 2, output
    assert "Traceback" not in output, output
    assert not os.path.exists(tmp_path / "ckpt" / "latest")


SAVE_REFUSED_ON_ONE_RANK = """
import sys
import numpy as np
import hpcpar
from hpcpar import checkpoint
from hpcpar.autograd import Tensor

ctx = hpcpar.init()
weights = Tensor(np.zeros(4, dtype=np.complex64 if ctx.rank == 1 else np.float32))  # HDF5 stores no complex
try:
    checkpoint.save(sys.argv[1], 1, [(f"w{ctx.rank}", weights)], None, ctx)
except checkpoint.CheckpointError as error:  # as checkpoint.on_error = "warn" does: training goes on
    print(f"rank {ctx.rank}: {error}", flush=True)
ctx.world.barrier()
print(f"rank {ctx.rank} went on", flush=True)
"""


def test_a_save_one_rank_refuses_is_refused_on_every_rank(tmp_path):
    """Rank 1 holds a piece HDF5 cannot store: it raised CheckpointError alone, before the save's
    all-gather, and (as checkpoint.on_error = "warn" does) went on while rank 0 waited in the
    all-gather forever; now every rank raises the same error naming rank 1, and both go on."""
    script = tmp_path / "save.py"
    script.write_text(SAVE_REFUSED_ON_ONE_RANK)
    status, output = run_ranks([(tmp_path, {}, [sys.executable, str(script), str(tmp_path / "ckpt")])] * 2)
    assert status == 0, output
    for rank in (0, 1):
        assert f"rank {rank}: checkpoint" in output and f"rank {rank} went on" in output, output
    assert output.count("dtype complex64 cannot be stored in HDF5; checkpoint float32 master weights instead "
                        "(rank 1)") == 2, output
    assert not os.path.exists(tmp_path / "ckpt" / "step-00000001.tmp")


BACKEND_ON_ONE_RANK = """
import sys
sys.path.insert(0, sys.argv[1])
import nccl_double
from mpi4py import MPI
from hpcpar.runtime.context import init

rank = MPI.COMM_WORLD.Get_rank()  # rank 0's node has NCCL (the tests' double), rank 1's has none
ctx = init(device="guard", backend="auto", runtime=nccl_double.runtime() if rank == 0 else None, shm=False)
print("init returned", flush=True)
"""


def test_a_backend_that_differs_between_nodes_is_refused_on_every_rank(tmp_path):
    """parallel.backend = "auto" where only rank 0's node has NCCL: rank 0 built NCCL communicators,
    rank 1 MPI ones, and the two waited for each other in different calls forever; now every rank
    raises the same DeviceError naming the ranks, which fail-fast turns into an abort."""
    script = tmp_path / "backend.py"
    script.write_text(BACKEND_ON_ONE_RANK)
    status, output = run_ranks([(tmp_path, {}, [sys.executable, str(script), os.path.dirname(__file__)])] * 2)
    assert status not in (HANG, 0), output
    assert "parallel.backend = 'auto' means different things on different ranks: nccl on rank 0" in output, output
    assert "init returned" not in output


def test_hpcpar_run_of_a_script_only_one_node_has_is_refused_on_every_rank(tmp_path):
    """`hpcpar run script.py` where only rank 0's folder holds the script: rank 1 exited 2 alone and
    rank 0 ran the script into its first collective, where it waited forever; now both exit 2."""
    os.makedirs(tmp_path / "node1")
    os.makedirs(tmp_path / "node2")
    (tmp_path / "node1" / "script.py").write_text("from mpi4py import MPI\nMPI.COMM_WORLD.Barrier()\n"
                                                  "print('SCRIPT RAN')\n")
    status, output = run_ranks([(tmp_path / node, {}, hpcpar("run", "script.py")) for node in ("node1", "node2")])
    assert status == 2, output
    errors = [line for line in output.splitlines() if "hpcpar run: error" in line]
    assert len(errors) == 1 and "no such script 'script.py'" in errors[0] and "found by rank 1" in errors[0], output
    assert "SCRIPT RAN" not in output


PRECISION_ON_ONE_RANK = """
import sys
from mpi4py import MPI
from hpcpar.backend import DeviceError
import hpcpar.train.loop as loop

def check_precision(device, precision):  # as on a node whose CuPy lacks bfloat16
    raise DeviceError("precision bf16 on the GPU needs bfloat16 arrays (injected on rank 1)")

if MPI.COMM_WORLD.Get_rank() == 1:
    loop.check_precision = check_precision
from hpcpar.cli import main
main(sys.argv[1:])
"""


def test_a_precision_one_node_cannot_run_is_refused_on_every_rank(tmp_path, token_file):
    """The precision check after init raised DeviceError on rank 1 alone (its node's CuPy): rank 1
    exited 2 and rank 0 waited in build's first collective forever; now every rank exits 2."""
    tiny_job(tmp_path, token_file)
    script = tmp_path / "train.py"
    script.write_text(PRECISION_ON_ONE_RANK)
    status, output = run_ranks([(tmp_path, {}, [sys.executable, str(script), "train", "job.toml"])] * 2)
    assert status == 2, output
    errors = [line for line in output.splitlines() if "hpcpar train: error" in line]
    assert len(errors) == 1 and "injected on rank 1" in errors[0] and "rank 1" in errors[0], output


CUT_SHORT_ON_ONE_RANK = """
import sys
import numpy as np
import hpcpar
from hpcpar import checkpoint
from hpcpar.checkpoint import source
from hpcpar.nn.gpt import GPT, GPTConfig

ctx = hpcpar.init()
model = GPT(GPTConfig(vocab_size=256, block_size=8, n_layer=1, n_head=2, n_embd=8), dtype=np.float32)
for step in (1, 2):
    checkpoint.save(sys.argv[1], step, model, None, ctx)
fill = source.RawSource.fill_targets

def cut_short_once(self):  # as when another process truncates a shard between its check and the copy
    source.RawSource.fill_targets = fill
    return [f"{self.step_dir}/shard-00001.h5: shorter than when it was checked (injected on rank 1)"]

if ctx.rank == 1:
    source.RawSource.fill_targets = cut_short_once
info = checkpoint.load_latest(sys.argv[1], model, None, ctx)
ctx.world.barrier()
print(f"rank {ctx.rank} loaded step {info['step']}", flush=True)
"""


def test_a_load_cut_short_on_one_rank_falls_back_on_every_rank(tmp_path):
    """A shard cut short between its check and the copy on rank 1 alone: rank 1 raised damage
    alone and tried the older step while rank 0 had loaded the newer one and gone on, and the two
    waited in different collectives forever; now every rank finds the damage and loads step 1."""
    script = tmp_path / "load.py"
    script.write_text(CUT_SHORT_ON_ONE_RANK)
    status, output = run_ranks([(tmp_path, {}, [sys.executable, str(script), str(tmp_path / "ckpt")])] * 2)
    assert status == 0, output
    assert "rank 0 loaded step 1" in output and "rank 1 loaded step 1" in output, output
    assert "injected on rank 1" in output  # the warning that skips step 2


def test_ranks_that_read_different_jobs_are_refused_on_every_rank(tmp_path, token_file):
    """The job file differs between the nodes (or changed while the ranks read it): the ranks built
    different models and waited for each other in different collectives; now every rank exits 2."""
    for node, layers in (("node1", 1), ("node2", 2)):
        path = tiny_job(tmp_path / node, token_file)
        with open(path) as f:
            text = f.read().replace("n_layer = 1", f"n_layer = {layers}")
        with open(path, "w") as f:
            f.write(text)
    status, output = run_ranks([(tmp_path / node, {}, hpcpar("train", "job.toml")) for node in ("node1", "node2")])
    assert status == 2, output
    errors = [line for line in output.splitlines() if "hpcpar train: error" in line]
    assert len(errors) == 1 and "world rank(s) [1] read another job than rank 0" in errors[0], output
    assert "Traceback" not in output


LEAVING_SCRIPT = """
import sys, time
import numpy as np
import hpcpar
ctx = hpcpar.init()
x = np.ones(4)
ctx.world.allreduce(x, out=x)
if ctx.rank == 1:
    sys.exit(int(sys.argv[1]))  # a plain script: no hook sees this exit
if sys.argv[1] == "0":
    time.sleep(2)  # rank 0 ends last, with nothing left to do together: a normal end
elif sys.argv[2] == "allreduce":
    ctx.world.allreduce(x, out=x)  # rank 1 will never come
else:
    ctx.world.recv(x, source=1, tag=7)  # nor send
print("rank", ctx.rank, "done")
"""


@pytest.mark.parametrize("status, wait", [(0, "-"), (3, "allreduce"), (3, "recv")])
def test_a_rank_that_ends_its_program_answers_the_stall_census(tmp_path, status, wait):
    """sys.exit(3) on rank 1 of a plain script: rank 1 waits at its exit (before MPI_Finalize) and
    answers that it has left, so rank 0, stalled in an all-reduce rank 1 will never call (at its
    census) or in a receive from it (asking it), stops at HPCPAR_STALL_S instead of waiting
    forever. Ranks that end at different times with nothing pending end normally."""
    script = tmp_path / "leaving.py"
    script.write_text(LEAVING_SCRIPT)
    rank = (tmp_path, {"HPCPAR_STALL_S": "1"}, [sys.executable, str(script), str(status), wait])
    code, output = run_ranks([rank, rank])
    if status == 0:
        assert code == 0 and "rank 0 done" in output, output
        return
    assert code not in (0, HANG), output
    expected = {"allreduce": " after its collective #1 there, while rank 0 waits in allreduce #2, which can never "
                             "complete",
                "recv": ", while rank 0 waits in recv (tag 7) for it, which can never complete"}[wait]
    assert f"rank 1 of communicator 'world' has ended its program{expected}" in output, output
