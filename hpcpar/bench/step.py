"""``hpcpar bench step``: one process, one BLAS thread, a GPT training step vs PyTorch CPU.

    python bench/step.py [--steps 10] [--warmup 3] [--profile] [--precision fp32 bf16 fp16]
    hpcpar bench step --precision bf16

A step is forward, backward and AdamW on a GPT of n_layer 4, n_head 4, n_embd 256,
block_size 128, batch 8, vocab 256 in float32. The same model written in PyTorch runs in
the same process (``torch.set_num_threads(1)``) when ``import torch`` works, the two taking
turns step by step; the table shows median wall-clock and CPU ms/step, tokens/s and the
ratios hpcpar / PyTorch. ``--precision`` adds hpcpar in bfloat16 / float16 (float32 masters,
``MixedPrecision``; float16 with a loss scale of 1024) beside float32, with the activation peak
of each: the tracemalloc peak of the NumPy allocations of one forward and backward.
``--profile`` adds where an hpcpar step goes: forward and backward milliseconds per op
(cProfile, cumulative), the optimizer, and the rest.
"""
from __future__ import annotations

import cProfile
import contextlib
import pstats
import statistics
import time

import numpy as np

from ..cli import at_least
from ..autograd import Function
from ..nn.gpt import GPT, GPTConfig
from ..optim import AdamW, DynamicLossScaler, MixedPrecision, precision_dtype
from ..tables import format_table

BENCH_CONFIG = GPTConfig(vocab_size=256, block_size=128, n_layer=4, n_head=4, n_embd=256, dropout=0.0, seed=0)


def limit_blas_threads(threads: int = 1):
    """A context holding the BLAS pools at ``threads`` (threadpoolctl when installed; else the env vars rule)."""
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:
        return contextlib.nullcontext()
    return threadpool_limits(limits=threads)


def _time_interleaved(steps_by_name: dict, steps: int, warmup: int) -> dict:
    """``{name: (wall, cpu)}``: median wall-clock and process CPU seconds per call, the functions taking turns.

    Taking turns exposes every framework to the same background load; the CPU time of this
    (single-threaded) process is the steadier figure on a shared, oversubscribed machine.
    """
    for _ in range(warmup):
        for step in steps_by_name.values():
            step()
    times = {name: ([], []) for name in steps_by_name}
    for _ in range(steps):
        for name, step in steps_by_name.items():
            wall, cpu = time.perf_counter(), time.process_time()
            step()
            times[name][0].append(time.perf_counter() - wall)
            times[name][1].append(time.process_time() - cpu)
    return {name: (statistics.median(wall), statistics.median(cpu)) for name, (wall, cpu) in times.items()}


def _batches(config: GPTConfig, batch_size: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    while True:
        ids = rng.integers(0, config.vocab_size, (batch_size, config.block_size + 1))
        yield ids[:, :-1], ids[:, 1:]


def hpcpar_step(config: GPTConfig, batch_size: int, precision: str = "fp32", phases: str = "step",
                device: str = "cpu"):
    """One training step of a fresh GPT in ``precision`` (16 bits: float32 masters, skips counted), or
    with ``phases="forward+backward"`` only that part (what the activation peak is measured on);
    ``device``: where the model lives (``hpcpar.bench.gpu_check`` times it on a GPU)."""
    model = GPT(config, dtype=precision_dtype(precision), device=device)
    amp = None
    if precision in ("bf16", "fp16"):
        amp = MixedPrecision(model, DynamicLossScaler(init_scale=1024.0) if precision == "fp16" else None)
    optimizer = AdamW(amp.named_master_parameters() if amp else model.named_parameters(), lr=1e-4)
    batches = _batches(config, batch_size)

    def step():
        ids, targets = next(batches)
        loss = model.loss(ids, targets)
        if amp is None:
            loss.backward()
        else:
            amp.backward(loss)
        if phases == "forward+backward":
            for param in model.parameters():
                param.grad = None
        elif amp is None:
            optimizer.step()
            optimizer.zero_grad()
        else:
            amp.step(optimizer, loss=loss)

    return step


def traced_peak(fn) -> int:
    """Peak bytes of NumPy (and other traced) allocations made while ``fn()`` runs (tracemalloc)."""
    import tracemalloc

    tracemalloc.start()
    try:
        fn()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def activation_peak(config: GPTConfig, batch_size: int, precision: str) -> int:
    """tracemalloc peak bytes of one forward and backward (after one untraced warm-up)."""
    step = hpcpar_step(config, batch_size, precision, phases="forward+backward")
    step()
    return traced_peak(step)


def torch_step(config: GPTConfig, batch_size: int, device: str = "cpu", precision: str = "fp32"):
    """The same GPT in PyTorch (pre-norm blocks, fused qkv, SDPA, tanh GELU, tied head), or None.

    ``device="cuda"`` runs it on the GPU, in ``precision`` through autocast (float32 weights, as
    hpcpar's float32 masters; fp16 with a GradScaler)."""
    try:
        import torch
    except ImportError:
        return None
    if device == "cpu":
        torch.set_num_threads(1)
    torch.manual_seed(config.seed)
    model = torch_gpt(config).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    batches = _batches(config, batch_size)
    dtype = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    scaler = torch.amp.GradScaler(device, init_scale=1024.0) if precision == "fp16" else None

    def step():
        ids, targets = (torch.from_numpy(a).to(device) for a in next(batches))
        with torch.autocast(device, dtype=dtype, enabled=dtype is not None):
            loss = model(ids, targets)
        if scaler is None:
            loss.backward()
            optimizer.step()
        else:
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
        optimizer.zero_grad()

    return step


def torch_gpt(config: GPTConfig):
    """hpcpar's GPT written in PyTorch (an ``nn.Module`` whose forward returns the loss)."""
    import torch
    from torch import nn
    from torch.nn import functional as F

    C, nh = config.n_embd, config.n_head

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln_1, self.ln_2 = nn.LayerNorm(C), nn.LayerNorm(C)
            self.qkv, self.proj = nn.Linear(C, 3 * C), nn.Linear(C, C)
            self.fc, self.mlp_proj = nn.Linear(C, 4 * C), nn.Linear(4 * C, C)

        def forward(self, x):
            B, T, _ = x.shape
            q, k, v = self.qkv(self.ln_1(x)).split(C, dim=2)
            q, k, v = (t.view(B, T, nh, C // nh).transpose(1, 2) for t in (q, k, v))  # (B, nh, T, hs)
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, C)
            x = x + self.proj(y)
            return x + self.mlp_proj(F.gelu(self.fc(self.ln_2(x)), approximate="tanh"))

    class TorchGPT(nn.Module):
        def __init__(self):
            super().__init__()
            self.wte, self.wpe = nn.Embedding(config.vocab_size, C), nn.Embedding(config.block_size, C)
            self.blocks = nn.ModuleList(Block() for _ in range(config.n_layer))
            self.ln_f = nn.LayerNorm(C)

        def forward(self, ids, targets):
            x = self.wte(ids) + self.wpe(torch.arange(ids.shape[1], device=ids.device))
            for block in self.blocks:
                x = block(x)
            logits = self.ln_f(x) @ self.wte.weight.T
            return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.reshape(-1))

    return TorchGPT()


def _function_classes(cls=Function):
    for sub in cls.__subclasses__():
        yield sub
        yield from _function_classes(sub)


def profile_ops(step, steps: int = 3) -> list[tuple[str, float, float]]:
    """cProfile ``steps`` calls of ``step``; ``[(op, forward ms/step, backward ms/step)]``, slowest first.

    An op's time is the cumulative time of its ``forward`` / ``backward``; the optimizer's
    ``update`` and the rest of the step (graph bookkeeping, data) get a row each.
    """
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(steps):
        step()
    profiler.disable()
    stats = pstats.Stats(profiler).stats  # {(file, line, name): (cc, nc, tottime, cumtime, callers)}
    by_code = {(fn.__code__.co_filename, fn.__code__.co_firstlineno): (cls.__name__, phase)
               for cls in _function_classes() for phase in ("forward", "backward")
               for fn in [cls.__dict__.get(phase)] if fn is not None}
    rows: dict[str, list[float]] = {}
    total = max(entry[3] for entry in stats.values())  # the outermost call: the whole profiled loop
    for (filename, line, name), (_, _, _, cumtime, _) in stats.items():
        key = by_code.get((filename, line))
        if key is None and name == "update" and filename.endswith(("adam.py", "sgd.py")):
            key = ("optimizer update", "forward")
        if key is not None:
            rows.setdefault(key[0], [0.0, 0.0])[0 if key[1] == "forward" else 1] += cumtime * 1e3 / steps
    accounted = sum(f + b for f, b in rows.values())
    rows["other (graph, Python, data)"] = [total * 1e3 / steps - accounted, 0.0]
    return sorted(((name, f, b) for name, (f, b) in rows.items()), key=lambda r: -(r[1] + r[2]))


def run_step_bench(config: GPTConfig = BENCH_CONFIG, batch_size: int = 8, steps: int = 10, warmup: int = 3,
                   compare_torch: bool = True, precisions=("fp32",)) -> dict:
    """``{(framework, precision): (wall, cpu, activation peak bytes or None)}``: median seconds per
    training step of hpcpar in each precision (float32 always) and of PyTorch float32 (when installed)."""
    precisions = ["fp32"] + [p for p in precisions if p != "fp32"]
    with limit_blas_threads(1):
        step_functions = {("hpcpar", p): hpcpar_step(config, batch_size, p) for p in precisions}
        reference = torch_step(config, batch_size) if compare_torch else None
        if reference is not None:
            step_functions[("pytorch", "fp32")] = reference
        times = _time_interleaved(step_functions, steps, warmup)
        peaks = {key: activation_peak(config, batch_size, key[1]) if key[0] == "hpcpar" else None for key in times}
    return {key: (wall, cpu, peaks[key]) for key, (wall, cpu) in times.items()}


CPU_NOTE = """On this CPU, 16 bits cost time: NumPy has no 16-bit GEMM, so hpcpar multiplies 16-bit matrices as
float32 BLAS on upcast operands (float32 accumulation, as the policy says) and 16-bit elementwise ops go
through NumPy's and ml_dtypes' casting loops, slower than float32's vectorised ones. What carries over is
the memory: activations and gradients are half the bytes. On a GPU (CuPy, float16) the GEMMs run on tensor
cores at several times float32's rate and every elementwise kernel moves half the bytes, so the step time
falls with the memory instead of rising."""


def format_results(results: dict, config: GPTConfig, batch_size: int) -> str:
    tokens = batch_size * config.block_size
    wall_base, cpu_base, _ = results.get(("pytorch", "fp32"), (None, None, None))
    peak_base = results[("hpcpar", "fp32")][2]
    rows = [[name, precision, wall * 1e3, cpu * 1e3, tokens / wall,
             f"{wall / wall_base:.2f}" if wall_base else "-", f"{cpu / cpu_base:.2f}" if cpu_base else "-",
             f"{peak / 2**20:.1f}" if peak is not None else "-", f"{peak / peak_base:.2f}" if peak is not None else "-"]
            for (name, precision), (wall, cpu, peak) in results.items()]
    title = (f"GPT training step (n_layer={config.n_layer} n_head={config.n_head} n_embd={config.n_embd} "
             f"block={config.block_size} batch={batch_size} vocab={config.vocab_size}, 1 BLAS thread, "
             f"forward+backward+AdamW, medians; activation peak: tracemalloc, one forward+backward)")
    headers = ["framework", "precision", "ms/step", "cpu ms/step", "tokens/s", "vs pytorch", "cpu vs pytorch",
               "activation peak MB", "peak vs fp32"]
    table = format_table(headers, rows, title=title)
    if any(precision in ("bf16", "fp16") for _, precision in results):
        table += "\n\n" + CPU_NOTE
    return table


def add_arguments(parser) -> None:
    parser.add_argument("--steps", type=at_least(1), default=10, help="timed steps; medians shown")
    parser.add_argument("--warmup", type=at_least(0), default=3, help="untimed steps first")
    parser.add_argument("--batch", type=at_least(1), default=8, help="sequences per step")
    parser.add_argument("--precision", nargs="+", default=["fp32"], choices=["fp32", "bf16", "fp16"],
                        help="hpcpar's precisions, each beside float32 (bf16 needs ml_dtypes)")
    parser.add_argument("--no-torch", action="store_true", help="skip the PyTorch reference")
    parser.add_argument("--profile", action="store_true",
                        help="print the functions that dominate an hpcpar step (in the last --precision)")
    parser.set_defaults(func=run)


def run(args) -> None:
    results = run_step_bench(BENCH_CONFIG, args.batch, args.steps, args.warmup, not args.no_torch, args.precision)
    print(format_results(results, BENCH_CONFIG, args.batch))
    if args.profile:
        with limit_blas_threads(1):
            step = hpcpar_step(BENCH_CONFIG, args.batch, args.precision[-1])
            step()
            rows = [[name, f, b, f + b] for name, f, b in profile_ops(step)]
        print()
        print(format_table(["op", "forward ms", "backward ms", "total ms"], rows,
                           title=f"Where an hpcpar {args.precision[-1]} step goes (cProfile, cumulative time per op, "
                                 f"ms/step)"))
