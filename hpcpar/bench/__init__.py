"""Benchmarks: each prints a table with a baseline measured in the same run.

``hpcpar bench NAME [OPTIONS]``: each module ``hpcpar.bench.NAME`` provides
``add_arguments(parser)`` (its options, and ``func``) and ``run(args)``.
"""
from __future__ import annotations

import importlib

BENCHMARKS = {
    "allreduce": "all-reduce: the same call in C, mpi4py and hpcpar; the shared-memory path vs MPICH and a memory copy",
    "step": "single-process GPT training step vs PyTorch CPU",
    "dp": "data-parallel gradient sync vs one raw flat all-reduce; overlap; weak scaling",
    "pipeline": "measured pipeline bubble vs (p-1)/(m+p-1) per schedule, step time",
    "recompute": "activation recomputation none/selective/full: bytes kept for backward, tracemalloc peak, time",
    "zero": "ZeRO stages 0-3 against DDP on the same GPT: step time, communication waited, memory per rank vs formula",
    "ckpt": "checkpoint save/load vs raw tofile+fsync / preadv of the same bytes per rank",
    "async": "all-reduce vs parameter server (sync, async s=1/4) vs local SGD (H=4/16) with a straggler",
    "cp": "context parallelism: zigzag vs contiguous ring-attention balance, overlap, step vs 1 rank, memory per rank",
    "roofline": "a GPT step against its own matrix products replayed alone (GEMM-only), and PyTorch's step",
    "moe": "expert parallelism ep = 1, 2, 4: step time, all-to-all seconds and bytes; a router forced onto 2 experts",
    "net": "point-to-point and all-reduce across nodes vs the same inside a node (needs 2 nodes)",
}
MODULES = {"async": "async_training"}  # benchmark names that are not module names (async is a keyword)


def add_arguments(parser) -> None:
    """``hpcpar bench``: one sub-command per benchmark, each with its own options."""
    benches = parser.add_subparsers(dest="bench", required=True, metavar="BENCHMARK",
                                    title="benchmarks (hpcpar bench NAME --help for each one's options)")
    for name, text in BENCHMARKS.items():
        bench = benches.add_parser(name, help=text, description=text)
        importlib.import_module(f"hpcpar.bench.{MODULES.get(name, name)}").add_arguments(bench)

