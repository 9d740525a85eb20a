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


def _ckpt(args) -> int:
    from .checkpoint.cli import main as ckpt_main

    return ckpt_main(args.ckpt_args)


def _data(args) -> int:
    from .data.prepare import main as prepare_main

    return prepare_main(args)


def _train(args) -> int:
    from mpi4py import MPI

    from .train.config import JobError, load_job
    from .train.validate import validate
    from .train.loop import StopRequest, train

    stop = StopRequest()  # first: until the handlers are in, SLURM's USR1 would kill the rank
    try:  # the same verdict on every rank, before any rank waits on another
        job = validate(load_job(args.job, args.set), MPI.COMM_WORLD.Get_size())
        train(job, resume=True if args.resume else None, stop=stop)  # JobErrors in it come on every rank at once
    except JobError as error:
        if MPI.COMM_WORLD.Get_rank() == 0:
            print(f"hpcpar train: error: {error}", file=sys.stderr, flush=True)
        return 2
    return 0


def _compare(args) -> int:
    from .compare import main as compare_main

    return compare_main(args.compare_args)


def _plot(args) -> int:
    from .plot import main as plot_main

    return plot_main(args.plot_args)


def _generate(args) -> int:
    from .generate import main as generate_main

    return generate_main(args.generate_args)


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

    train = sub.add_parser("train", help="train the job of a TOML file (under mpiexec or srun)")
    train.add_argument("job", help="jobs/NAME.toml")
    train.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                       help="override a job key, TOML syntax (repeatable): --set parallel.tp=2")
    train.add_argument("--resume", action="store_true", help="resume from the latest checkpoint (default: "
                       "checkpoint.resume of the job)")
    train.set_defaults(func=_train)

    for name, func, text in (("compare", _compare, "measure data, pipeline, tensor and hybrid layouts of this "
                                                     "world on a job's model (under mpiexec)"),
                             ("plot", _plot, "PNG figures from a metrics .jsonl or a compare.json"),
                             ("generate", _generate, "sample text from a GPT checkpoint (serial)")):
        command = sub.add_parser(name, help=text, add_help=False)
        command.add_argument(f"{name}_args", nargs=argparse.REMAINDER)
        command.set_defaults(func=func)

    data = sub.add_parser("data", help="datasets (serial, no MPI): prepare an HDF5 token file from text")
    data_actions = data.add_subparsers(dest="action", required=True, metavar="ACTION")
    prepare = data_actions.add_parser(
        "prepare", help="text files (default: the Python standard library) -> HDF5 byte tokens, train/val",
        description="Concatenate text files as bytes (one byte = one token) into OUT with datasets train and "
                    "val; the default text is the Python standard library's own source.")
    prepare.add_argument("--out", default="data/stdlib.h5", help="the HDF5 file to write (default: %(default)s)")
    prepare.add_argument("--max-mb", type=float, default=8, help="read at most this many MiB (default: %(default)s)")
    prepare.add_argument("--val-fraction", type=float, default=0.05,
                         help="the last share of the bytes held out for validation (default: %(default)s)")
    prepare.add_argument("paths", nargs="*", metavar="PATH", help="text files, in order (default: the stdlib)")
    prepare.set_defaults(func=_data)
    return parser


def main(argv: list[str] | None = None) -> None:
    from .dist.failfast import ExitStatus, fail_fast, install

    install()
    args = build_parser().parse_args(argv)
    try:
        with fail_fast():
            status = args.func(args)
            if status:  # a verdict every rank reached alike: a plain exit status, not an MPI abort
                raise ExitStatus(status)
    except ExitStatus as stop:
        sys.stdout.flush()
        sys.stderr.flush()
        sys.exit(stop.code)


if __name__ == "__main__":  # pragma: no cover
    main(sys.argv[1:])
