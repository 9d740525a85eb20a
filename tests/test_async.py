"""Parameter server and local SGD: equal to data parallelism where they should be, bounded when asynchronous.

Synchronous parameter server (1 and 2 servers) and local SGD with H = 1 (SGD) equal one process
with the global batch (and DDP on the same workers) in float64; the asynchronous server never
lets a worker read parameters more than s steps ahead of the slowest worker, and still trains;
a raising worker ends the job at once; shutdown leaves nobody waiting.
"""
import os
import re
import subprocess
import sys
import time

import numpy as np
import pytest

import hpcpar
from conftest import REPO, venv_bin
from dp_reference import CONFIG, make_model, max_difference
from hpcpar.optim import SGD, AdamW
from hpcpar.parallel import DistributedDataParallel
from hpcpar.parallel.local_sgd import LocalSGD
from hpcpar.parallel.ps import ParameterServer
from hpcpar.parallel.ps.protocol import shard_ranges
from hpcpar.train.config import ParallelSection
from hpcpar.train.config_load import load_job
from hpcpar.train.strategies import STRATEGIES, make_strategy

GLOBAL_BATCH = 12  # divisible by 1, 2, 3 and 4 workers
STEPS = 3
ADAMW = (AdamW, {"lr": 1e-2, "weight_decay": 0.1})
SGD_PLAIN = (SGD, {"lr": 0.1})
SGD_MOMENTUM = (SGD, {"lr": 0.1, "momentum": 0.9, "weight_decay": 0.01})


def global_batch(step: int):
    rng = np.random.default_rng(2000 + step)
    ids = rng.integers(0, CONFIG.vocab_size, (GLOBAL_BATCH, CONFIG.block_size + 1))
    return ids[:, :-1], ids[:, 1:]


def local_batch(step: int, ctx):
    per_rank = GLOBAL_BATCH // ctx.dp_size
    rows = slice(ctx.dp_rank * per_rank, (ctx.dp_rank + 1) * per_rank)
    ids, targets = global_batch(step)
    return ids[rows], targets[rows]


def parameters(model) -> dict:
    return {name: p.data.copy() for name, p in model.named_parameters()}


def train_serial(optimizer, steps=STEPS) -> dict:
    """The single-process answer: the full global batch, one optimizer step per step."""
    optimizer_class, options = optimizer
    model = make_model()
    opt = optimizer_class(model.named_parameters(), **options)
    for step in range(steps):
        model.loss(*global_batch(step)).backward()
        opt.step()
        opt.zero_grad()
    return parameters(model)


def train_ddp(ctx, optimizer, steps=STEPS) -> dict:
    optimizer_class, options = optimizer
    model = make_model()
    ddp = DistributedDataParallel(model, ctx)
    opt = optimizer_class(model.named_parameters(), **options)
    for step in range(steps):
        model.loss(*local_batch(step, ctx)).backward()
        ddp.finish_grad_sync()
        opt.step()
        opt.zero_grad()
    return parameters(model)


def world_size():
    from mpi4py import MPI

    return MPI.COMM_WORLD.Get_size()


# ----------------------------------------------------------------------------------------
# serial
# ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("numel, parts", [(10, 1), (10, 3), (7, 7), (1000003, 4)])
def test_shard_ranges_are_contiguous_and_balanced(numel, parts):
    ranges = shard_ranges(numel, parts)
    assert ranges[0][0] == 0 and ranges[-1][1] == numel
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
    sizes = [stop - start for start, stop in ranges]
    assert max(sizes) - min(sizes) <= 1


def test_parameter_server_needs_a_worker():
    ctx = hpcpar.runtime.single_process()
    with pytest.raises(ValueError, match="servers must be an integer in 1..0"):
        ParameterServer(make_model().named_parameters(), ctx, AdamW, servers=1)


def test_every_mode_of_the_job_schema_has_a_strategy():
    from dataclasses import fields

    modes = next(f for f in fields(ParallelSection) if f.name == "mode").metadata["choices"]
    assert set(modes) <= set(STRATEGIES)


PS_SCRIPT = """
import os, sys, time
import numpy as np
from hpcpar.runtime import failfast
failfast.install()
import hpcpar
from hpcpar.nn.gpt import GPT, GPTConfig
from hpcpar.optim import AdamW
from hpcpar.parallel.ps import ParameterServer

ctx = hpcpar.init(device="cpu")
model = GPT(GPTConfig(vocab_size=16, block_size=8, n_layer=1, n_head=2, n_embd=8))
ps = ParameterServer(model.named_parameters(), ctx, AdamW, servers=1, staleness=1, lr=1e-2)
ps.serve()
if ps.is_worker:
    rng = np.random.default_rng(ctx.rank)
    for step in range(6):
        ids = rng.integers(0, 16, (2, 9))
        model.loss(ids[:, :-1], ids[:, 1:]).backward()
        if ctx.rank == 1 and step == 2 and os.environ.get("PS_RAISE") == "1":
            raise RuntimeError("deliberate failure in worker one")
        ps.push_pull()
ps.shutdown()
print(f"rank {ctx.rank} finished", flush=True)
"""


def run_ps_script(tmp_path, raise_in_worker: bool):
    script = tmp_path / "ps_job.py"
    script.write_text(PS_SCRIPT)
    env = {**os.environ, "PS_RAISE": "1" if raise_in_worker else "0", "PYTHONPATH": REPO}
    return subprocess.run([venv_bin("mpiexec"), "-n", "3", sys.executable, str(script)], capture_output=True,
                          text=True, timeout=60, env=env)


def test_a_raising_worker_ends_the_job_promptly(tmp_path):
    proc = run_ps_script(tmp_path, raise_in_worker=True)
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0  # promptly: run_ps_script's timeout is the bound, "finished" below the proof
    assert "rank 1 of 3 failed" in output and "deliberate failure in worker one" in output
    assert "Traceback" in output and "finished" not in output


def test_shutdown_ends_every_rank(tmp_path):
    proc = run_ps_script(tmp_path, raise_in_worker=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert sorted(re.findall(r"rank (\d) finished", proc.stdout)) == ["0", "1", "2"]


# ----------------------------------------------------------------------------------------
# synchronous parameter server == data parallelism
# ----------------------------------------------------------------------------------------
@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("servers", [1, 2])
@pytest.mark.parametrize("optimizer, max_grad_norm", [(ADAMW, 0.0), (SGD_MOMENTUM, 0.0), (ADAMW, 0.05)],
                         ids=["adamw", "sgd-momentum", "adamw-clipped"])
def test_synchronous_ps_equals_data_parallel(servers, optimizer, max_grad_norm):
    if servers >= world_size():
        pytest.skip(f"{servers} servers need more than {world_size()} ranks")
    if GLOBAL_BATCH % (world_size() - servers):
        pytest.skip(f"the global batch {GLOBAL_BATCH} does not split over {world_size() - servers} workers")
    ctx = hpcpar.init(device="cpu")
    optimizer_class, options = optimizer
    model = make_model()
    ps = ParameterServer(model.named_parameters(), ctx, optimizer_class, servers=servers, staleness=0,
                         max_grad_norm=max_grad_norm, **options)
    workers = ctx.world_size - servers
    assert ps.is_worker == (ctx.rank < workers)
    ps.serve()
    if ps.is_worker:
        assert ps.ctx.dp_size == workers and ps.ctx.dp_rank == ctx.rank
        for step in range(STEPS):
            model.loss(*local_batch(step, ps.ctx)).backward()
            ps.push_pull()
            assert all(p.grad is None for p in model.parameters())
    ps.shutdown()
    if ps.is_worker:
        if max_grad_norm:  # the serial answer with the averaged gradient clipped
            reference = train_clipped_serial(optimizer, max_grad_norm)
        else:
            reference = train_ddp(ps.ctx, optimizer)  # DDP on the same workers ...
            assert max_difference(reference, train_serial(optimizer)) <= 1e-10  # ... is one process
        assert max_difference(parameters(model), reference) <= 1e-10
        # Exact traffic: per step a 32-byte header and a gradient slice to each server; the stop header.
        numel = sum(p.size for p in model.parameters())
        assert ps.comm.stats.calls("isend") == STEPS * 2 * servers + servers
        assert ps.comm.stats.bytes("isend") == (STEPS + 1) * servers * 32 + STEPS * numel * 8
        assert ps.versions == [STEPS] * servers
    else:
        start, stop = ps.ranges[ps.server_index]
        assert ps.shard.size == stop - start
        assert ps.version == STEPS and len(ps.update_log) == STEPS * workers
        assert {(r.worker, r.step) for r in ps.update_log} == {(w, s) for w in range(workers) for s in range(STEPS)}
        assert all(r.staleness == 0 and r.lead == 0 and r.version == r.step + 1 for r in ps.update_log)


def train_clipped_serial(optimizer, max_grad_norm):
    from hpcpar.optim import clip_grad_norm

    optimizer_class, options = optimizer
    model = make_model()
    opt = optimizer_class(model.named_parameters(), **options)
    clipped = []
    for step in range(STEPS):
        model.loss(*global_batch(step)).backward()
        clipped.append(clip_grad_norm(model.parameters(), max_grad_norm) > max_grad_norm)
        opt.step()
        opt.zero_grad()
    assert all(clipped)  # the test exercises clipping
    return parameters(model)


# ----------------------------------------------------------------------------------------
# asynchronous parameter server: the staleness bound holds, training converges
# ----------------------------------------------------------------------------------------
PATTERN_VOCAB = CONFIG.vocab_size


def pattern_batch(rng, rows):
    """Sequences that count up modulo the vocabulary from a random start: learnable in a few steps."""
    starts = rng.integers(0, PATTERN_VOCAB, (rows, 1))
    ids = (starts + np.arange(CONFIG.block_size + 1)) % PATTERN_VOCAB
    return ids[:, :-1], ids[:, 1:]


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("shm, nonblocking", [(False, True), (True, False)])
def test_the_workers_context_communicates_as_the_worlds(shm, nonblocking):
    """The workers' own context took only the device, wait policy and backend: parallel.shm = false
    still attached shared-memory windows there, and device_nonblocking fell back to the table."""
    ctx = hpcpar.init(device="cpu", shm=shm, device_nonblocking=nonblocking)
    ps = ParameterServer(make_model().named_parameters(), ctx, AdamW, servers=1, lr=1e-2)
    ps.serve()
    if ps.is_worker:
        assert ps.ctx.shm == ctx.shm == shm and ps.ctx.dp.device_nonblocking is nonblocking
    ps.shutdown()


@pytest.mark.mpi(min_size=3)
@pytest.mark.parametrize("staleness", [1, 2])
def test_asynchronous_ps_respects_the_staleness_bound_and_trains(staleness):
    steps, slow_seconds = 25, 0.02
    ctx = hpcpar.init(device="cpu")
    model = make_model()
    ps = ParameterServer(model.named_parameters(), ctx, AdamW, servers=1, staleness=staleness, lr=1e-2)
    workers = ps.num_workers
    held_out = pattern_batch(np.random.default_rng(99), 16)
    initial_loss = model.loss(*held_out).item()
    ps.serve()
    if ps.is_worker:
        rng = np.random.default_rng([5, ctx.rank])
        for step in range(steps):
            if ctx.rank == 0:
                time.sleep(slow_seconds)  # the straggler: the others run ahead until the bound stops them
            model.loss(*pattern_batch(rng, 4)).backward()
            ps.push_pull()
    ps.shutdown()
    if ps.is_worker:
        final = parameters(model)
        everyone = ps.ctx.dp.allgather_object(final)
        assert all(max_difference(final, other) == 0 for other in everyone)  # all end with the final model
        final_loss = model.loss(*held_out).item()
        assert final_loss < 0.5 * initial_loss, (initial_loss, final_loss)
    else:
        log = ps.update_log
        assert len(log) == steps * workers and ps.version == steps * workers
        assert [r.version for r in log] == list(range(1, steps * workers + 1))
        assert max(r.lead for r in log) == staleness  # the bound was reached (the straggler held the others) ...
        assert all(r.lead <= staleness for r in log)  # ... and never exceeded
        assert ps.max_staleness > 0
        assert all(0 <= r.staleness <= (workers - 1) * (2 * staleness + 1) for r in log)
        for w in range(workers):  # each worker's steps arrive in order
            assert [r.step for r in log if r.worker == w] == list(range(steps))


# ----------------------------------------------------------------------------------------
# mixed precision on the parameter server: float32 masters on the servers, float32 pushes
# ----------------------------------------------------------------------------------------
NO_DECAY = ("*.bias", "*ln_*", "embed.*")


def low_dtype(precision):
    return pytest.importorskip("ml_dtypes").bfloat16 if precision == "bf16" else np.float16


def low_model(precision):
    from hpcpar.nn.gpt import GPT

    return GPT(CONFIG, dtype=low_dtype(precision))


def fp16_scaler(precision):
    from hpcpar.optim import DynamicLossScaler

    # 2**28: float16 gradients overflow at first, so steps are skipped before the scale fits
    return DynamicLossScaler(init_scale=2.0 ** 28, backoff_factor=2.0 ** -4) if precision == "fp16" else None


def train_mixed_serial(precision, steps):
    """One process, ``MixedPrecision`` on the global batch: (float32 masters, skipped steps, scale)."""
    from hpcpar.optim import MixedPrecision

    model = low_model(precision)
    amp = MixedPrecision(model, fp16_scaler(precision))
    opt = AdamW(amp.named_master_parameters(), **ADAMW[1], no_decay=NO_DECAY)
    for step in range(steps):
        loss = model.loss(*global_batch(step))
        amp.backward(loss)
        amp.step(opt, loss=loss)
    return {name: m.data.copy() for name, m in amp.named_master_parameters()}, amp.skipped_steps, amp.scale


def mixed_ps(precision, ctx, servers, staleness=0, scaler=None):
    model = low_model(precision)
    ps = ParameterServer(model.named_parameters(), ctx, AdamW, servers=servers, staleness=staleness,
                         master_dtype=np.float32, scaler=scaler, **ADAMW[1], no_decay=NO_DECAY)
    return model, ps


def server_masters(ps, model) -> dict:
    """Every server's float32 range, gathered on the workers' side as whole tensors (collective)."""
    pieces = ps.comm.allgather_object(None if ps.is_worker else ps.checkpoint_pieces()[0])
    whole = {name: np.zeros(p.shape, np.float32) for name, p in model.named_parameters()}
    for piece in (piece for mine in pieces if mine for piece in mine if piece.key.startswith("model/")):
        whole[piece.key[len("model/"):]][tuple(slice(a, b) for a, b in piece.slab)] = piece.array
    return whole


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_mixed_precision_ps_with_one_worker_is_one_process_bitwise(precision):
    """One worker and every other rank a server: the servers' float32 masters, the worker's 16-bit
    parameters, the skipped steps and the loss scale are exactly those of ``MixedPrecision`` in
    one process (unscaling, the float32 AdamW with decay groups along the ranges, the cast back)."""
    steps = 6
    ctx = hpcpar.init(device="cpu")
    model, ps = mixed_ps(precision, ctx, servers=ctx.world_size - 1, scaler=fp16_scaler(precision))
    ps.serve()
    taken = []
    if ps.is_worker:
        for step in range(steps):
            loss = model.loss(*global_batch(step))
            ps.backward(loss)
            taken.append(ps.push_pull(loss.item()).taken)
    ps.shutdown()
    masters = server_masters(ps, model)
    expected, skipped, scale = train_mixed_serial(precision, steps)
    for name in expected:
        np.testing.assert_array_equal(masters[name], expected[name], err_msg=name)
    if ps.is_worker:
        assert taken.count(False) == ps.skipped_steps == skipped and ps.metrics() == {"skipped_steps": skipped}
        assert (skipped > 0) == (precision == "fp16")  # the large initial scale overflowed float16
        assert ps.scaler is None if precision == "bf16" else ps.scaler.scale == scale
        for name, param in model.named_parameters():
            assert param.dtype == low_dtype(precision)
            np.testing.assert_array_equal(param.data, expected[name].astype(param.dtype), err_msg=name)
        numel = sum(p.size for p in model.parameters())  # pushes in float32, replies in 16 bits
        assert ps.comm.stats.bytes("isend") == (steps + 1) * ps.num_servers * 32 + steps * numel * 4
    else:
        assert ps.shard.dtype == np.float32 and ps.version == steps - skipped


def poison(model, loss_value, rank, step, at):
    """A NaN gradient on world rank ``at[0]`` at step ``at[1]`` (an overflow there, nowhere else)."""
    if (rank, step) == at:
        next(iter(model.parameters())).grad[...] = np.nan
    return loss_value


@pytest.mark.mpi(min_size=3)
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_synchronous_mixed_ps_skips_the_round_everywhere_when_one_worker_overflows(precision):
    steps, bad = 4, (1, 2)  # worker 1's gradient at step 2
    ctx = hpcpar.init(device="cpu")
    from hpcpar.optim import DynamicLossScaler

    model, ps = mixed_ps(precision, ctx, servers=1, scaler=DynamicLossScaler(256.0) if precision == "fp16" else None)
    ps.serve()
    taken, before = [], []
    if ps.is_worker:
        rng = np.random.default_rng([3, ctx.rank])
        for step in range(steps):
            before.append(parameters(model))
            loss = model.loss(*pattern_batch(rng, 2))
            ps.backward(loss)
            taken.append(ps.push_pull(poison(model, loss.item(), ctx.rank, step, bad)).taken)
    ps.shutdown()
    if ps.is_worker:
        assert taken == [True, True, False, True] and ps.skipped_steps == 1  # on every worker
        assert max_difference(parameters(model), before[-1]) > 0
        after_skip = ps.ctx.dp.allgather_object(before[3])
        assert max_difference(before[3], before[2]) == 0  # the skipped round changed nothing
        assert all(max_difference(before[3], other) == 0 for other in after_skip)
        if precision == "fp16":
            scales = ps.ctx.dp.allgather_object(ps.scaler.scale)
            assert scales == [128.0] * ps.num_workers  # backed off once, on every worker alike
    else:
        assert ps.version == steps - 1
        assert {r.step for r in ps.update_log} == {0, 1, 3}


@pytest.mark.mpi(min_size=3)
def test_asynchronous_mixed_ps_drops_the_overflowing_push_only():
    steps, bad = 4, (1, 2)
    ctx = hpcpar.init(device="cpu")
    model, ps = mixed_ps("bf16", ctx, servers=1, staleness=1)
    ps.serve()
    taken = []
    if ps.is_worker:
        rng = np.random.default_rng([4, ctx.rank])
        for step in range(steps):
            loss = model.loss(*pattern_batch(rng, 2))
            ps.backward(loss)
            taken.append(ps.push_pull(poison(model, loss.item(), ctx.rank, step, bad)).taken)
    ps.shutdown()
    if ps.is_worker:
        assert taken == [(ctx.rank, step) != bad for step in range(steps)]
        assert all(np.isfinite(p.data.astype(np.float32)).all() for p in model.parameters())
    else:
        applied = {(r.worker, r.step) for r in ps.update_log}
        assert applied == {(w, s) for w in range(ps.num_workers) for s in range(steps)} - {bad}
        assert ps.version == steps * ps.num_workers - 1


@pytest.mark.mpi(min_size=2)
def test_mixed_ps_nan_loss_is_not_applied_whatever_the_gradients():
    ctx = hpcpar.init(device="cpu")
    model, ps = mixed_ps("bf16", ctx, servers=1)
    ps.serve()
    if ps.is_worker:
        before = parameters(model)
        loss = model.loss(*global_batch(0))
        ps.backward(loss)
        assert ps.push_pull(float("nan")).taken is False  # finite gradients, NaN loss
        assert max_difference(parameters(model), before) == 0
    ps.shutdown()
    if not ps.is_worker:
        assert ps.version == 0 and ps.update_log == []


def test_a_loss_scaler_needs_masters():
    ctx = hpcpar.runtime.single_process()
    from hpcpar.optim import DynamicLossScaler

    with pytest.raises(ValueError, match="a loss scaler needs master_dtype"):
        ParameterServer(make_model().named_parameters(), ctx, AdamW, servers=1, scaler=DynamicLossScaler())


# ----------------------------------------------------------------------------------------
# local SGD
# ----------------------------------------------------------------------------------------
@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("optimizer, average_state", [(SGD_PLAIN, False), (SGD_MOMENTUM, True)],
                         ids=["sgd", "sgd-momentum-state-averaged"])
def test_local_sgd_with_one_local_step_equals_data_parallel(optimizer, average_state):
    if GLOBAL_BATCH % world_size():
        pytest.skip(f"the global batch {GLOBAL_BATCH} does not split over {world_size()} ranks")
    ctx = hpcpar.init(device="cpu")
    optimizer_class, options = optimizer
    model = make_model()
    local = LocalSGD(model, ctx, optimizer_class(model.named_parameters(), **options), local_steps=1,
                     average_optimizer_state=average_state)
    ctx.reset_stats()
    for step in range(STEPS):
        model.loss(*local_batch(step, ctx)).backward()
        local.step()
    local.shutdown()
    assert local.averages == STEPS and ctx.dp.stats.calls("allreduce") == STEPS
    reference = train_ddp(ctx, optimizer)
    assert max_difference(parameters(model), reference) <= 1e-10
    assert max_difference(reference, train_serial(optimizer)) <= 1e-10


@pytest.mark.mpi(min_size=2)
def test_local_sgd_with_adamw_is_not_data_parallel():
    """The stated condition is real: AdamW's update is not linear in the gradient."""
    if GLOBAL_BATCH % world_size():
        pytest.skip(f"the global batch {GLOBAL_BATCH} does not split over {world_size()} ranks")
    ctx = hpcpar.init(device="cpu")
    model = make_model()
    local = LocalSGD(model, ctx, AdamW(model.named_parameters(), **ADAMW[1]), local_steps=1,
                     average_optimizer_state=True)
    for step in range(STEPS):
        model.loss(*local_batch(step, ctx)).backward()
        local.step()
    assert max_difference(parameters(model), train_serial(ADAMW)) > 1e-6


@pytest.mark.mpi(min_size=2)
def test_local_sgd_averages_every_h_steps_and_at_shutdown():
    ctx = hpcpar.init(device="cpu")
    model = make_model()
    optimizer = AdamW(model.named_parameters(), lr=1e-2)
    local = LocalSGD(model, ctx, optimizer, local_steps=3, average_optimizer_state=True)
    numel = sum(p.size for p in model.parameters())
    ctx.reset_stats()
    rng = np.random.default_rng([7, ctx.rank])
    for step in range(7):
        model.loss(*pattern_batch(rng, 2)).backward()
        local.step()
        diverged = max_difference(parameters(model), ctx.dp.allgather_object(parameters(model))[0]) > 0
        assert diverged == (ctx.dp_rank != 0 and (step + 1) % 3 != 0)  # equal right after each average
    assert local.averages == 2 and local.steps_since_average == 1
    local.shutdown()
    assert local.averages == 3
    # one all-reduce per average: the parameters and Adam's two moments, float64
    assert ctx.dp.stats.calls("allreduce") == 3 and ctx.dp.stats.bytes("allreduce") == 3 * 3 * numel * 8
    final = parameters(model)
    assert all(max_difference(final, other) == 0 for other in ctx.dp.allgather_object(final))
    moments = {name: s["exp_avg"] for name, s in optimizer.state.items()}
    assert all(max_difference(moments, other) == 0 for other in ctx.dp.allgather_object(moments))


# ----------------------------------------------------------------------------------------
# the uniform Strategy interface
# ----------------------------------------------------------------------------------------
@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("mode", ["allreduce", "ps", "local_sgd"])
def test_every_strategy_equals_one_process(mode):
    ctx = hpcpar.init(device="cpu")
    workers = ctx.world_size - 1 if mode == "ps" else ctx.world_size
    if GLOBAL_BATCH % workers:
        pytest.skip(f"the global batch {GLOBAL_BATCH} does not split over {workers} workers")
    model = make_model()
    keys = [f"parallel.mode={mode}", "optimizer.name=sgd", "optimizer.lr=0.1"]
    strategy = make_strategy(load_job(None, keys + (["parallel.local_steps=1"] if mode == "local_sgd" else [])),
                             ctx, model, data=None)
    assert strategy.trains == (mode != "ps" or ctx.rank < workers)
    if not strategy.trains:
        assert strategy.ctx is None
        strategy.serve(save_step=None)
        return
    assert strategy.ctx.dp_size == workers and strategy.optimizer.lr == 0.1
    for step in range(STEPS):
        loss = strategy.train_step(*local_batch(step, strategy.ctx))
        strategy.finish_step(0.0, loss)
        assert all(p.grad is None for p in model.parameters())
    strategy.shutdown()
    assert max_difference(parameters(model), train_serial(SGD_PLAIN)) <= 1e-10
