"""``hpcpar plan calibrate``: measure this machine and write a machine file (under 2 minutes).

    mpiexec -n 4 hpcpar plan calibrate --out machine.toml

Rank 0 times hpcpar's own autograd ops, forward and backward, at a few sizes while the other
ranks wait without spinning: matrix products (``gemm``), attention (its products and its
softmax apart), and each elementwise family the model counts (``model.PASSES``); a rate per
family is the least-squares fit of time = ops x op overhead + units / rate, units being what
``model`` counts for that op (FLOPs, or bytes moved). Then every group size 2..N times the
collectives the engines call, on the same paths (tensor parallelism's plain all-reduce, DDP's
bucket all-reduce on a shared buffer, ZeRO's reduce-scatter and all-gather, pipeline sends),
and fits latency + wire bytes / bandwidth per collective and group size.

Run on several nodes (one rank per node at least), it measures the inter-node link too
(point-to-point and all-reduce between ranks on different nodes); on one node the inter-node
link comes from ``--inter FILE`` (a machine file, e.g. one ``hpcpar bench net`` figures went
into) or is taken equal to the intra-node one, and the file says so.
"""
from __future__ import annotations

import os
import statistics
import time

import numpy as np

from .machine import Compute, Link, Machine, format_machine, load_machine
from .model import passes

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
    for b, heads, steps, hs in ((4, 4, 64, 16), (2, 4, 256, 16), (2, 4, 128, 64)):
        q, k, v = t(b, heads, steps, hs), t(b, heads, steps, hs), t(b, heads, steps, hs)
        scores = b * heads * steps * steps
        seconds = _timed(_fwd_bwd(lambda: ops.attention(q, k, v)))
        attention.append((12 * scores * hs, passes("softmax", scores, 4) + passes("softmax", scores, 4, True),
                          seconds - 2 * overhead))
    softmax_rate, attention_rate = _fit_two(attention)
    conv = []
    for n, c, side, c_out in ((64, 8, 16, 16), (128, 16, 8, 32), (64, 32, 8, 64)):
        x, w = t(n, c, side, side), t(c_out, c, 3, 3)
        conv.append((2, 3 * 2 * n * side * side * c * 9 * c_out, _timed(_fwd_bwd(lambda: ops.conv2d(x, w, padding=1)))))
    families = {"softmax": softmax_rate}
    for family, op, shape in (("layernorm", lambda x: ops.layer_norm(x, None, None), (64, 256)),
                              ("gelu", ops.gelu, (64, 256)), ("copy", lambda x: ops.add(x, x), (64, 256)),
                              ("cross_entropy", None, (256, 256)), ("optimizer", None, (64, 256)),
                              ("pool", None, (64, 256))):
        samples = []
        for scale in (4, 16, 64):
            shape2 = (shape[0] * scale, shape[1])
            seconds, ops_count = _family_seconds(family, op, shape2, t, dtype)
            n, width = shape2[0] * shape2[1], 4 if family in ("cross_entropy", "optimizer") else d
            samples.append((ops_count, passes(family, n, width) + passes(family, n, width, True), seconds))
        families[family] = _fit_rate(samples, overhead)
    families["embedding"] = families["copy"]
    bandwidth = families["copy"]
    return Compute(gemm_flops=gemm_rate, attention_flops=attention_rate, conv_flops=_fit_rate(conv, overhead), bandwidth=bandwidth,
                   op_overhead_s=overhead, family_bandwidth=families)


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
    if family == "pool":  # 2 x 2 max pooling of (rows, channels, 4, 4) images: the same elements
        images = tensor(shape[0], shape[1] // 16, 4, 4)
        return _timed(_fwd_bwd(lambda: ops.max_pool2d(images, 2))), 2
    x = tensor(*shape)
    return _timed(_fwd_bwd(lambda: op(x))), 2


def _fit_two(samples) -> tuple[float, float]:
    """(bytes rate, FLOP rate) of time = flops / Rf + bytes / Rb over (flops, bytes, seconds)."""
    a = np.array([[f, b] for f, b, _ in samples], dtype=np.float64)
    y = np.array([max(s, 1e-9) for _, _, s in samples])
    inverse, *_ = np.linalg.lstsq(a, y, rcond=None)
    inverse = np.maximum(inverse, 1e-15)  # a negative fit (noise) means "free": a huge rate
    return 1.0 / inverse[1], 1.0 / inverse[0]


# ---------------------------------------------------------------------------------------------
# Collectives
SIZES = (8, 64 << 10, 1 << 20, 4 << 20)  # bytes per call


def _collective_calls(ctx, nbytes: int) -> dict:
    """op -> a function making one call of ``nbytes`` on ``ctx.dp``, on the engines' own paths."""
    from ..dist.shm import shared_zeros

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

    from ..dist.comm import Communicator
    from ..dist.stats import ring_wire_bytes
    from ..dist.context import init

    waiting = Communicator(world, "world", wait_policy="yield")  # ranks outside a group must not spin
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
            # not freed: its context lives on in the grid's communicators and shared windows
        waiting.barrier()
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

    from ..dist.comm import Communicator
    from ..dist.topology import discover

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
    return _fit_link(world.bcast(points if world.Get_rank() == 0 else None, root=0))


def measure_concurrency(world, repeats: int = 5) -> list[float]:
    """[1, s2, ..., sN]: how much slower a GPT block's forward and backward runs when k ranks of
    this node run it at once (shared cores, memory bandwidth, caches; more ranks than cores)."""
    from ..autograd import Tensor
    from ..dist.comm import Communicator
    from ..nn.gpt import Block, GPTConfig

    waiting = Communicator(world, "world", wait_policy="yield")
    block = Block(GPTConfig(n_layer=1, n_embd=128, n_head=4, block_size=64), np.float32, np)
    x = Tensor(np.random.default_rng(world.Get_rank()).standard_normal((4, 64, 128)).astype(np.float32),
               requires_grad=True)
    work = _fwd_bwd(lambda: block(x))
    slowdown = []
    for k in range(1, world.Get_size() + 1):
        waiting.barrier()
        seconds = _timed(work, repeats) if world.Get_rank() < k else 0.0
        waiting.barrier()
        times = [t for t in world.allgather(seconds)[:k]]
        slowdown.append(statistics.median(times))
    return [t / slowdown[0] for t in slowdown]


def calibrate(world, inter_file: str | None = None, name: str | None = None) -> tuple[Machine, dict]:
    """Measure this machine (collective over ``world``); (the machine, comments for its file) on every rank."""
    from .. import host
    from ..dist.comm import Communicator

    waiting = Communicator(world, "world", wait_policy="yield")  # ranks waiting for rank 0 give it the cores
    start = time.perf_counter()
    compute = measure_ops() if world.Get_rank() == 0 else None
    if world.Get_rank() == 0:  # the calibration model, while the others wait without spinning
        fit_model_factor(Machine("probe", 256, 1, 1e12, {"fp32": compute}, Link(0, 1e12), Link(0, 1e12)))
    waiting.barrier()
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
                "model_factor": "measured / predicted step of the calibration GPT (4 layers, width 128) on one rank",
                "concurrency": "measured: a GPT block's time with k ranks computing at once / alone, k = 1, 2, ...",
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


def calibration_job():
    """The calibration GPT as a one-rank job (token ids are drawn at random: no data file is read)."""
    from dataclasses import replace

    from ..train.config import Job
    from ..train.validate import validate

    g = CALIBRATION_GPT
    job = Job()
    job = replace(job, model=replace(job.model, kind="gpt", n_layer=g["n_layer"], n_embd=g["n_embd"], n_head=g["n_head"],
                                     block_size=g["block_size"]),
                  data=replace(job.data, batch_size=g["batch_size"]),
                  parallel=replace(job.parallel, dp=1, pp=1, tp=1, micro_batches=1),
                  optimizer=replace(job.optimizer, grad_clip=1.0), train=replace(job.train, device="cpu"))
    return validate(job, 1)


def measured_step_seconds(job, steps: int = 5) -> float:
    """Median seconds of ``train_step`` + ``finish_step`` of a one-rank GPT ``job`` on random ids (after 2 warm-up steps)."""
    from mpi4py import MPI

    from ..dist.context import init
    from ..train.build import build_model, compute_dtype
    from ..train.strategies import make_strategy

    ctx = init(dp=1, pp=1, tp=1, comm=MPI.COMM_SELF, device=job.train.device)
    strategy = make_strategy(job, ctx, build_model(job, ctx, compute_dtype(job)), None)
    rng = np.random.default_rng(0)
    times = []
    for _ in range(steps + 2):
        ids = rng.integers(0, job.model.vocab_size, (job.data.batch_size, job.model.block_size + 1))
        start = time.perf_counter()
        loss = strategy.train_step(ids[:, :-1], ids[:, 1:])
        strategy.finish_step(job.optimizer.grad_clip, loss)
        times.append(time.perf_counter() - start)
    return statistics.median(times[2:])


def fit_model_factor(machine: Machine, job=None) -> float:
    """Scale the machine's compute so that the calibration GPT (``job``) on one rank takes what it measures.

    The op-family rates come from single ops; a model adds what they miss (allocation, cache
    misses between ops, the Python around them). One model on one rank is the calibration: the
    factor (``model_factor``) is then used unchanged for every other model and layout."""
    from .predict import StepPlan

    job = job or calibration_job()
    compute = machine.compute_for(job.train.precision)
    compute.model_factor = 1.0
    predicted = StepPlan(job, machine).predict().step_s
    compute.model_factor = measured_step_seconds(job) / predicted
    return compute.model_factor
