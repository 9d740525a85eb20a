"""The shared-memory, hierarchical collectives (hpcpar.runtime.shm) give MPI's answer, bit for bit.

MPI tests run at the launcher's size (2 and 4 in `make test`), on real nodes and on pretend
nodes of 2 ranks (HPCPAR_NODE_SIZE; 2 nodes x 2 at 4 ranks: the inter-node step). Test
models are tiny, so contexts here send every size through the path (``min_bytes = 0``).
"""
import itertools
import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest
from mpi4py import MPI

import hpcpar
from conftest import REPO, venv_bin
from dp_reference import GLOBAL_BATCH, global_batch, max_difference, train_single_process
from hpcpar.runtime import nodes, shm as shm_module, shm_kernel
from hpcpar.runtime.shm import MIN_BYTES, shared_zeros
from hpcpar.runtime.shm_reduce import combine, reduce_into, reference, slices, temporaries
from hpcpar.native import library_path
from hpcpar.nn.gpt import GPT, GPTConfig
from test_data_parallel import STEPS, train_data_parallel

MPI_OPS = {"sum": MPI.SUM, "mean": MPI.SUM, "max": MPI.MAX, "min": MPI.MIN}


@pytest.fixture(scope="module")
def reference_run():
    return train_single_process(STEPS)


def mpich_tree(values):
    """MPICH's recursive-doubling order, written out: pairs of the first 2(n - p), then a tree."""
    pof2 = 1 << (len(values).bit_length() - 1)
    rem = len(values) - pof2
    level = [values[2 * i] + values[2 * i + 1] for i in range(rem)] + list(values[2 * rem:])
    while len(level) > 1:
        level = [level[2 * i] + level[2 * i + 1] for i in range(len(level) // 2)]
    return level[0]


def wide_random(seed, count, dtype):
    """Values over many magnitudes, so that any change of the summation order changes bits."""
    rng = np.random.default_rng(seed)
    return (rng.standard_normal(count) * 10.0 ** rng.uniform(-4, 4, count)).astype(dtype)


# ----- serial: the arithmetic -------------------------------------------------------------
@pytest.mark.parametrize("n", range(1, 10))
def test_the_sum_order_is_mpichs_tree_wherever_the_result_is_written(n):
    values = [wide_random([n, i], 1000, np.float64) for i in range(n)]
    expected = mpich_tree(values)
    assert np.array_equal(reference(values), expected)
    for own in range(n):  # the result written over any one of the sources (a rank's own buffer)
        sources = [v.copy() for v in values]
        combine(sources, sources[own], np.add, temporaries(n, 1000, np.float64))
        assert np.array_equal(sources[own], expected)
        assert all(np.array_equal(s, v) for i, (s, v) in enumerate(zip(sources, values)) if i != own)


def operands(n, count, dtype):
    if np.dtype(dtype).kind == "f":
        return [wide_random([n, i], count, dtype) for i in range(n)]
    info = np.iinfo(dtype)  # near the ends of the range: sums wrap around, as NumPy's do
    return [np.random.default_rng([n, i]).integers(info.min // 2, info.max // 2, count, dtype=dtype) * 3
            for i in range(n)]


SHM_LIBRARY = library_path().parent / shm_kernel.LIB_NAME
needs_native = pytest.mark.skipif(not SHM_LIBRARY.exists(), reason=f"{SHM_LIBRARY} not built: make native")


@needs_native
def test_the_native_loop_is_used_where_it_is_built():
    assert shm_kernel.available(), f"{SHM_LIBRARY} is built but failed its check against NumPy"


@pytest.mark.parametrize("loop", ["numpy", pytest.param("native", marks=needs_native)])
@pytest.mark.parametrize("n", range(1, 10))
@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.int32, np.int64])
def test_the_loops_write_the_documented_sum_into_every_target(loop, n, dtype):
    count = 3 * 4096 + 7  # whole blocks of the native loop and a tail; chunks of NumPy's below
    values = operands(n, count, dtype)
    means = [False, True] if np.dtype(dtype).kind == "f" else [False]
    layouts = {  # which buffers get the result
        "every source (one node)": lambda sources, own: sources,
        "the own source (an inter-node step follows)": lambda sources, own: [sources[own]],
        "the own source and another array": lambda sources, own: [sources[own], np.empty_like(sources[own])],
    }
    for mean, own, layout in itertools.product(means, range(n), layouts.values()):
        expected = reference(values)
        if mean:
            expected /= n
        sources = [v.copy() for v in values]
        targets = layout(sources, own)
        divisor = n if mean else 0
        if loop == "native":
            assert shm_kernel.reduce_into(sources, targets, "mean" if mean else "sum", divisor)
        else:
            reduce_into(sources, targets, np.add, divisor, chunk=1000)
        assert all(np.array_equal(t, expected) for t in targets)
        untouched = [i for i, s in enumerate(sources) if not any(s is t for t in targets)]
        assert all(np.array_equal(sources[i], values[i]) for i in untouched)


@needs_native
def test_the_native_loop_leaves_what_it_does_not_do_to_numpy():
    x = [np.ones(100, np.int32)] * 2
    assert not shm_kernel.reduce_into(x, x, "max", 0) and not shm_kernel.reduce_into(x, x, "mean", 2)
    half = [np.ones(100, np.float16)] * 2
    assert not shm_kernel.reduce_into(half, half, "sum", 0)


@pytest.mark.parametrize("count, parts, itemsize", [(1000, 3, 4), (5, 4, 8), (1 << 20, 4, 4), (17, 1, 8)])
def test_slices_cover_the_buffer_on_cache_lines(count, parts, itemsize):
    ranges = slices(count, parts, itemsize)
    assert ranges[0][0] == 0 and ranges[-1][1] == count
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
    assert all(lo * itemsize % 64 == 0 for lo, _ in ranges if lo < count)


def test_settings_from_the_environment(monkeypatch):
    monkeypatch.setenv("HPCPAR_NODE_SIZE", "2")
    assert nodes.node_size_setting() == 2 and nodes.node_size_setting(4) == 4
    for bad in ("0", "two"):
        monkeypatch.setenv("HPCPAR_NODE_SIZE", bad)
        with pytest.raises(ValueError, match="HPCPAR_NODE_SIZE|node size"):
            nodes.node_size_setting()
    monkeypatch.setenv("HPCPAR_SHM", "1")
    assert shm_module.shm_setting() is True and shm_module.shm_setting(False) is False
    monkeypatch.setenv("HPCPAR_SHM", "yes")
    with pytest.raises(ValueError, match="HPCPAR_SHM must be 0 or 1"):
        shm_module.shm_setting()


def test_one_rank_has_nothing_to_share():
    ctx = hpcpar.init(shm=True, comm=MPI.COMM_SELF)
    assert ctx.shm and all(c.shm is None for c in ctx.communicators().values())
    x = wide_random(0, 100_000, np.float64)
    assert np.array_equal(ctx.world.allreduce(x), x)


# ----- MPI: the collectives against MPI ------------------------------------------------------
def shm_context(world, node_size=None, **kwargs):
    if node_size is not None and (world.Get_size() % node_size or world.Get_size() == node_size):
        pytest.skip(f"pretend nodes of {node_size} need a multiple of {node_size} ranks above it")
    ctx = hpcpar.init(shm=True, node_size=node_size, device="cpu", **kwargs)
    for comm in ctx.communicators().values():
        if comm.shm is not None:
            comm.shm.min_bytes = 0  # tiny test models: every size through the path
    return ctx


def mpi_result(comm, x, op):
    expected = x.copy()
    comm.mpi.Allreduce(MPI.IN_PLACE, expected, MPI_OPS[op])
    return expected / comm.size if op == "mean" else expected


def documented_result(comm, x, op):
    gathered = comm.mpi.allgather(x)
    if op in ("max", "min"):
        return getattr(np, op)(np.stack(gathered), axis=0)
    total = reference(gathered)
    return total / comm.size if op == "mean" else total


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("node_size", [None, 2], ids=["real nodes", "nodes of 2"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("op", ["sum", "mean", "max", "min"])
def test_allreduce_equals_mpi_bitwise(world, node_size, dtype, op):
    ctx = shm_context(world, node_size)
    comm = ctx.world
    assert comm.shm.describe() == "on (not used yet)"
    for count in (1, 13, 4096 + 5, 100_003):
        x = wide_random([comm.rank, count], count, dtype)
        expected = mpi_result(comm, x, op)
        assert np.array_equal(documented_result(comm, x, op), expected)  # MPICH adds in the documented order

        shared = shared_zeros(comm, count, dtype)
        shared[...] = x
        assert comm.allreduce(shared, op, out=shared) is shared  # reduced where it lies
        assert np.array_equal(shared, expected)
        assert np.array_equal(comm.allreduce(x, op), expected)  # a plain array: copied in and out
        shared[...] = x
        assert comm.iallreduce(shared, op, out=shared).wait() is shared
        assert np.array_equal(shared, expected)
    taken = comm.shm.stats
    assert (taken.calls("allreduce"), taken.calls("iallreduce")) == (8 + 4, 4)  # the family counts both
    assert comm.shm.nodes == (world.Get_size() // node_size if node_size else 1)


@pytest.mark.mpi(min_size=2)
def test_calls_under_min_bytes_and_one_rank_nodes_go_to_mpi(world):
    ctx = hpcpar.init(shm=True)
    x = wide_random(world.Get_rank(), MIN_BYTES // 8 - 1, np.float64)
    assert np.array_equal(ctx.world.allreduce(x), mpi_result(ctx.world, x, "sum"))
    assert ctx.world.shm.stats.calls("allreduce") == 0 and ctx.world.shm.usable is None  # not even set up
    single = hpcpar.init(shm=True, node_size=1)  # every rank its own node: nothing shared
    y = wide_random(world.Get_rank(), MIN_BYTES // 8 + 1, np.float64)
    assert np.array_equal(single.world.allreduce(y), mpi_result(single.world, y, "sum"))
    assert single.world.shm.usable is False and single.world.shm.stats.calls("allreduce") == 0


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("node_size", [None, 2], ids=["real nodes", "nodes of 2"])
def test_many_in_flight_complete_in_any_order(world, node_size):
    comm = shm_context(world, node_size).world
    buffers, expected = [], []
    for i in range(5):
        buffer = shared_zeros(comm, 1000 * (i + 1), np.float64)
        buffer[...] = wide_random([comm.rank, i], buffer.size, np.float64)
        expected.append(mpi_result(comm, buffer, "sum"))
        buffers.append(buffer)
    handles = [comm.iallreduce(b, out=b) for b in buffers]
    assert handles[2].test() in (True, False)  # progress on any handle moves the oldest first
    for handle, buffer, want in reversed(list(zip(handles, buffers, expected))):
        assert handle.wait() is buffer and np.array_equal(buffer, want)


@pytest.mark.mpi(min_size=2)
def test_a_buffer_passed_by_some_ranks_only_is_an_error_on_every_rank(world):
    comm = shm_context(world).world
    shared = shared_zeros(comm, 1000, np.float64)
    comm.allreduce(np.zeros(1000))  # the scratch buffer exists: copying in makes no window now
    mine = shared if comm.rank == 0 else np.zeros(1000)
    with pytest.raises(RuntimeError, match="the node's ranks passed different buffers"):
        comm.allreduce(mine, out=mine)


@pytest.mark.mpi(min_size=2)
def test_dropped_buffers_are_freed_together(world):
    comm = shm_context(world).world
    for _ in range(30):
        shared_zeros(comm, 1000, np.float32)  # dropped at once
    kept = shared_zeros(comm, 1000, np.float32)
    assert len(comm.shm.windows.segments) <= 3  # control words, the last dropped one, the kept one
    kept[...] = 1
    assert np.array_equal(comm.allreduce(kept, out=kept), np.full(1000, world.Get_size(), np.float32))
    for count in range(1000, 1040):  # plain arrays of many sizes through the scratch buffer
        assert np.array_equal(comm.allreduce(np.ones(count, np.float32)), np.full(count, world.Get_size(), np.float32))
    assert all(len(segment.plans) <= shm_module._PLANS_KEPT for segment in comm.shm.windows.segments.values())


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("policy", ["spin", "yield"])
@pytest.mark.parametrize("stall_s", ["0", "60"], ids=["no watchdog", "watchdog"])
def test_every_wait_policy_with_and_without_the_watchdog(world, monkeypatch, policy, stall_s):
    monkeypatch.setenv("HPCPAR_STALL_S", stall_s)
    comm = shm_context(world, wait_policy=policy).world
    assert (comm.watchdog is None) == (stall_s == "0") and comm.wait_policy == policy
    shared = shared_zeros(comm, 5000, np.float64)
    shared[...] = wide_random(comm.rank, 5000, np.float64)
    expected = mpi_result(comm, shared, "sum")
    assert np.array_equal(comm.iallreduce(shared, out=shared).wait(), expected)


# ----- MPI: what lives in the window ---------------------------------------------------------
def needs_even_split(world):
    if GLOBAL_BATCH % world.Get_size():
        pytest.skip(f"the global batch of {GLOBAL_BATCH} does not split over {world.Get_size()} ranks")


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("node_size", [None, 2], ids=["real nodes", "nodes of 2"])
@pytest.mark.parametrize("bucket_mb, overlap", [(25, True), (25, False), (0.001, True)])
def test_ddp_buckets_in_the_window_equal_mpi_bitwise(world, node_size, bucket_mb, overlap):
    needs_even_split(world)
    plain, _, _ = train_data_parallel(hpcpar.init(device="cpu", shm=False), bucket_mb, overlap)
    ctx = shm_context(world, node_size)
    ctx.reset_stats()
    params, _, ddp = train_data_parallel(ctx, bucket_mb, overlap)
    assert max_difference(params, plain) == 0.0
    assert all(ctx.dp.shm.windows.find(b.flat) is not None for b in ddp.buckets)  # no copy in or out
    steps = 3
    assert ctx.dp.stats.calls("iallreduce") == ctx.dp.shm.stats.calls("iallreduce") == steps * len(ddp.buckets)
    assert ctx.dp.stats.bytes("iallreduce") == steps * sum(b.nbytes for b in ddp.buckets)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_reduce_scatter_and_allgather_of_shared_buffers(world, dtype):
    comm = shm_context(world).world
    shared = shared_zeros(comm, comm.size * 20_001, dtype)
    shared[...] = wide_random(comm.rank, shared.size, dtype)
    blocks = [x.reshape(comm.size, -1)[comm.rank] for x in comm.mpi.allgather(shared.copy())]
    mine = comm.reduce_scatter(shared.reshape(comm.size, -1), "mean")
    # The all-reduce's order, not MPICH's reduce-scatter's (which depends on the size and the rank).
    assert np.array_equal(mine[0], reference(blocks) / comm.size)
    expected = np.empty_like(mine[0])
    comm.mpi.Reduce_scatter_block(shared, expected, MPI.SUM)
    rounding = comm.size * np.finfo(dtype).eps * max(np.abs(b).max() for b in blocks)  # any order's error bound
    np.testing.assert_allclose(mine[0], expected / comm.size, rtol=0, atol=rounding)
    gathered = shared_zeros(comm, shared.size, dtype)
    assert comm.allgather(mine[0], out=gathered) is gathered
    assert np.array_equal(gathered.reshape(comm.size, -1), np.stack(comm.mpi.allgather(mine[0])))
    assert (comm.shm.stats.calls("reduce_scatter"), comm.shm.stats.calls("allgather")) == (1, 1)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("node_size", [None, 2], ids=["real nodes", "nodes of 2"])
def test_zero_flat_buffers_in_the_window(world, node_size, reference_run):
    needs_even_split(world)
    plain, _, _ = train_data_parallel(hpcpar.init(device="cpu", shm=False), zero=True)
    ctx = shm_context(world, node_size)
    params, _, _ = train_data_parallel(ctx, zero=True)
    assert max_difference(params, reference_run[0]) <= 1e-10  # equal to one process
    if world.Get_size() == 2:  # two operands: one order; beyond, MPICH's reduce-scatter order differs
        assert max_difference(params, plain) == 0.0
    taken = ctx.dp.shm.stats
    one_node = ctx.dp.shm.nodes == 1  # across nodes, reduce-scatter and all-gather stay with MPI
    assert taken.calls("reduce_scatter") == taken.calls("allgather") == (3 if one_node else 0)
    assert ctx.dp.stats.calls("reduce_scatter") == ctx.dp.stats.calls("allgather") == 3


@pytest.mark.mpi(min_size=2)
def test_tensor_parallel_activations_take_the_path(world):
    config = GPTConfig(vocab_size=16, block_size=8, n_layer=2, n_head=4, n_embd=16, seed=11)
    ids, targets = global_batch(0)
    grads = []
    if world.Get_size() % 2:
        pytest.skip("tp = 2 needs an even number of ranks")
    tp = 2
    for ctx in (hpcpar.init(tp=tp, device="cpu", shm=False), shm_context(world, tp=tp)):
        model = GPT(config, tp=ctx.tp, dtype=np.float64)
        model.loss(ids, targets).backward()
        grads.append({name: p.grad.copy() for name, p in model.named_parameters()})
    assert max_difference(grads[0], grads[1]) == 0.0
    assert ctx.tp.shm.stats.calls("allreduce") == ctx.tp.stats.calls("allreduce") > 0


# ----- the watchdog names a peer that does not come ------------------------------------------
STALL_SCRIPT = """
import time
import numpy as np
import hpcpar
from hpcpar.runtime import fail_fast
from hpcpar.runtime.shm import shared_zeros

with fail_fast():
    ctx = hpcpar.init(shm=True, wait_policy="yield")
    buffer = shared_zeros(ctx.world, 1 << 16, np.float64)  # collective: the window is made
    buffer[...] = 1
    if ctx.rank == 1:
        time.sleep(4)
    ctx.world.allreduce(buffer, out=buffer)
    assert ctx.world.shm.stats.calls("allreduce") == 1 and buffer[0] == 2
    print(f"rank {ctx.rank} done", flush=True)
"""


def test_a_stalled_peer_is_reported_like_in_any_collective(tmp_path):
    script = tmp_path / "stall.py"
    script.write_text(STALL_SCRIPT)
    proc = subprocess.run([venv_bin("mpiexec"), "-n", "2", sys.executable, str(script)], capture_output=True,
                          text=True, timeout=90, env={**os.environ, "PYTHONPATH": REPO, "HPCPAR_STALL_S": "1"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert sorted(re.findall(r"rank (\d) done", proc.stdout)) == ["0", "1"]
    reports = [line for line in proc.stderr.splitlines() if line.startswith("hpcpar: stall:")]
    assert reports and all("rank 0 of communicator 'world'" in r for r in reports), proc.stderr
    assert any("in allreduce #" in r and "not arrived: rank 1 (no word" in r for r in reports), reports


# ----- without the native loop -----------------------------------------------------------------
UNBUILT_SCRIPT = """
import numpy as np
from mpi4py import MPI
import hpcpar
from hpcpar.runtime import fail_fast, shm_kernel
from hpcpar.runtime.shm import shared_zeros

with fail_fast():
    assert not shm_kernel.available()
    for node_size in (None, 2):  # one node of 4 (the tree of 4), two nodes of 2 (the inter-node step)
        comm = hpcpar.init(shm=True, node_size=node_size, device="cpu").world
        comm.shm.min_bytes = 0
        for dtype in (np.float32, np.float64):
            shared = shared_zeros(comm, 100_003, dtype)
            for op in ("sum", "mean"):
                rng = np.random.default_rng([comm.rank, len(op)])
                shared[...] = (rng.standard_normal(shared.size) * 10.0 ** rng.uniform(-4, 4, shared.size)).astype(dtype)
                expected = shared.copy()
                comm.mpi.Allreduce(MPI.IN_PLACE, expected, MPI.SUM)
                if op == "mean":
                    expected /= comm.size
                assert np.array_equal(comm.allreduce(shared, op, out=shared), expected), (node_size, dtype, op)
        assert comm.shm.stats.calls("allreduce") == 4 and comm.shm.nodes == (2 if node_size else 1)
    print(f"rank {comm.rank} equal", flush=True)
"""


def test_numpys_loop_equals_mpi_bitwise_where_the_native_one_is_not_built(tmp_path):
    """In processes of their own: 4 ranks, on one node and on two pretend ones (a context of the
    MPI suite would take MPI communicator ids, of which the suite at 4 ranks has few left)."""
    script = tmp_path / "unbuilt.py"
    script.write_text(UNBUILT_SCRIPT)
    nowhere = tmp_path / "no-build" / "libhpcpar_native.so"  # where hpcpar looks for build/ outputs
    proc = subprocess.run([venv_bin("mpiexec"), "-n", "4", sys.executable, str(script)], capture_output=True,
                          text=True, timeout=120, env={**os.environ, "PYTHONPATH": REPO, "HPCPAR_NATIVE_LIB": str(nowhere)})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert sorted(re.findall(r"rank (\d) equal", proc.stdout)) == ["0", "1", "2", "3"], proc.stdout


# ----- the job keys ------------------------------------------------------------------------------
def test_job_keys_switch_the_path_and_its_nodes(tmp_path, token_file):
    """parallel.shm and parallel.node_size reach init: the run says so, and DDP's losses are MPI's, bit for bit."""
    losses, lines = {}, {}
    for name, keys in {"mpi": ["parallel.shm=false"], "2x2": ["parallel.node_size=2"]}.items():
        folder = tmp_path / name
        proc = subprocess.run(
            [venv_bin("mpiexec"), "-n", "4", sys.executable, "-m", "hpcpar", "train", f"{REPO}/jobs/gpt-dp.toml",
             "--set", f'data.path="{token_file}"', "--set", f'checkpoint.dir="{folder}/ckpt"',
             "--set", f'train.metrics="{folder}/metrics.jsonl"', "--set", "model.n_layer=1", "--set", "model.n_embd=64",
             "--set", "train.precision=\"fp64\"", "--set", "train.steps=3", "--set", "train.log_interval=1",
             "--set", "train.eval_interval=0", "--set", "train.sample_tokens=0", "--set", "checkpoint.interval=0",
             *[arg for key in keys for arg in ("--set", key)]],
            capture_output=True, text=True, timeout=240, env={**os.environ, "OPENBLAS_NUM_THREADS": "1"})
        assert proc.returncode == 0, proc.stdout + proc.stderr
        lines[name] = next(line for line in proc.stdout.splitlines() if line.startswith("shared-memory collectives"))
        losses[name] = [json.loads(line)["loss"] for line in open(folder / "metrics.jsonl") if '"loss"' in line]
    assert lines["mpi"].startswith("shared-memory collectives: off")
    assert lines["2x2"].startswith("shared-memory collectives: on (pretend nodes of 2 ranks")
    assert len(losses["mpi"]) == 3 and losses["2x2"] == losses["mpi"]
