"""``hpcpar bench recompute``: activation recomputation's memory saved and time paid, per mode.

    hpcpar bench recompute [--n-layer 4 --n-embd 256 --n-head 4 --block 128 --batch 8 --precision fp32]

For each of none, selective and full, one process and one BLAS thread run forward and backward
of the same GPT on the same batches, the modes taking turns step by step (medians). Beside the
times: the bytes the graph keeps for backward after the forward (``autograd.memory``, parameters
excluded), the same per block against ``nn.activation_memory.block_kept_bytes`` and against
Korthikanti et al.'s formula (``korthikanti_block_bytes``: 1-byte masks, the model's value bytes), and the
tracemalloc peak of one forward and backward (kept activations, gradients and temporaries).
"""
from __future__ import annotations

import numpy as np

from ..cli import at_least
from ..autograd.memory import kept_for_backward
from ..runtime.failfast import UsageError
from ..nn.activation_memory import block_kept_bytes, korthikanti_block_bytes
from ..nn.gpt import GPT, RECOMPUTE, GPTConfig
from ..optim import precision_dtype
from ..tables import format_table
from .step import _batches, _time_interleaved, limit_blas_threads, traced_peak


def forward_backward(model: GPT, batch_size: int):
    """One forward and backward on the next batch, gradients dropped (what each mode is timed on)."""
    batches = _batches(model.config, batch_size)

    def step():
        model.loss(*next(batches)).backward()
        for param in model.parameters():
            param.grad = None

    return step


def kept_per_block(config: GPTConfig, dtype, mode: str, batch_size: int) -> tuple[int, float]:
    """(bytes the whole graph keeps, bytes per block) after one forward; per block = n_layer + 1 less n_layer."""
    counted = []
    for layers in (config.n_layer, config.n_layer + 1):
        model = GPT(GPTConfig(**{**config.to_dict(), "n_layer": layers}), dtype=dtype)
        model.recompute = mode
        with kept_for_backward(model.parameters()) as kept:
            model.loss(*next(_batches(config, batch_size)))
        counted.append(kept.bytes)
    return counted[0], counted[1] - counted[0]


def measure(config: GPTConfig, batch_size: int, precision: str, steps: int, warmup: int) -> list[list]:
    dtype = np.dtype(precision_dtype(precision))
    models = {}
    for mode in RECOMPUTE:
        models[mode] = GPT(config, dtype=dtype)
        models[mode].recompute = mode
    with limit_blas_threads(1):
        times = _time_interleaved({m: forward_backward(models[m], batch_size) for m in RECOMPUTE}, steps, warmup)
        peaks = {m: traced_peak(forward_backward(models[m], batch_size)) for m in RECOMPUTE}
    rows = []
    for mode in RECOMPUTE:
        total, block = kept_per_block(config, dtype, mode, batch_size)
        formula = block_kept_bytes(batch_size, config.block_size, config.n_embd, config.n_head, dtype=dtype,
                                   recompute=mode, dropout=config.dropout)
        yardstick = korthikanti_block_bytes(batch_size, config.block_size, config.n_embd, config.n_head,
                                            itemsize=dtype.itemsize, recompute=mode)
        wall, cpu = times[mode]
        rows.append([mode, wall * 1e3, cpu * 1e3, f"{wall / times['none'][0]:.2f}", f"{cpu / times['none'][1]:.2f}",
                     f"{total / 2**20:.2f}", f"{block / 2**20:.3f}", f"{formula / 2**20:.3f}",
                     f"{yardstick / 2**20:.3f}", f"{block / yardstick:.2f}", f"{peaks[mode] / 2**20:.1f}"])
    return rows


def add_arguments(parser) -> None:
    parser.add_argument("--n-layer", type=at_least(1), default=4, help="transformer blocks")
    parser.add_argument("--n-embd", type=at_least(1), default=256, help="embedding width")
    parser.add_argument("--n-head", type=at_least(1), default=4, help="attention heads")
    parser.add_argument("--block", type=at_least(1), default=128, help="tokens per sequence")
    parser.add_argument("--batch", type=at_least(1), default=8, help="sequences per micro-batch")
    parser.add_argument("--dropout", type=float, default=0.1, help="dropout (residual and attention)")
    parser.add_argument("--precision", default="fp32", choices=["fp64", "fp32", "bf16", "fp16"],
                        help="the model's dtype (no optimizer runs: forward and backward only)")
    parser.add_argument("--steps", type=at_least(1), default=10, help="timed forward+backward passes per mode; medians")
    parser.add_argument("--warmup", type=at_least(0), default=2, help="untimed passes per mode first")
    parser.set_defaults(func=run)


def run(args) -> None:
    try:  # the model's own checks (heads dividing the width, dropout in [0, 1)): one line, not a traceback
        config = GPTConfig(vocab_size=256, block_size=args.block, n_layer=args.n_layer, n_head=args.n_head,
                           n_embd=args.n_embd, dropout=args.dropout, seed=0)
    except ValueError as error:
        raise UsageError(f"hpcpar bench recompute: error: {error}") from None
    rows = measure(config, args.batch, args.precision, args.steps, args.warmup)
    title = (f"Activation recomputation, GPT n_layer={config.n_layer} n_embd={config.n_embd} n_head={config.n_head} "
             f"block={config.block_size} batch={args.batch} dropout={config.dropout} {args.precision}, 1 process, "
             f"1 BLAS thread, forward+backward, medians of {args.steps} (modes take turns)")
    print(format_table(["recompute", "ms", "cpu ms", "vs none", "cpu vs none", "kept MiB (counted)",
                        "per block MiB", "per block (formula)", "Korthikanti MiB", "vs Korthikanti",
                        "tracemalloc peak MiB"], rows, title=title))
