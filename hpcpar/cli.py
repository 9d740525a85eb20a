"""The ``hpcpar`` command: one entry point, subcommands that each live in their own module.

Every subcommand runs under fail-fast: an exception on any rank aborts the whole MPI job.
"""
from __future__ import annotations

import argparse
import sys


def _info(args) -> None:
    from .info import print_info

    print_info(dp=args.dp, pp=args.pp, tp=args.tp, device=args.device)


def _run(args) -> None:
    from .dist.failfast import run_script

    run_script(args.script, args.script_args)


def _bench(args) -> None:
    from .bench import run_benchmark

    run_benchmark(args.name, args.bench_args)


def _ckpt(args) -> None:
    import os

    from .checkpoint.cli import main as ckpt_main

    status = ckpt_main(args.ckpt_args)
    if status:  # a serial tool: a plain exit status and its one-line message, not fail-fast's MPI abort
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hpcpar", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    info = sub.add_parser("info", help="MPI library, grid, CUDA-awareness, backends, parallel HDF5")
    info.add_argument("--dp", type=int, default=None)
    info.add_argument("--pp", type=int, default=1)
    info.add_argument("--tp", type=int, default=1)
    info.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    info.set_defaults(func=_info)

    run = sub.add_parser("run", help="run SCRIPT.py under fail-fast (like python -m mpi4py)")
    run.add_argument("script")
    run.add_argument("script_args", nargs=argparse.REMAINDER)
    run.set_defaults(func=_run)

    bench = sub.add_parser("bench", help="benchmarks that print tables against a baseline of the same run")
    bench.add_argument("name", help="allreduce | step | ...")
    bench.add_argument("bench_args", nargs=argparse.REMAINDER)
    bench.set_defaults(func=_bench)

    ckpt = sub.add_parser("ckpt", help="checkpoints (serial, no MPI): ls | inspect | verify | export",
                          description="ls ROOT | inspect PATH | verify PATH | export PATH OUT.h5 "
                                      "(hpcpar ckpt ACTION --help for each)")
    ckpt.add_argument("ckpt_args", nargs=argparse.REMAINDER, help="ACTION and its arguments (hpcpar ckpt ls --help)")
    ckpt.set_defaults(func=_ckpt)
    return parser


def main(argv: list[str] | None = None) -> None:
    from .dist.failfast import fail_fast, install

    install()
    args = build_parser().parse_args(argv)
    with fail_fast():
        args.func(args)


if __name__ == "__main__":  # pragma: no cover
    main(sys.argv[1:])
