"""Logging on some ranks of a job: rank 0 by default, a ``[rank R]`` prefix when several log.

    from hpcpar import log
    logger = log.get_logger(__name__)           # "hpcpar.<module>"; configure() decides who prints
    log.configure(level="info", ranks="0,3")    # the hpcpar command calls this; or HPCPAR_LOG_RANKS

Library code reports through ``logging`` (INFO and DEBUG to stdout, WARNING and above to
stderr); a command's own output (a table, sampled text) stays ``print``. Nothing happens on
import: until ``configure`` runs, the ``hpcpar`` logger has no handler of ours and Python's
defaults apply (warnings to stderr, info dropped).

The rank is known before MPI starts, from the launcher's environment (``PMI_RANK`` of MPICH's
hydra, ``OMPI_COMM_WORLD_RANK``, ``PMIX_RANK``, ``SLURM_PROCID`` of srun), so even a usage
error found before ``MPI_Init`` is printed by rank 0 alone.
"""
from __future__ import annotations

import logging
import os
import sys
from typing import Callable

LOGGER_NAME = "hpcpar"
RANK_VARIABLES = ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "SLURM_PROCID")
SIZE_VARIABLES = ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "SLURM_NTASKS")
LEVELS = ("debug", "info", "warning", "error")


def _mpi_world():
    """COMM_WORLD when MPI has already started in this process (never starts it)."""
    module = sys.modules.get("mpi4py.MPI")
    if module is not None and module.Is_initialized() and not module.Is_finalized():
        return module.COMM_WORLD
    return None


def _world_fact(ask_mpi, variables, default: int) -> int:
    """MPI's answer once MPI has started, else the first launcher variable set, else ``default``."""
    world = _mpi_world()
    if world is not None:
        return ask_mpi(world)
    return next((int(os.environ[name]) for name in variables if os.environ.get(name, "").isdigit()), default)


def world_rank() -> int:
    """This process's rank in the job: MPI's answer once started, else the launcher's, else 0."""
    return _world_fact(lambda world: world.Get_rank(), RANK_VARIABLES, 0)


def world_size() -> int:
    return _world_fact(lambda world: world.Get_size(), SIZE_VARIABLES, 1)


def parse_ranks(text: str) -> frozenset[int] | None:
    """``"all"`` -> None (every rank); ``"0,3"`` -> {0, 3}; anything else raises ValueError."""
    text = text.strip()
    if text == "all":
        return None
    try:
        ranks = frozenset(int(part) for part in text.split(","))
    except ValueError:
        ranks = frozenset({-1})
    if not ranks or min(ranks) < 0:
        raise ValueError(f"log ranks must be 'all' or comma-separated ranks like 0,3; got {text!r}")
    return ranks


class _Console(logging.Handler):
    """INFO and below to stdout, WARNING and above to stderr, or all through ``writer`` when set.

    A live progress bar sets ``writer`` so that lines are printed above the bar, never glued
    to it; the streams are looked up at each record, so captured or replaced streams work.
    """

    writer: Callable[[str, int], None] | None = None

    def emit(self, record: logging.LogRecord) -> None:
        try:
            text = self.format(record)
            if _Console.writer is not None:
                _Console.writer(text, record.levelno)
                return
            stream = sys.stderr if record.levelno >= logging.WARNING else sys.stdout
            stream.write(text + "\n")
            stream.flush()
        except Exception:  # noqa: BLE001 - logging must never end the job
            self.handleError(record)


class _RankFormat(logging.Formatter):
    def __init__(self, prefix: str):
        super().__init__()
        self.prefix = prefix

    def format(self, record: logging.LogRecord) -> str:
        text = record.getMessage()
        if record.exc_info:
            text += "\n" + self.formatException(record.exc_info)
        if record.levelno >= logging.WARNING:
            text = f"{record.levelname.lower()}: {text}"
        return "\n".join(self.prefix + line for line in text.splitlines()) if self.prefix else text


def configure(level: str | None = None, ranks: str | None = None) -> bool:
    """Set up the ``hpcpar`` logger for this process; returns whether this rank prints.

    ``level``: debug | info | warning | error (default ``HPCPAR_LOG_LEVEL`` or info).
    ``ranks``: "all" or "0,3" (default ``HPCPAR_LOG_RANKS`` or "0"). Ranks not chosen print
    errors only. With more than one rank printing, each line starts with ``[rank R]``.
    """
    level = (level or os.environ.get("HPCPAR_LOG_LEVEL") or "info").lower()
    if level not in LEVELS:
        raise ValueError(f"log level must be one of {', '.join(LEVELS)}; got {level!r}")
    chosen = parse_ranks(ranks or os.environ.get("HPCPAR_LOG_RANKS") or "0")
    rank, size = world_rank(), world_size()
    prints = chosen is None or rank in chosen
    several = size > 1 and (chosen is None or len(chosen) > 1)
    logger = logging.getLogger(LOGGER_NAME)
    for handler in [h for h in logger.handlers if isinstance(h, _Console)]:
        logger.removeHandler(handler)
    handler = _Console()
    handler.setFormatter(_RankFormat(f"[rank {rank}] " if several or not prints else ""))
    logger.addHandler(handler)
    logger.setLevel(getattr(logging, level.upper()) if prints else logging.ERROR)
    logger.propagate = False
    return prints


def ensure_configured() -> None:
    """``configure()`` with the defaults, unless the ``hpcpar`` logger already has handlers (the
    command's, or the application's own); called by ``hpcpar.init``."""
    if not logging.getLogger(LOGGER_NAME).handlers:
        configure()


def get_logger(name: str) -> logging.Logger:
    """The logger of an hpcpar module (``__name__``), under the ``hpcpar`` logger."""
    return logging.getLogger(name if name.startswith(LOGGER_NAME) else f"{LOGGER_NAME}.{name}")


def set_console_writer(writer: Callable[[str, int], None] | None) -> None:
    """Route configured log lines through ``writer(text, level)`` (a progress bar's), or back (None)."""
    _Console.writer = writer
