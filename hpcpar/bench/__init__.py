"""Benchmarks: each prints a table with a baseline measured in the same run.

``hpcpar bench NAME [ARGS]`` runs ``hpcpar.bench.NAME.main(ARGS)``.
"""
from __future__ import annotations

import importlib

BENCHMARKS = {
    "allreduce": "hpcpar array all-reduce vs raw C MPI_Allreduce in the same processes",
    "step": "single-process GPT training step vs PyTorch CPU",
    "dp": "data-parallel gradient sync vs one raw flat all-reduce; overlap; weak scaling",
    "pipeline": "measured pipeline bubble vs (p-1)/(m+p-1) per schedule, step time",
    "ckpt": "checkpoint save/load vs raw tofile+fsync / fromfile of the same bytes per rank",
    "async": "all-reduce vs parameter server (sync, async s=1/4) vs local SGD (H=4/16) with a straggler",
    "net": "point-to-point and all-reduce across nodes vs the same inside a node (needs 2 nodes)",
}
MODULES = {"async": "async_training"}  # benchmark names that are not module names (async is a keyword)


def run_benchmark(name: str, argv: list[str]) -> None:
    if name not in BENCHMARKS:
        known = ", ".join(f"{k} ({v})" for k, v in BENCHMARKS.items())
        raise SystemExit(f"hpcpar bench: unknown benchmark {name!r}; known: {known}")
    importlib.import_module(f"hpcpar.bench.{MODULES.get(name, name)}").main(argv)
