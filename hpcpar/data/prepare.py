"""``hpcpar data prepare``: text files -> an HDF5 file of byte tokens, split into train and val.

    hpcpar data prepare                                  # 8 MB of the Python standard library -> data/stdlib.h5
    hpcpar data prepare --out data/mine.h5 --max-mb 64 notes/*.txt

The file holds two 1-D uint8 datasets, ``train`` (the first 1 - val_fraction of the text)
and ``val`` (the rest), one byte per token, plus attributes: ``vocab_size`` (256),
``source``, ``num_files``, ``num_tokens``, ``val_fraction`` and ``sha256`` of all the
bytes, and a ``files`` dataset naming the files read in order. Plain h5py reads it. It is
written to ``OUT.tmp`` and renamed, so a crash never leaves a half-written OUT.
"""
from __future__ import annotations

import hashlib
import os
import sys
import sysconfig

import h5py
import numpy as np

from .. import log
from ..paths import input_problem, output_problem
from .corpus import read_text_bytes, stdlib_files

FORMAT = "hpcpar-tokens"
VOCAB_SIZE = 256
# A compressed file's bytes would be tokenized as they are, noise to the model: refused, with the fix.
COMPRESSED = {b"\x1f\x8b": ("gzip", "gunzip -k"), b"BZh": ("bzip2", "bunzip2 -k"),
              b"\xfd7zXZ\x00": ("xz", "unxz -k"), b"\x28\xb5\x2f\xfd": ("zstd", "unzstd"),
              b"PK\x03\x04": ("zip", "unzip")}


def compression_of(path: str) -> tuple[str, str] | None:
    """(format, the command that decompresses it) when ``path`` starts with a compressed format's magic."""
    with open(path, "rb") as f:
        head = f.read(8)
    return next((found for magic, found in COMPRESSED.items() if head.startswith(magic)), None)


def files_used(paths: list[str], max_bytes: int | None) -> list[str]:
    """The prefix of ``paths`` that ``read_text_bytes(paths, max_bytes)`` reads."""
    used, total = [], 0
    for path in paths:
        if max_bytes is not None and total >= max_bytes:
            break
        used.append(path)
        total += os.path.getsize(path)
    return used


def prepare(out: str, paths: list[str] | None = None, max_mb: float | None = 8, val_fraction: float = 0.05) -> dict:
    """Write the token file ``out`` from ``paths`` (default: the standard library).

    Returns the file's attributes plus ``train_tokens`` and ``val_tokens``."""
    if not 0 < val_fraction < 1:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
    if max_mb is not None and not 0 < max_mb < float("inf"):  # nan too
        raise ValueError(f"max_mb must be a number > 0, got {max_mb}")
    if problem := output_problem(out):  # before any text is read: it may be 8 MB of it
        raise ValueError(f"{out!r} {problem}")
    if paths:
        for path in paths:
            check_text_file(path, out)
        source = f"{len(paths)} file(s) given"
    else:
        paths = stdlib_files()
        source = f"Python {sys.version.split()[0]} standard library at {sysconfig.get_paths()['stdlib']}"
    max_bytes = None if max_mb is None else int(max_mb * (1 << 20))
    used = files_used(paths, max_bytes)
    tokens = read_text_bytes(used, max_bytes)
    n_val = max(1, int(round(len(tokens) * val_fraction)))
    if len(tokens) - n_val < 1:
        raise ValueError(f"{len(tokens)} bytes of text are too few to split into train and val")
    attrs = {"format": FORMAT, "vocab_size": VOCAB_SIZE, "source": source, "num_files": len(used),
             "num_tokens": len(tokens), "val_fraction": val_fraction,
             "sha256": hashlib.sha256(tokens.tobytes()).hexdigest()}
    write_token_file(out, tokens, n_val, used, attrs)
    return {**attrs, "train_tokens": len(tokens) - n_val, "val_tokens": n_val}


def check_text_file(path: str, out: str) -> None:
    """Raise the error that says why ``path`` cannot be read as text into ``out``, if there is one."""
    if os.path.isdir(path):
        raise IsADirectoryError(f"{path!r} is a folder; give its files (e.g. {path}/*.txt)")
    problem = input_problem(path)
    if problem == "does not exist":
        raise FileNotFoundError(f"no such file {path!r}")
    if problem:
        raise ValueError(f"{path!r} {problem}; give a text file")
    if os.path.exists(out) and os.path.samefile(path, out):
        raise ValueError(f"{out!r} is both the output and one of the text files; write another file")
    compressed = compression_of(path)
    if compressed:
        raise ValueError(f"{path!r} is {compressed[0]}-compressed; tokens are the bytes of plain text: "
                         f"decompress it first ({compressed[1]} {path})")


def write_token_file(out: str, tokens, n_val: int, used: list[str], attrs: dict) -> None:
    """``out`` with the last ``n_val`` tokens as ``val``, written to ``OUT.tmp``, fsynced and renamed."""
    folder = os.path.dirname(os.path.abspath(out))
    os.makedirs(folder, exist_ok=True)
    tmp = f"{out}.tmp"
    try:
        with h5py.File(tmp, "w") as f:
            f.create_dataset("train", data=tokens[: len(tokens) - n_val])
            f.create_dataset("val", data=tokens[len(tokens) - n_val:])
            f.create_dataset("files", data=np.array(used, dtype=object), dtype=h5py.string_dtype())
            f.attrs.update(attrs)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, out)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
    descriptor = os.open(folder, os.O_RDONLY)  # the rename is durable once the folder is synced
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def ensure_prepared(path: str, comm=None, announce=None, **options) -> None:
    """Make ``path`` if it is missing: rank 0 of ``comm`` (an hpcpar Communicator) prepares, and
    every rank learns the outcome, so a failure is raised on all ranks instead of leaving some waiting.
    ``announce(text)`` (rank 0) is told what is made, before and after."""
    error = None
    if comm is None or comm.rank == 0:
        if not os.path.exists(path):
            try:
                if announce:
                    source = f"{len(options['paths'])} file(s)" if options.get("paths") else "the Python standard library"
                    announce(f"{path} is missing: preparing it once from {source} (as `hpcpar data prepare "
                             f"--out {path}` does)")
                made = prepare(path, **options)
                if announce:
                    announce(f"wrote {path}: {made['num_tokens']:,} byte tokens from {made['num_files']} files")
            except Exception as err:  # noqa: BLE001 - re-raised below, on every rank
                error = f"preparing {path} failed: {type(err).__name__}: {err}"
    if comm is not None and comm.size > 1:
        error = comm.bcast_object(error, root=0)
    if error:
        raise RuntimeError(error)


def add_arguments(parser) -> None:
    """``hpcpar data``: its actions (``prepare``) and their options."""
    actions = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
    text = "text files (default: the Python standard library) -> HDF5 byte tokens, train/val"
    prepare_parser = actions.add_parser(
        "prepare", help=text,
        description="Concatenate text files as bytes (one byte = one token) into OUT with datasets train\n"
                    "and val; the default text is the Python standard library's own source. Compressed\n"
                    "files (gzip, bzip2, xz, zstd, zip) are refused: decompress them first.")
    prepare_parser.add_argument("--out", default="data/stdlib.h5", help="the HDF5 file to write")
    prepare_parser.add_argument("--max-mb", type=float, default=8, help="read at most this many MiB")
    prepare_parser.add_argument("--val-fraction", type=float, default=0.05,
                                help="the last share of the bytes held out for validation")
    prepare_parser.add_argument("paths", nargs="*", metavar="PATH", help="text files, in order (default: the stdlib)")
    prepare_parser.set_defaults(func=main)


def main(args) -> int:
    """``hpcpar data prepare``: 0 on success, 2 with a one-line message on bad input. Serial: started by
    mpiexec, rank 0 alone writes and speaks (every rank writing OUT.tmp at once failed, each saying so)."""
    if log.world_rank() != 0:
        return 0
    try:
        made = prepare(args.out, args.paths, args.max_mb, args.val_fraction)
    except (OSError, ValueError) as err:
        print(f"hpcpar data prepare: error: {err}", file=sys.stderr)
        return 2
    print(f"wrote {args.out}: {made['num_tokens']:,} byte tokens from {made['num_files']} files "
          f"({made['source']}), train {made['train_tokens']:,} / val {made['val_tokens']:,}, "
          f"sha256 {made['sha256'][:16]}")
    return 0
