"""Every strategy's training step under the transfer guard (device "guard"), at 1, 2 and 4 ranks:
GPT and CNN with DDP (also dropout, fp16, top-k and PowerSGD), ZeRO-1, tensor parallelism, pipelines
(1F1B; zero-bubble), 3D (pp 2 x tp 2, interleaved), the parameter server and local SGD;
checkpoint save and load.

The GPU path runs on CPUs (``hpcpar.guard``): no implicit device-to-host conversion anywhere,
no read out of stream order, and per rank and step exactly the documented host <-> device
copies (docs/architecture.md, "The transfer guard"):

- ``batch``: one host-to-device copy per batch array fed (inputs and targets per micro-batch;
  a pipeline's first stage feeds inputs, its last stage targets);
- ``norm``: one device-to-host copy of the squared gradient norm when clipping;
- ``loss``: one device-to-host copy of the loss, at log steps only (the loop's ``report_step``);
- ``finite``: under fp16/bf16 one device-to-host copy of the finite check (gradients and loss);
- none for dropout: its keyed masks are drawn on the device (``nn.philox``), the same in every
  layout (a copy from ``nn/layers.py`` is undocumented and fails the test);
- ``powersgd start``: at PowerSGD's first step, each matrix's starting Q (drawn on the host);
- ``staging``, when MPI is not CUDA-aware: per communication call on a device buffer one
  device-to-host copy of what it sends and one host-to-device copy of what it receives (DDP:
  one all-reduce per bucket); none when it is (``HPCPAR_CUDA_AWARE=1``: mpi4py then hands MPI
  the guard arrays' ``__cuda_array_interface__``, which requires a synchronized producer).

Run by ``make test``'s MPI runs (``-m mpi`` at 1, 2 and 4 ranks); the last test plants an
implicit ``np.asarray`` in an op and shows the guard catches it.
"""
from __future__ import annotations

import collections
import contextlib
import os
import types

import numpy as np
import pytest
from mpi4py import MPI

from conftest import REPO
from hpcpar import guard
from hpcpar.autograd.ops import elementwise
from hpcpar.backend import is_gpu_array, to_host
from hpcpar.runtime.comm import Communicator
from hpcpar.train import lifecycle
from hpcpar.train.build import build
from hpcpar.train.config_load import load_job
from hpcpar.train.loop import report_step, start_context, train_one_step
from hpcpar.train.validate import validate

STEPS, LOG_INTERVAL = 4, 2
GPT = ["model.n_layer=2", "model.n_embd=32", "model.n_head=4", "model.block_size=16"]
COMMON = ["train.device=guard", "data.batch_size=12", f"train.log_interval={LOG_INTERVAL}", "train.eval_interval=0",
          "checkpoint.interval=0"]

# name: (job file, overrides for a world of n ranks, the world sizes it runs at)
LAYOUTS = {
    "gpt-ddp": ("gpt-dp.toml", lambda n: [*GPT, "parallel.bucket_mb=0.02"], (1, 2, 4)),
    "gpt-zero": ("gpt-dp.toml", lambda n: [*GPT, "parallel.zero=1"], (1, 2, 4)),
    "gpt-ddp-fp16": ("gpt-dp.toml", lambda n: [*GPT, "train.precision=fp16"], (1, 2)),
    "gpt-ddp-dropout": ("gpt-dp.toml", lambda n: [*GPT, "model.dropout=0.1"], (1, 2)),
    "gpt-ddp-topk": ("gpt-dp.toml", lambda n: [*GPT, "parallel.compression=topk"], (2,)),
    "gpt-ddp-powersgd": ("gpt-dp.toml", lambda n: [*GPT, "parallel.compression=powersgd"], (2,)),
    "cnn-ddp": ("cnn-digits-dp.toml", lambda n: ["parallel.zero=0", "parallel.bucket_mb=0.01"], (1, 2, 4)),
    "cnn-zero": ("cnn-digits-dp.toml", lambda n: [], (1, 2, 4)),
    "tensor-parallel": ("gpt-tp.toml", lambda n: [*GPT, "parallel.tp=2", f"parallel.dp={n // 2}"], (2, 4)),
    "pipeline": ("gpt-pp.toml", lambda n: [*GPT, "parallel.pp=2", f"parallel.dp={n // 2}",
                                           "parallel.micro_batches=2"], (2, 4)),
    "pipeline-zb1": ("gpt-pp.toml", lambda n: [*GPT, "parallel.pp=2", "parallel.dp=1", "parallel.micro_batches=4",
                                               "parallel.schedule=zb1"], (2,)),
    "3d": ("gpt-3d.toml", lambda n: [*GPT, "parallel.dp=1", "parallel.micro_batches=4"], (4,)),
    "parameter-server": ("gpt-ps.toml", lambda n: GPT, (2, 4)),
    "local-sgd": ("gpt-local-sgd.toml", lambda n: [*GPT, "parallel.local_steps=2"], (2, 4)),
}
# What a communication call copies when it stages a device buffer: (out of the device, into it).
STAGING = {"allreduce": (1, 1), "iallreduce": (1, 1), "reduce_scatter": (1, 1), "allgather": (1, 1),
           "send": (1, 0), "isend": (1, 0), "recv": (0, 1), "irecv": (0, 1)}
# Where each documented copy is made: (file, function) asking for it; the staging anywhere in device_transport.py.
SITES = {("autograd/ops/_common.py", "integer_array"): "batch", ("autograd/tensor.py", "constant"): "batch",
         ("optim/clip.py", "squares_on_host"): "norm", ("parallel/zero.py", "_counted_squares"): "norm",
         ("train/loop.py", "report_step"): "loss", ("runtime/device_transport.py", None): "staging",
         ("parallel/compression.py", "_compress_matrix"): "powersgd start", ("optim/finite.py", "finite_flags"): "finite"}


@pytest.fixture(scope="module")
def token_file(tmp_path_factory):
    """1 MB of byte tokens, prepared by rank 0 in-process (a subprocess cannot start MPI inside a rank)."""
    from hpcpar.data.prepare import prepare

    world = MPI.COMM_WORLD
    path = str(tmp_path_factory.mktemp("guard-data") / "stdlib.h5") if world.Get_rank() == 0 else None
    if path is not None:
        prepare(path, max_mb=1)
    return world.bcast(path, root=0)


def params(world_size: int):
    return [name for name, (_, _, sizes) in LAYOUTS.items() if world_size in sizes]


def make_job(name: str, world_size: int, token_file: str, *extra):
    path, overrides, _ = LAYOUTS[name]
    data = [] if path.startswith("cnn") else [f"data.path={token_file}"]
    return validate(load_job(os.path.join(REPO, "jobs", path), [*COMMON, *data, *overrides(world_size), *extra]),
                    world_size)


class QuietLog:
    """What ``report_step`` needs of the Logger, silent: the loop's own loss reads, nothing shown."""

    every_loss = False
    progress = types.SimpleNamespace(step=lambda *args: None)

    def step(self, record) -> None:
        pass

    def peak_memory_mb(self) -> float:
        return 0.0


@contextlib.contextmanager
def staged_calls(counts: collections.Counter):
    """Count the copies the documented staging implies, per outermost communication call on a
    device buffer (a call made inside another one is part of it)."""
    depth = [0]
    originals = {name: getattr(Communicator, name) for name in STAGING}

    def counting(name, method):
        def call(self, *args, **kwargs):
            depth[0] += 1
            try:
                return method(self, *args, **kwargs)
            finally:
                depth[0] -= 1
                if depth[0] == 0 and not self.cuda_aware and any(map(is_gpu_array, [*args, *kwargs.values()])):
                    counts["to_host"] += STAGING[name][0]
                    counts["to_device"] += STAGING[name][1]
        return call

    for name, method in originals.items():
        setattr(Communicator, name, counting(name, method))
    try:
        yield counts
    finally:
        for name, method in originals.items():
            setattr(Communicator, name, method)


def copies_by_kind() -> collections.Counter:
    """This step's guarded copies as {(kind, direction): count}; an undocumented site fails."""
    kinds = collections.Counter()
    for direction, _, site in guard.stats.log:
        path, function = site.split("/hpcpar/", 1)[-1].split(" in ")
        path = path.rsplit(":", 1)[0]
        kind = SITES.get((path, function), SITES.get((path, None)))
        assert kind is not None, f"an undocumented {direction} copy at {site}"
        kinds[kind, direction] += 1
    return kinds


def guarded_steps(job):
    """Train ``STEPS`` steps under the guard; the run, with ``run.steps``: per step (copies by
    kind, the copies the staged calls imply). None on ranks that only serve."""
    run = build(job, start_context(job))
    if not run.trains:
        run.strategy.serve(lambda step: None)
        return None
    steps = []
    for step in range(STEPS):
        guard.stats.reset()
        with staged_calls(collections.Counter()) as implied:
            loss, lr, _ = train_one_step(run, step)
        report_step(run, QuietLog(), step + 1, 0, loss, lr, 1.0)
        assert guard.stats.implicit == 0
        steps.append((copies_by_kind(), implied))
    run.strategy.finish_training(None)
    run.steps = steps
    return run


def documented(run, step: int) -> collections.Counter:
    """The copies docs/architecture.md documents for this rank's step (staging aside)."""
    job, ctx = run.job, run.ctx
    micro = job.parallel.micro_batches
    if job.parallel.pp > 1:  # the first stage feeds inputs, the last targets
        batch = micro * (ctx.pp_rank == 0) + micro * (ctx.pp_rank == ctx.pp_size - 1)
    else:
        batch = 2 * micro
    logged = step % job.train.log_interval == 0 or step in (1, job.train.steps)
    expected = collections.Counter({("batch", "to_device"): batch, ("norm", "to_host"): int(job.optimizer.grad_clip > 0),
                                    ("loss", "to_host"): int(logged)})
    expected["finite", "to_host"] = 1  # the finiteness check: the loss and, unclipped, the squares of the gradients
    if job.parallel.compression == "powersgd" and step == 1:  # each matrix's first Q, drawn on the host
        expected["powersgd start", "to_device"] = len(run.strategy.ddp.compression.qs)
    return +expected


def plain_ddp(run) -> bool:
    p = run.job.parallel
    return getattr(run.strategy, "ddp", None) is not None and p.pp == 1 and p.tp == 1 and p.compression == "none"


@pytest.mark.mpi
@pytest.mark.parametrize("cuda_aware", [False, True], ids=["staged", "cuda-aware"])
@pytest.mark.parametrize("layout", params(MPI.COMM_WORLD.Get_size()))
def test_a_training_step_makes_exactly_the_documented_copies(layout, cuda_aware, token_file, monkeypatch):
    monkeypatch.setenv("HPCPAR_CUDA_AWARE", "1" if cuda_aware else "0")
    run = guarded_steps(make_job(layout, MPI.COMM_WORLD.Get_size(), token_file))
    if run is None:
        return  # a parameter server: it served the steps
    for step, (kinds, implied) in enumerate(run.steps, start=1):
        staged = collections.Counter({direction: n for (kind, direction), n in kinds.items() if kind == "staging"})
        assert +collections.Counter({k: n for k, n in kinds.items() if k[0] != "staging"}) == documented(run, step)
        assert staged == +implied, f"step {step}: staging copies {dict(staged)}, the calls imply {dict(implied)}"
        if cuda_aware:
            assert not staged
        elif plain_ddp(run):
            buckets = len(run.strategy.ddp.buckets)  # DDP: one staged all-reduce per bucket
            assert staged == {"to_host": buckets, "to_device": buckets}
        elif run.job.parallel.compression == "topk":
            buckets = len(run.strategy.ddp.buckets)  # top-k: all-gathers of indices and of values per bucket
            assert staged == {"to_host": 2 * buckets, "to_device": 2 * buckets}


@pytest.mark.mpi
def test_checkpoints_save_and_load_device_arrays_with_one_copy_each(tmp_path_factory, token_file, world):
    folder = world.bcast(str(tmp_path_factory.mktemp("guard-ckpt")) if world.Get_rank() == 0 else None)
    layout = "3d" if world.Get_size() == 4 else "pipeline" if world.Get_size() == 2 else "gpt-zero"
    job = make_job(layout, world.Get_size(), token_file, f"checkpoint.dir={folder}", "train.steps=2")
    run = build(job, start_context(job))
    for step in range(2):
        train_one_step(run, step)
    guard.stats.reset()
    lifecycle.save_checkpoint(run, 2, final=True)
    saved = {name: to_host(p.data) for name, p in run.strategy.named_parameters()}
    assert guard.stats.implicit == 0 and guard.stats.to_device == 0 and guard.stats.to_host >= len(saved)

    fresh = build(job, start_context(job))
    guard.stats.reset()
    assert fresh.strategy.load_latest(folder, fresh.checkpoint_extra())["step"] == 2
    assert guard.stats.implicit == 0 and guard.stats.to_device >= len(saved)
    for name, p in fresh.strategy.named_parameters():
        assert is_gpu_array(p.data) and np.array_equal(to_host(p.data), saved[name]), name
    train_one_step(fresh, 2)
    assert guard.stats.implicit == 0


def test_an_implicit_copy_planted_in_an_op_fails_the_guard(token_file, monkeypatch):
    """``np.asarray`` on a device array inside gelu's forward: the step fails and is counted."""
    original = elementwise.Gelu.forward

    def planted(self, x, *args, **kwargs):
        np.asarray(x)  # what a NumPy-only habit looks like inside an op
        return original(self, x, *args, **kwargs)

    monkeypatch.setattr(elementwise.Gelu, "forward", planted)
    monkeypatch.setenv("HPCPAR_CUDA_AWARE", "0")
    with pytest.raises(guard.TransferGuardError, match="implicit device-to-host"):
        guarded_steps(make_job("gpt-ddp", 1, token_file))
    assert guard.stats.implicit == 1
