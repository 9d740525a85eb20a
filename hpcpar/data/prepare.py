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

from .corpus import read_text_bytes, stdlib_files

FORMAT = "hpcpar-tokens"
VOCAB_SIZE = 256


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
    if max_mb is not None and max_mb <= 0:
        raise ValueError(f"max_mb must be > 0, got {max_mb}")
    if paths:
        for path in paths:
            if os.path.isdir(path):
                raise IsADirectoryError(f"{path!r} is a folder; give its files (e.g. {path}/*.txt)")
            if not os.path.isfile(path):
                raise FileNotFoundError(f"no such file {path!r}")
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
    return {**attrs, "train_tokens": len(tokens) - n_val, "val_tokens": n_val}


def ensure_prepared(path: str, comm=None, **options) -> None:
    """Make ``path`` if it is missing: rank 0 of ``comm`` (an hpcpar Communicator) prepares, and
    every rank learns the outcome, so a failure is raised on all ranks instead of leaving some waiting."""
    error = None
    if comm is None or comm.rank == 0:
        if not os.path.exists(path):
            try:
                prepare(path, **options)
            except Exception as err:  # noqa: BLE001 - re-raised below, on every rank
                error = f"preparing {path} failed: {type(err).__name__}: {err}"
    if comm is not None and comm.size > 1:
        error = comm.bcast_object(error, root=0)
    if error:
        raise RuntimeError(error)


def main(args) -> int:
    """``hpcpar data prepare``: 0 on success, 2 with a one-line message on bad input."""
    try:
        made = prepare(args.out, args.paths, args.max_mb, args.val_fraction)
    except (OSError, ValueError) as err:
        print(f"hpcpar data prepare: error: {err}", file=sys.stderr)
        return 2
    print(f"wrote {args.out}: {made['num_tokens']:,} byte tokens from {made['num_files']} files "
          f"({made['source']}), train {made['train_tokens']:,} / val {made['val_tokens']:,}, "
          f"sha256 {made['sha256'][:16]}")
    return 0
