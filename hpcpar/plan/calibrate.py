"""``hpcpar plan calibrate``: measure this machine and write a machine file (under 2 minutes).

    mpiexec -n 4 hpcpar plan calibrate --out machine.toml

Rank 0 times hpcpar's own autograd ops, forward and backward, at a few sizes while the other
ranks wait without spinning: matrix products (``gemm``), attention (its products and its
softmax apart; convolutions, their products apart from their im2col copies), and each
elementwise family the model counts (``model.PASSES``); a rate per family is the least-squares
fit of time = ops x op overhead + units / rate, units being what ``model`` counts for that op
(FLOPs, or bytes moved). Then the calibration GPT and three variants of it fit the costs whole
models add to their ops (``fit_model``), its step k ranks at a time gives ``concurrency``, and
every group size 2..N times the collectives the engines call, on the same paths, fitting latency
+ wire bytes / bandwidth per collective and group size; on several nodes the inter-node link too
(else ``--inter FILE``, or the intra-node one). docs/planner.md, "Machine files": the details.
"""
from __future__ import annotations

import os
import statistics
import time

import numpy as np

from ..runtime.waiting import wait_idle
from .machine import Compute, Link, Machine, format_machine, load_machine
from .model import conv_runs, passes, pool_rows

SIZES_S = 0.25  # target seconds per op family


def _timed(fn, repeats: int = 5) -> float:
    fn()  # warm-up: allocations, caches
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _fit_rate(samples, overhead: float) -> float:
    """Rate R of time = ops * overhead + units / R over (ops, units, seconds) samples (least squares)."""
    num = sum(u * u for _, u, _ in samples)
    den = sum(u * max(t - ops * overhead, 1e-9) for ops, u, t in samples)
    return num / den


def _fwd_bwd(make):
    """A function running forward and backward of the graph ``make()`` builds (its output summed)."""
    from ..autograd import Tensor

    def run():
        out = make()
        out.backward(np.ones(out.shape, dtype=out.data.dtype) if isinstance(out, Tensor) else None)
    return run


# (batch, heads, context, head size) attention is timed at: contexts 16-256 and head sizes 16-64,
# fitted by relative error (absolute error on three shapes leaves context 64 1.2-1.5x under).
ATTENTION_SHAPES = ((4, 4, 64, 16), (2, 4, 256, 16), (2, 4, 128, 64), (16, 4, 32, 16), (8, 8, 64, 32),
                    (4, 4, 128, 32), (32, 4, 16, 16))


def measure_ops(dtype=np.float32) -> Compute:
    """Rates of every op family on one rank (its share of the cores), in ``dtype``."""
    from ..autograd import Tensor, ops

    d = np.dtype(dtype).itemsize
    rng = np.random.default_rng(0)
    t = lambda *shape: Tensor(rng.standard_normal(shape).astype(dtype), requires_grad=True)  # noqa: E731
    tiny = t(4)
    overhead = _timed(_fwd_bwd(lambda: ops.add(tiny, tiny)), 50) / 2  # one op forward, one backward
    gemm = []
    for n, k, m in ((256, 64, 256), (1024, 128, 512), (2048, 256, 1024)):
        x, w = t(n, k), t(k, m)
        gemm.append((2, 6 * n * k * m, _timed(_fwd_bwd(lambda: ops.linear(x, w)))))
    gemm_rate = _fit_rate(gemm, overhead)
    attention = []
    for b, heads, steps, hs in ATTENTION_SHAPES:
        q, k, v = t(b, heads, steps, hs), t(b, heads, steps, hs), t(b, heads, steps, hs)
        scores = b * heads * steps * steps
        seconds = _timed(_fwd_bwd(lambda: ops.attention(q, k, v)))
        attention.append((12 * scores * hs, passes("softmax", scores, 4) + passes("softmax", scores, 4, True),
                          seconds - 2 * overhead))
    attention_rate, softmax_rate = _fit_rates(attention, relative=True)
    families = {"softmax": softmax_rate}
    for family, op, shape in (("layernorm", lambda x: ops.layer_norm(x, None, None), (64, 256)),
                              ("gelu", ops.gelu, (64, 256)), ("copy", lambda x: ops.add(x, x), (64, 256)),
                              ("cross_entropy", None, (256, 256)), ("optimizer", None, (64, 256))):
        samples = []
        for scale in (4, 16, 64):
            shape2 = (shape[0] * scale, shape[1])
            seconds, ops_count = _family_seconds(family, op, shape2, t, dtype)
            n, width = shape2[0] * shape2[1], 4 if family in ("cross_entropy", "optimizer") else d
            samples.append((ops_count, passes(family, n, width) + passes(family, n, width, True), seconds))
        families[family] = _fit_rate(samples, overhead)
    families["embedding"] = families["copy"]
    bandwidth = families["copy"]
    families["im2col"], families["strided_runs"], conv_rate = _fit_rates(_conv_samples(t, overhead, families["copy"], d))
    families["pool"], families["pool_rows"] = _fit_rates(_pool_samples(t, overhead, d))
    return Compute(gemm_flops=gemm_rate, attention_flops=attention_rate, conv_flops=conv_rate, bandwidth=bandwidth,
                   op_overhead_s=overhead, family_bandwidth=families)


def _conv_samples(tensor, overhead: float, copy_rate: float, d: int) -> list:
    """(im2col bytes, strided runs, FLOPs, seconds less the op overhead and the output/input
    copies) of a 3 x 3 convolution forward and backward, at shapes whose FLOPs per column (Cout
    4..64) and image sides (2..16: the length of the runs im2col and its fold copy) differ."""
    from ..autograd import ops

    samples = []
    for n, c, side, c_out in ((16, 32, 16, 64), (64, 32, 8, 64), (256, 32, 4, 64), (1024, 32, 2, 64),
                              (64, 8, 16, 16), (1024, 8, 4, 16), (512, 2, 8, 4)):
        x, w = tensor(n, c, side, side), tensor(c_out, c, 3, 3)
        pixels, cols = n * side * side, n * side * side * c * 9
        seconds = _timed(_fwd_bwd(lambda: ops.conv2d(x, w, padding=1)))
        copies = (4 * pixels * c_out + 2 * pixels * c) * d / copy_rate
        samples.append((passes("im2col", cols, d) + passes("im2col", cols, d, True), 2 * conv_runs(n, c, side),
                        3 * 2 * pixels * c * 9 * c_out, seconds - 2 * overhead - copies))
    return samples


def _pool_samples(tensor, overhead: float, d: int) -> list:
    """(bytes, strided rows, seconds less the op overhead) of 2 x 2 max pooling forward and
    backward over the same elements as images of sides 4, 8 and 16 (rows of 2, 4 and 8 outputs)."""
    from ..autograd import ops

    samples = []
    for n, side in ((1024, 4), (256, 8), (64, 16)):
        images = tensor(n, 16, side, side)
        seconds = _timed(_fwd_bwd(lambda: ops.max_pool2d(images, 2)))
        elements = images.data.size
        samples.append((passes("pool", elements, d) + passes("pool", elements, d, True), 2 * pool_rows(n, 16, side),
                        seconds - 2 * overhead))
    return samples


def _family_seconds(family, op, shape, tensor, dtype) -> tuple[float, int]:
    from ..autograd import ops
    from ..optim import AdamW
    from ..autograd import Parameter

    if family == "cross_entropy":
        logits = tensor(*shape)
        targets = np.arange(shape[0]) % shape[1]
        return _timed(_fwd_bwd(lambda: ops.cross_entropy(logits, targets))), 2
    if family == "optimizer":
        param = Parameter(np.zeros(shape[0] * shape[1], dtype=np.float32))
        param.grad = np.ones_like(param.data)
        adam = AdamW([("p", param)], lr=1e-3)
        return _timed(adam.step), 8
    x = tensor(*shape)
    return _timed(_fwd_bwd(lambda: op(x))), 2


def _fit_rates(samples, relative: bool = False) -> tuple:
    """Rates R_i of time = sum_i units_i / R_i over samples (units_1, ..., units_k, seconds), least
    squares; ``relative``: of the relative errors, so that short samples count as much as long ones."""
    a = np.array([sample[:-1] for sample in samples], dtype=np.float64)
    y = np.array([max(sample[-1], 1e-9) for sample in samples])
    if relative:
        a, y = a / y[:, None], np.ones_like(y)
    inverse, *_ = np.linalg.lstsq(a, y, rcond=None)
    inverse = np.maximum(inverse, 1e-15)  # a negative fit (noise) means "free": a huge rate
    return tuple(1.0 / inverse)


# ---------------------------------------------------------------------------------------------
# Collectives
SIZES = (8, 64 << 10, 1 << 20, 4 << 20)  # bytes per call


def _collective_calls(ctx, nbytes: int) -> dict:
    """op -> a function making one call of ``nbytes`` on ``ctx.dp``, on the engines' own paths."""
    from ..runtime.shm import shared_zeros

    comm = ctx.dp
    n = max(comm.size, nbytes // 4 // comm.size * comm.size)
    plain = np.ones(n, dtype=np.float32)
    bucket = shared_zeros(comm, n, np.float32)
    flat = shared_zeros(comm, n, np.float32)
    piece = flat[: n // comm.size].copy()

    def send():
        if comm.rank == 0:
            comm.isend(plain, 1, tag=5).wait()
        elif comm.rank == 1:
            comm.irecv(plain, 0, tag=5).wait()
    return {"allreduce": lambda: comm.allreduce(plain, "sum"),
            "iallreduce": lambda: comm.iallreduce(bucket, "sum", out=bucket).wait(),
            "reduce_scatter": lambda: comm.reduce_scatter(flat, "sum"),
            "allgather": lambda: comm.allgather(piece, out=flat), "send": send}


def measure_collectives(world, sizes=SIZES, repeats: int = 5) -> dict:
    """{(op, ranks): Link} for every group size 2..world size (collective over ``world``)."""
    from mpi4py import MPI

    from ..runtime.stats import ring_wire_bytes
    from ..runtime.context import init

    lines = {}
    for ranks in range(2, world.Get_size() + 1):
        group = world.Split(0 if world.Get_rank() < ranks else MPI.UNDEFINED, world.Get_rank())
        samples: dict = {}
        if group != MPI.COMM_NULL:
            ctx = init(dp=ranks, comm=group)
            for nbytes in sizes:
                for op, call in _collective_calls(ctx, nbytes).items():
                    wire = ring_wire_bytes(op, nbytes, ranks) if op != "send" else nbytes
                    ctx.world.barrier()
                    seconds = _timed(call, repeats)
                    seconds = ctx.world.mpi.allreduce(seconds, op=MPI.MAX)
                    samples.setdefault(op, []).append((wire, seconds))
            ctx.close()
            group.Free()
        wait_idle(world.Ibarrier())
        samples = world.bcast(samples, root=0)
        for op, points in samples.items():
            lines[(op, ranks)] = _fit_link(points)
    return lines


def _fit_link(points) -> Link:
    """latency + wire / bandwidth through (wire bytes, seconds) points (least squares, both >= 0)."""
    a = np.array([[1.0, w] for w, _ in points])
    y = np.array([s for _, s in points])
    (latency, inverse), *_ = np.linalg.lstsq(a, y, rcond=None)
    if inverse <= 0:
        inverse = max(y) / max(w for w, _ in points)
    return Link(latency_s=max(float(latency), float(min(y)) / 2, 1e-7), bandwidth=1.0 / float(inverse))


def node_size(world) -> int:
    """Ranks on world rank 0's node (collective)."""
    from mpi4py import MPI

    node = world.Split_type(MPI.COMM_TYPE_SHARED, key=world.Get_rank())
    size = world.bcast(node.Get_size(), root=0)
    node.Free()
    return size


def measure_inter(world, repeats: int = 5) -> Link | None:
    """The link between the first two nodes (ranks 0 and the lowest rank of node 1), or None on one node."""
    from mpi4py import MPI

    from ..runtime.comm import Communicator
    from ..runtime.topology import discover

    node = world.Split_type(MPI.COMM_TYPE_SHARED, key=world.Get_rank())
    topology = discover(world, node)
    node.Free()
    if topology.nodes < 2:
        return None
    pair = [0, topology.ranks_on(1)[0]]
    sub = world.Split(0 if world.Get_rank() in pair else MPI.UNDEFINED, world.Get_rank())
    points = []
    if sub != MPI.COMM_NULL:
        comm = Communicator(sub, "inter", wait_policy="yield")
        for nbytes in SIZES:
            buf = np.ones(max(1, nbytes // 4), dtype=np.float32)

            def ping():
                if comm.rank == 0:
                    comm.isend(buf, 1, tag=7).wait()
                    comm.irecv(buf, 1, tag=8).wait()
                else:
                    comm.irecv(buf, 0, tag=7).wait()
                    comm.isend(buf, 0, tag=8).wait()
            points.append((buf.nbytes, _timed(ping, repeats) / 2))  # one way
        comm.close()  # only the pair made it: Free is collective over the pair
    return _fit_link(world.bcast(points if world.Get_rank() == 0 else None, root=0))


def measure_concurrency(world, repeats: int = 5, rounds: int = 3) -> list[float]:
    """[1, s2, ..., sN]: how much slower a training step of the calibration GPT runs when k ranks
    of this node run it at once (shared cores, memory bandwidth, caches; more ranks than cores).
    A whole step (its Python, its optimizer) rather than one block: that is what layouts run.
    Alone and together are timed in alternating rounds, and each k's figure is the median of
    its rounds' ratios, so a drift of the machine during calibration cancels."""
    step, ctx = step_runner(calibration_job())
    ratios = [[] for _ in range(world.Get_size())]
    for _ in range(rounds):
        medians = []
        for k in range(1, world.Get_size() + 1):
            wait_idle(world.Ibarrier())
            seconds = _timed(step, repeats) if world.Get_rank() < k else 0.0
            wait_idle(world.Ibarrier())
            medians.append(statistics.median(world.allgather(seconds)[:k]))
        for k, seconds in enumerate(medians):
            ratios[k].append(seconds / medians[0])
    ctx.close()
    return [statistics.median(r) for r in ratios]


def calibrate(world, inter_file: str | None = None, name: str | None = None) -> tuple[Machine, dict]:
    """Measure this machine (collective over ``world``); (the machine, comments for its file) on every rank."""
    from .. import host

    start = time.perf_counter()
    compute = measure_ops() if world.Get_rank() == 0 else None
    if world.Get_rank() == 0:  # the calibration model, while the others wait without spinning
        fit_model(Machine("probe", 256, 1, 1e12, {"fp32": compute}, Link(0, 1e12), Link(0, 1e12)))
    wait_idle(world.Ibarrier())
    compute = world.bcast(compute, root=0)
    concurrency = measure_concurrency(world)
    collectives = measure_collectives(world) if world.Get_size() > 1 else {}
    intra = collectives.get(("allreduce", 2)) or Link(latency_s=1e-6, bandwidth=10e9)
    inter = measure_inter(world)
    per_node = node_size(world) if inter is not None else 256
    # groups of the first k ranks lie on node 0 while k <= its ranks; larger ones crossed nodes
    collectives = {key: link for key, link in collectives.items() if key[1] <= per_node}
    comments = {"cores": "CPUs the ranks may use (affinity and cgroup quota); more ranks run slower by ranks / cores",
                "ranks_per_node": "ranks of node 0 (256 on one node: any number of ranks share it)",
                "memory_gb": "the node's memory, shared by its ranks (memory_shared)",
                "model_factor": "fitted on the calibration GPT (4 layers, width 128) and its variants on one rank (fit_model)",
                "op_overhead_s": "fitted: the cost of one op inside the calibration GPT (fit_model)",
                "micro_batch_overhead_s": "fitted: the fixed cost of one micro-batch of the calibration GPT (fit_model)",
                "concurrency": "measured: the calibration GPT's step with k ranks computing at once / alone, k = 1, 2, ...",
                "overlap": "0: without a progress thread a bucket all-reduce moves only inside MPI calls",
                "intra": "2-rank all-reduce fit; per-op and per-size lines below",
                "collective": "measured: latency + wire bytes / bandwidth"}
    if inter is None and inter_file:
        inter = load_machine(inter_file).inter
        comments["inter"] = f"from {inter_file} (one node here: nothing to measure)"
    elif inter is None:
        inter = intra
        comments["inter"] = "one node here: taken equal to intra (give --inter FILE, e.g. from hpcpar bench net)"
    else:
        comments["inter"] = "measured: point-to-point between node 0 and node 1"
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    machine = Machine(name=name or os.uname().nodename, ranks_per_node=per_node, cores=host.usable_cpus(),
                      memory_bytes=memory, compute={"fp32": compute}, intra=intra, inter=inter, overlap=0.0,
                      collectives=collectives, memory_shared=True, concurrency=concurrency)
    comments["name"] = f"measured by hpcpar plan calibrate on {world.Get_size()} ranks in {time.perf_counter() - start:.0f} s"
    return machine, comments


def write_machine(machine: Machine, comments: dict, path: str) -> None:
    with open(path, "w") as f:
        f.write(f"# {comments.get('name', '')}\n" + format_machine(machine, comments))


# The calibration model: the one model the planner is fitted on (bench/plan_validation.py predicts others).
CALIBRATION_GPT = {"n_layer": 4, "n_embd": 128, "n_head": 4, "block_size": 64, "batch_size": 16}
SMALL_BATCH = 2  # rows of the second calibration step: mostly the cost per op


def calibration_job(batch_size: int | None = None):
    """The calibration GPT as a one-rank job (token ids are drawn at random: no data file is read)."""
    from dataclasses import replace

    from ..train.config import Job
    from ..train.validate import validate

    g = CALIBRATION_GPT
    job = Job()
    job = replace(job, model=replace(job.model, kind="gpt", n_layer=g["n_layer"], n_embd=g["n_embd"], n_head=g["n_head"],
                                     block_size=g["block_size"]),
                  data=replace(job.data, batch_size=batch_size or g["batch_size"]),
                  parallel=replace(job.parallel, dp=1, pp=1, tp=1, micro_batches=1),
                  optimizer=replace(job.optimizer, grad_clip=1.0), train=replace(job.train, device="cpu"))
    return validate(job, 1)


def step_runner(job):
    """(a function running one ``train_step`` + ``finish_step`` of a one-rank GPT ``job`` on
    random ids, its context: close it when done)."""
    from mpi4py import MPI

    from ..runtime.context import init
    from ..train.build import build_model, compute_dtype
    from ..train.loop import context_options
    from ..train.strategies import make_strategy

    ctx = init(dp=1, pp=1, tp=1, comm=MPI.COMM_SELF, **context_options(job))
    strategy = make_strategy(job, ctx, build_model(job, ctx, compute_dtype(job)), None)
    rng = np.random.default_rng(0)

    def step():
        ids = rng.integers(0, job.model.vocab_size, (job.data.batch_size, job.model.block_size + 1))
        loss = strategy.train_step(ids[:, :-1], ids[:, 1:])
        strategy.finish_step(job.optimizer.grad_clip, loss)
    return step, ctx


def measured_step_seconds(job, steps: int = 9) -> float:
    """Median seconds of a training step of a one-rank GPT ``job`` (after a warm-up step)."""
    step, ctx = step_runner(job)
    seconds = _timed(step, steps)
    ctx.close()
    return seconds


def fit_model(machine: Machine, job=None) -> float:
    """Fit ``model_factor``, ``op_overhead_s`` and ``micro_batch_overhead_s`` on the calibration GPT.

    The op-family rates come from single ops; a model adds what they miss: the Python around
    each op (a module call, the graph's bookkeeping), cache misses between ops, and a fixed cost
    per micro-batch (the forward and backward calls, the loss). The calibration GPT (``job``) is
    timed on one rank four times: at its batch, at a batch of 2 rows (the same ops with an
    eighth of the work), with one layer at 2 rows (fewer ops, the same micro-batch), and with
    one layer at its batch in micro-batches of 2 rows (more micro-batches), so

        T = model_factor x (U + ops x op_overhead) + micro-batches x micro_batch_overhead

    (U: units / rates) is four equations in three unknowns, solved by least squares. The numbers
    are then used unchanged for every other model and layout. Where the steps do not separate
    them (noise: a negative solution), the single-op overhead stays, the micro-batch cost is 0
    and only the factor is fitted."""
    from dataclasses import replace

    from .predict import StepPlan
    from ..train.validate import validate

    job = job or calibration_job()
    compute = machine.compute_for(job.precision.name)
    single_op = compute.op_overhead_s
    compute.micro_batch_overhead_s = 0.0

    def op_sum(j, overhead: float) -> float:
        compute.op_overhead_s, compute.model_factor = overhead, 1.0
        return StepPlan(j, machine).predict().step_s

    variants = [job]
    if job.data.batch_size > SMALL_BATCH:
        small = replace(job, data=replace(job.data, batch_size=SMALL_BATCH))
        one_layer = replace(job, model=replace(job.model, n_layer=1))
        micro = job.data.batch_size // SMALL_BATCH
        variants += [small, replace(small, model=one_layer.model),
                     replace(one_layer, parallel=replace(job.parallel, micro_batches=micro))]
    rows, measured = [], []
    for variant in variants:
        variant = validate(variant, 1)
        units = op_sum(variant, 0.0)
        rows.append([units, (op_sum(variant, 1e-6) - units) / 1e-6, variant.parallel.micro_batches])
        measured.append(measured_step_seconds(variant))
    factor, per_op, per_micro_batch = (np.linalg.lstsq(np.array(rows), np.array(measured), rcond=None)[0]
                                       if len(rows) > 1 else (0.0, 0.0, 0.0))
    if factor > 0 and per_op > 0 and per_micro_batch >= 0:
        compute.op_overhead_s, compute.micro_batch_overhead_s = per_op / factor, per_micro_batch
    else:
        compute.op_overhead_s, compute.micro_batch_overhead_s = single_op, 0.0
        factor = measured[0] / (rows[0][0] + rows[0][1] * single_op)
    compute.model_factor = float(factor)
    return compute.model_factor
