"""The ``hpcpar`` command: one entry point, subcommands that each live in their own module.

Every subcommand runs under fail-fast: an exception on any rank aborts the whole MPI job.
A usage error (an unknown option, a missing file, a layout that does not fit) is one line on
rank 0 and exit status 2 on every rank, with no traceback; ``--help`` works at every level.

Only the module of the command given is imported (``hpcpar --help`` starts neither NumPy nor
MPI). Each command module provides ``add_arguments(parser)``, which adds its options and sets
``func``: the function called with the parsed arguments, returning an exit status or None.
"""
from __future__ import annotations

import argparse
import difflib
import importlib
import json
import math
import os
import sys

import hpcpar

from . import log

# name -> (module[:function] that adds the arguments, default add_arguments; one line of help)
COMMANDS = {
    "train": ("hpcpar.cli:add_train_arguments", "train the job of a TOML file (under mpiexec or srun)"),
    "compare": ("hpcpar.compare", "measure data, pipeline, tensor and hybrid layouts of this world on a job's model"),
    "plan": ("hpcpar.plan.cli", "predict step time, memory and traffic of every layout (calibrate: measure this machine)"),
    "info": ("hpcpar.info", "MPI library, grid, CUDA-awareness, backends, parallel HDF5"),
    "run": ("hpcpar.cli:add_run_arguments", "run SCRIPT.py under fail-fast (an exception on any rank ends the job)"),
    "bench": ("hpcpar.bench", "benchmarks that print tables against a baseline of the same run"),
    "ckpt": ("hpcpar.checkpoint.cli", "checkpoints (serial, no MPI): ls | inspect | verify | export"),
    "data": ("hpcpar.data.prepare", "datasets (serial, no MPI): prepare an HDF5 token file from text"),
    "plot": ("hpcpar.plot", "PNG figures from a metrics .jsonl or a compare.json"),
    "generate": ("hpcpar.generate", "sample text from a GPT checkpoint (serial)"),
}


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Descriptions as written; every option's help ends with its default unless it names one."""

    def _get_help_string(self, action) -> str:
        text = action.help or ""
        shown = "default" in text or "%(default)" in text
        unset = action.default is None or action.default is False or action.default == argparse.SUPPRESS
        if action.option_strings and not shown and not unset:  # (0 is a default to show, False a switch's off)
            text += " (default: %(default)s)"
        return text


class Parser(argparse.ArgumentParser):
    """An argument parser for a job of many ranks: rank 0 prints help and errors, once.

    A usage error is a single line (``hpcpar X: error: ...``) and exit status 2 on every rank:
    every rank parses the same command line, so every rank reaches the same verdict.
    """

    def __init__(self, *args, top_level: bool = False, **kwargs):
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)
        self.top_level = top_level

    def parse_known_args(self, args=None, namespace=None):
        """A sub-command reports the options it does not know itself (with its name, and a guess)."""
        namespace, extras = super().parse_known_args(args, namespace)
        if extras and not self.top_level:
            options = [o for action in self._actions for o in action.option_strings]
            guess = difflib.get_close_matches(extras[0].split("=")[0], options, n=1)
            self.error(f"unrecognized arguments: {' '.join(extras)}" + (f"; did you mean {guess[0]}?" if guess else ""))
        return namespace, extras

    def _print_message(self, message, file=None) -> None:
        if log.world_rank() == 0:
            super()._print_message(message, file)

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _finite(text: str, kind):
    try:
        value = kind(text)
    except ValueError:
        value = None
    if value is None or not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected {'an integer' if kind is int else 'a finite number'}, got {text!r}")
    return value


def at_least(low, kind=int):
    """An argparse type: a ``kind`` number >= ``low`` (a count of steps, rounds, sequences, layers...), so
    that 0 or a negative value is a usage line, not a traceback (or a silently empty table) later."""
    def convert(text: str):
        value = _finite(text, kind)
        if value < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {text}")
        return value
    return convert


def above(low: float):
    """An argparse type: a finite number > ``low`` (a size in MiB, a factor)."""
    def convert(text: str) -> float:
        value = _finite(text, float)
        if value <= low:
            raise argparse.ArgumentTypeError(f"must be > {low:g}, got {text}")
        return value
    return convert


def _log_ranks(text: str) -> str:
    try:
        log.parse_ranks(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    return text


def add_logging_options(parser: argparse.ArgumentParser) -> None:
    """Options every command takes: which ranks log, and from which level."""
    group = parser.add_argument_group("logging")
    group.add_argument("--log-level", choices=log.LEVELS, default=None,
                       help="lowest level printed (default: $HPCPAR_LOG_LEVEL, else info)")
    group.add_argument("--log-ranks", type=_log_ranks, default=None, metavar="all|0,3",
                       help="ranks that print log lines; with more than one, each line starts with [rank R] "
                            "(default: $HPCPAR_LOG_RANKS, else 0)")


def leaf_parsers(parser: argparse.ArgumentParser):
    """The parsers that end a command line (``hpcpar ckpt ls``, ``hpcpar train``), depth first."""
    subcommands = [action for action in parser._actions if isinstance(action, argparse._SubParsersAction)]
    if not subcommands:
        yield parser
    for action in subcommands:
        for child in dict.fromkeys(action.choices.values()):  # aliases map to the same parser
            yield from leaf_parsers(child)


# ----------------------------------------------------------------------------------------
# train and run (their code lives below cli in the layers: only their arguments are here)
# ----------------------------------------------------------------------------------------
def jobs_reference() -> str:
    """docs/jobs.md: every job key, from the schema (``make docs`` writes it; a test compares)."""
    from .train.config import schema_table

    return ("# Job file keys\n\n"
            "Every key of a job file, with its type, default, allowed values and meaning. Generated from the\n"
            "schema in `hpcpar/train/config.py` by `hpcpar train --list-keys` (`make docs` writes this file;\n"
            "a test fails when it is stale). Set a key in the job's TOML file under its section, or on the\n"
            "command line with `--set section.key=value` (TOML syntax; a bare word is a string).\n\n"
            + schema_table() + "\n")


def _unread_train_flags(args) -> str | None:
    """What is wrong with flags ``hpcpar train`` would not read in this use (they would do nothing)."""
    if args.list_keys and (args.job is not None or args.set):
        return "--list-keys prints every key and reads no job; leave out the job file and --set"
    if args.list_keys:
        return None
    if args.job is None:
        return "the following arguments are required: job (or --list-keys)"
    unread = [flag for flag, value in (("--resume", args.resume), ("--overwrite", args.overwrite),
                                       ("--load-weights-only", args.load_weights_only), ("--trace", args.trace))
              if value and args.dry_run]
    if unread:
        return (f"{', '.join(unread)} {'does' if len(unread) == 1 else 'do'} nothing with --dry-run, which trains "
                f"nothing; leave {'it' if len(unread) == 1 else 'them'} out")
    return None


def _train(args) -> int:
    if problem := _unread_train_flags(args):
        raise _usage("hpcpar train", problem)
    if args.list_keys:
        print(jobs_reference(), end="")
        return 0
    from mpi4py import MPI

    from .backend import DeviceError
    from .runtime.failfast import UsageError, agreed_verdict
    from .train.config import JobError
    from .train.config_load import load_job
    from .train.loop import StopRequest, train
    from .train.nonfinite import RunDiverged
    from .train.resume import Request
    from .train.validate import check_machine, validate

    layout = [f'parallel.layout="{args.layout}"'] if args.layout else []
    if args.dry_run:
        from .plan.cli import dry_run

        return dry_run(args.job, args.set + layout, MPI.COMM_WORLD.Get_size(), args.machine)
    stop = StopRequest()  # first: until the handlers are in, SLURM's USR1 would kill the rank
    overrides = args.set + layout + ([f"train.trace={json.dumps(args.trace)}"] if args.trace else [])
    try:  # the same verdict on every rank (one all-gather of it), before any rank waits on another
        with agreed_verdict("hpcpar train", (JobError, DeviceError)):
            job = validate(load_job(args.job, overrides), MPI.COMM_WORLD.Get_size())
            if job.parallel.layout == "auto":
                from .plan.auto import planned_job

                job = planned_job(job, MPI.COMM_WORLD.Get_size(), args.machine)
            elif args.machine is not None:  # training never reads a machine file otherwise
                raise JobError(job.source, [("--machine", "the machine file is read by --dry-run and by "
                                                          "parallel.layout = \"auto\" only; leave it out")])
            check_machine(job)
        # JobErrors inside (a checkpoint that does not fit the job) come on every rank at once
        request = Request(args.resume, overwrite=args.overwrite, weights_only=args.load_weights_only)
        train(job, resume=request, stop=stop, progress=args.progress)
    except (JobError, DeviceError) as error:  # DeviceError: the device, CuPy or a dtype on it (one line, the fix)
        raise _usage("hpcpar train", str(error)) from None
    except RunDiverged as error:  # every rank agreed on it: one line, exit 3
        raise UsageError(f"hpcpar train: {error}", code=RunDiverged.exit_code) from None
    finally:
        stop.ignore_later_signals()
    return 0


def _run(args) -> None:
    from .runtime.failfast import run_script

    run_script(args.script, args.script_args)


def add_run_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("script", help="the Python file to run as __main__ on every rank")
    parser.add_argument("script_args", nargs=argparse.REMAINDER, metavar="ARGS", help="its own arguments")
    parser.set_defaults(func=_run)


def add_train_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("job", nargs="?", help="the job file, jobs/NAME.toml")
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help="override a job key, TOML syntax (repeatable): --set parallel.tp=2 (default: none)")
    parser.add_argument("--resume", metavar="auto|never|must|PATH", default=None,
                        help="auto: continue this run from checkpoint.dir's latest checkpoint, fresh when it has "
                             "none, refusing another run's; never: a new run (checkpoint.dir must hold no "
                             "checkpoint); must: fail unless a checkpoint loads; PATH: continue from that step "
                             "folder (default: checkpoint.resume of the job, auto unless set)")
    parser.add_argument("--overwrite", action="store_true",
                        help="with --resume never (or PATH): move checkpoint.dir's old checkpoints aside to "
                             "DIR.old-N first (nothing is deleted)")
    parser.add_argument("--load-weights-only", action="store_true",
                        help="with --resume PATH: take only the model's weights (any data, optimizer and step); "
                             "a new run starts at step 0")
    parser.add_argument("--progress", choices=("auto", "bar", "log", "none"), default="auto",
                        help="bar: a live bar on the terminal the job was started from (under mpiexec too); log: a "
                             "line every train.log_interval steps with elapsed time and ETA; auto: bar when rank 0's "
                             "stderr is a terminal, else log; none: neither")
    parser.add_argument("--trace", metavar="FILE", default=None,
                        help="write one Chrome/Perfetto trace of every rank's steps to FILE, as train.trace does "
                             "(default: train.trace of the job)")
    parser.add_argument("--dry-run", action="store_true",
                        help="validate the job, print the planner's step time and memory per rank for its layout "
                             "(hpcpar plan), and exit without training")
    parser.add_argument("--layout", choices=("manual", "auto"), default=None,
                        help="auto: the planner picks the layout (parallel.layout = \"auto\": the layout keys the "
                             "job leaves out, for this world and --machine) (default: parallel.layout of the job)")
    parser.add_argument("--machine", default=None, metavar="FILE",
                        help="--dry-run and --layout auto: the machine file planned on (default: "
                             "runs/plan/machine.toml; without one, --dry-run predicts memory and traffic only)")
    parser.add_argument("--list-keys", action="store_true",
                        help="print every job key with its type, default and meaning (docs/jobs.md), and exit")
    parser.set_defaults(func=_train)


def _usage(prog: str, message: str):
    from .runtime.failfast import UsageError

    return UsageError(f"{prog}: error: {message}")


# ----------------------------------------------------------------------------------------
# The parser and main
# ----------------------------------------------------------------------------------------
def build_parser(command: str | None = "*") -> Parser:
    """The whole parser ("*"), or with only ``command``'s arguments filled in (None: none)."""
    parser = Parser(prog="hpcpar", description="Data, pipeline and tensor parallel training of neural networks over MPI.",
                    epilog="hpcpar COMMAND --help describes each command.", top_level=True)
    parser.add_argument("--version", action="version", version=f"hpcpar {hpcpar.__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (module, text) in COMMANDS.items():
        command_parser = sub.add_parser(name, help=text, description=text[0].upper() + text[1:] + ".")
        if command in ("*", name):
            module_name, _, function = module.partition(":")
            getattr(importlib.import_module(module_name), function or "add_arguments")(command_parser)
            for leaf in leaf_parsers(command_parser):
                add_logging_options(leaf)
    return parser


def _command_of(argv: list[str]) -> str | None:
    """The command named on the line (the first word that is not an option), if any."""
    return next((word for word in argv if not word.startswith("-")), None)


def main(argv: list[str] | None = None) -> None:
    from .runtime.failfast import ExitStatus, UsageError, abort_grace_seconds, fail_fast, install
    from .runtime.watchdog import stall_seconds

    argv = sys.argv[1:] if argv is None else list(argv)
    install()
    command = _command_of(argv)
    parser = build_parser(command if command in COMMANDS else None)
    args = parser.parse_args(argv)
    try:
        log.configure(args.log_level, args.log_ranks)
    except ValueError as error:  # the flags were checked by the parser: $HPCPAR_LOG_LEVEL or $HPCPAR_LOG_RANKS
        parser.error(f"{error} (from the environment: HPCPAR_LOG_LEVEL or HPCPAR_LOG_RANKS)")
    try:  # the waiting and aborting times, read deep inside a run: a bad one is one line here
        abort_grace_seconds(), stall_seconds()
    except ValueError as error:
        parser.error(str(error))
    try:
        with fail_fast():
            try:
                status = args.func(args)
            except BrokenPipeError:  # hpcpar ... | head: the reader has gone; nothing left to say
                os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
                status = 1
            if status:  # a verdict every rank reached alike: a plain exit status, not an MPI abort
                raise ExitStatus(status)
    except ExitStatus as stop:
        if isinstance(stop, UsageError) and log.world_rank() == 0:
            print(stop.message, file=sys.stderr)
        sys.stdout.flush()
        sys.stderr.flush()
        sys.exit(stop.code)


if __name__ == "__main__":  # pragma: no cover
    main(sys.argv[1:])
