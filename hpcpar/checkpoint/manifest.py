"""The checkpoint folder: names, the JSON manifest, checksums, and verification.

    ckpt/
      latest                  "step-00000200" (replaced atomically)
      step-00000100/
        manifest.json         format version, layout, step, tensors and their pieces, file checksums
        index.h5              one virtual dataset per tensor at its global shape (any HDF5 >= 1.10 reads it)
        shard-00000.h5 ...    the pieces each rank wrote: one flat dataset per dtype, the pieces end to
                              end (or shared.h5, written collectively with driver="mpio" where h5py
                              has parallel HDF5: save(..., collective=True), a dataset per piece)
      step-00000200.tmp/      a save in progress or one that died: never read

No pickle anywhere: arrays live in HDF5, everything else is JSON.
"""
from __future__ import annotations

import json
import math
import mmap
import os
import re
import threading

import numpy as np

from .crc import crc32, crc32_chunks_and_nonfinite

FORMAT = "hpcpar-checkpoint"
VERSION = 2  # 2: flat datasets per dtype, pieces at byte offsets, CRC-32 per MiB of each file
READABLE_VERSIONS = (1, 2)  # 1: a dataset per piece, one CRC-32 per file (still loaded)
CHUNK_BYTES = 1 << 20  # the unit of checksums: a load verifies exactly the MiBs it reads
MANIFEST = "manifest.json"
INDEX = "index.h5"
SHARED_FILE = "shared.h5"  # the one file of a collective (driver="mpio") save, instead of shard-R.h5
LATEST = "latest"
STEP_PATTERN = re.compile(r"^step-(\d{8})$")


class CheckpointError(RuntimeError):
    """A checkpoint is missing, damaged or does not fit the model; the message names the file."""


class CheckpointDamaged(CheckpointError):
    """The checkpoint's files are damaged: missing, truncated, a wrong checksum, an unreadable
    manifest. ``load_latest`` falls back to the previous step on this error only; any other
    ``CheckpointError`` (a tensor of another shape, name or dtype) is a mismatch, never skipped."""


class NonFiniteCheckpoint(CheckpointError):
    """A save refused because a floating tensor holds inf or NaN: nothing was committed, ``latest``
    still names the previous step (a diverged run never replaces good checkpoints)."""


def step_dirname(step: int) -> str:
    return f"step-{step:08d}"


def shard_filename(rank: int) -> str:
    return f"shard-{rank:05d}.h5"


def file_checksum(path: str, chunk: int = 8 << 20) -> str:
    """CRC-32 of the file's bytes (catches truncation and flipped bytes; not a security hash)."""
    crc = 0
    with open(path, "rb") as f:
        while block := f.read(chunk):
            crc = crc32(block, crc)
    return f"{crc:08x}"


def chunk_checksums(data) -> list[str]:
    """CRC-32 of each ``CHUNK_BYTES`` of ``data`` (bytes-like), the last chunk possibly shorter."""
    view = memoryview(data).cast("B")
    return [f"{crc32(view[at: at + CHUNK_BYTES]):08x}" for at in range(0, len(view), CHUNK_BYTES)]


def file_chunk_checksums(path: str, floats: list = ()) -> tuple[list[str], list[int]]:
    """(CRC-32 of each MiB of the file, how many values of each float range are inf or NaN), in
    one pass over the file's pages (``crc.crc32_chunks_and_nonfinite``); ``floats``: (first byte,
    element count, dtype name) of the float pieces it holds, sorted by first byte."""
    if not os.path.getsize(path):
        return [], [0] * len(floats)
    with open(path, "rb") as f:
        try:
            mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except OSError:  # a file system that cannot map files: read it whole instead
            crcs, bad = crc32_chunks_and_nonfinite(np.fromfile(f, dtype=np.uint8), CHUNK_BYTES, list(floats))
        else:
            with mapped:
                data = np.frombuffer(mapped, dtype=np.uint8)
                try:
                    crcs, bad = crc32_chunks_and_nonfinite(data, CHUNK_BYTES, list(floats))
                finally:
                    del data  # the mapping closes only once no array refers to it (an error stays the error)
    return [f"{c:08x}" for c in crcs], bad


def sync_and_checksum(path: str, floats: list = ()) -> dict:
    """fsync a just-written file and take its size, the CRC-32 of each MiB and the count of inf
    and NaN values in each of its ``floats`` ranges (``file_chunk_checksums``), all at once.

    The CRCs read the file back from the page cache while fsync pushes it to the disk; both
    release the GIL, so a thread for the fsync saves the shorter of the two from a save.
    """
    errors: list = []  # a failed fsync fails the save: the file may not be on the disk
    syncing = threading.Thread(target=_sync_into, args=(path, errors))
    syncing.start()
    crcs, bad = file_chunk_checksums(path, floats)
    syncing.join()
    if errors:
        raise errors[0]
    return {"bytes": os.path.getsize(path), "chunks": crcs, "nonfinite": bad}


def fsync_path(path: str) -> None:
    """fsync a file or a folder (a rename is durable only once its folder is synced)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _sync_into(path: str, errors: list) -> None:
    """``fsync_path`` for a thread: its error goes into ``errors`` for the caller to raise (an
    exception left in a thread is printed and lost, and the save would go on as if durable)."""
    try:
        fsync_path(path)
    except OSError as error:
        errors.append(error)


def fsync_together(*paths: str) -> None:
    """fsync several files or folders at once (one thread each but the first); raises the first error."""
    errors: list = []
    threads = [threading.Thread(target=_sync_into, args=(path, errors)) for path in paths[1:]]
    for thread in threads:
        thread.start()
    _sync_into(paths[0], errors)
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]


def read_manifest(step_dir: str) -> dict:
    path = os.path.join(step_dir, MANIFEST)
    try:  # bytes to json.loads: no text layer (a load reads this on every rank, every time)
        with open(path, "rb") as f:
            manifest = json.loads(f.read())
    except FileNotFoundError:
        raise CheckpointDamaged(f"{path}: no manifest (an unfinished or foreign checkpoint)") from None
    except (OSError, ValueError) as error:
        raise CheckpointDamaged(f"{path}: unreadable manifest ({error})") from None
    if not isinstance(manifest, dict):
        raise CheckpointDamaged(f"{path}: unreadable manifest (not a JSON object)")
    if manifest.get("format") != FORMAT or manifest.get("version") not in READABLE_VERSIONS:
        raise CheckpointError(f"{path}: format {manifest.get('format')!r} version {manifest.get('version')!r}, "
                              f"expected {FORMAT!r} version {' or '.join(map(str, READABLE_VERSIONS))}")
    return manifest


def verify_files(step_dir: str, manifest: dict, names=None, checksums: bool = True,
                 nonfinite: list | None = None) -> list[str]:
    """Problems with the listed files (all by default): missing, wrong size, wrong checksum
    (``checksums=False``: presence and size only). A ``nonfinite`` list gets a line for each
    tensor piece holding inf or NaN, found in the same pass as the checksums."""
    problems = []
    for name, facts in sorted(manifest["files"].items()):
        if names is not None and name not in names:
            continue
        path = os.path.join(step_dir, name)
        if not os.path.exists(path):
            problems.append(f"{path}: missing")
        elif os.path.getsize(path) != facts["bytes"]:
            problems.append(f"{path}: {os.path.getsize(path)} bytes, the manifest says {facts['bytes']} (truncated?)")
        elif checksums and "chunks" in facts:
            floats = float_pieces(manifest, name) if nonfinite is not None else []
            crcs, bad = file_chunk_checksums(path, [(start, size, dtype) for start, size, dtype, _ in floats])
            problems += chunk_problems(path, crcs, facts["chunks"], 0)
            if nonfinite is not None:
                nonfinite += [f"{key}: {n} of {size} values are inf or NaN ({path})"
                              for (_, size, _, key), n in zip(floats, bad) if n]
        elif checksums and file_checksum(path) != facts["crc32"]:
            problems.append(f"{path}: checksum {file_checksum(path)} != {facts['crc32']} in the manifest (damaged)")
    return problems


def must_be_finite(key: str, dtype) -> bool:
    """Whether a save refuses inf or NaN in tensor ``key``: every floating tensor but a gradient
    compressor's error feedback (``compression/...``), which is not a weight: it absorbs what a
    step overflowing under fp16 sent, and its own checks belong to the compressor."""
    return np.dtype(dtype).kind == "f" and not key.startswith("compression/")


def float_pieces(manifest: dict, name: str) -> list[tuple[int, int, str, str]]:
    """(first byte, elements, dtype, tensor key) of each floating piece that the shard ``name``
    holds (format 2: in its flat datasets), by first byte."""
    blobs, pieces = manifest["files"][name].get("blobs", {}), []
    for key, table in manifest["tensors"].items():
        dtype = np.dtype(table["dtype"])
        for piece in table["pieces"]:
            if must_be_finite(key, dtype) and piece.get("file") == name and blobs.get(piece.get("dataset")) is not None:
                size = math.prod(b - a for a, b in piece["slab"])
                pieces.append((blobs[piece["dataset"]] + piece["start"] * dtype.itemsize, size, dtype.name, key))
    return sorted(pieces)


def chunk_problems(path: str, found: list[str], expected: list[str], first: int) -> list[str]:
    """One line per chunk whose CRC-32 differs (``found`` are chunks ``first``, ``first + 1``...)."""
    return [f"{path}: checksum {crc} != {expected[first + n]} in the manifest for bytes "
            f"{(first + n) * CHUNK_BYTES}..{(first + n + 1) * CHUNK_BYTES} (damaged)"
            for n, crc in enumerate(found) if crc != expected[first + n]]


def list_steps(root: str) -> list[int]:
    """Committed steps under ``root``, oldest first (``.tmp`` folders are never listed)."""
    if not os.path.isdir(root):
        return []
    return sorted(int(m.group(1)) for name in os.listdir(root) if (m := STEP_PATTERN.match(name)))


def checkpoint_name_of(path: str, root: str) -> str | None:
    """The name in the checkpoint root ``root`` that ``path`` is or lies inside, where it is one
    the checkpoint writes: ``latest`` or ``latest.tmp`` (a file there is read as, or replaced by,
    the pointer), a step folder or its ``.tmp`` (removed with a retired step); "." for the root
    itself. None for any other path."""
    relative = os.path.relpath(os.path.realpath(path), os.path.realpath(root))
    first = relative.split(os.sep)[0]
    if relative == "." or first in (LATEST, LATEST + ".tmp") or STEP_PATTERN.match(first.removesuffix(".tmp")):
        return first
    return None


def latest_step(root: str) -> int | None:
    """The step ``latest`` names (the source of truth); the highest committed step only when
    ``latest`` is absent or unreadable (a root written before it, or by hand)."""
    try:  # bytes, no text layer: every load of a root reads this
        with open(os.path.join(root, LATEST), "rb") as f:
            match = STEP_PATTERN.match(f.read().decode(errors="replace").strip())
    except FileNotFoundError:
        match = None
    if match:
        return int(match.group(1))
    steps = list_steps(root)
    return steps[-1] if steps else None


def resolve_step_dir(path: str, step: int | None = None) -> str:
    """A step folder from a checkpoint root (``latest`` or ``step``) or a step folder itself; a file
    there is named as such (it was an errno line about PATH/latest)."""
    if os.path.lexists(path) and not os.path.isdir(path):
        raise CheckpointError(f"{path}: a file, not a folder; give a checkpoint root (checkpoint.dir) or a step folder")
    if step is None and (os.path.exists(os.path.join(path, MANIFEST)) or
                         (STEP_PATTERN.match(os.path.basename(os.path.normpath(path))) and os.path.isdir(path))):
        return path  # a step folder (one without a manifest fails as damaged when it is read)
    if step is None:
        step = latest_step(path)
        if step is None:
            raise CheckpointError(f"{path}: no committed checkpoint here")
    step_dir = os.path.join(path, step_dirname(step))
    if not os.path.isdir(step_dir):
        raise CheckpointError(f"{step_dir}: no such checkpoint (have steps {list_steps(path)})")
    return step_dir


# The grid's axes in its table order (hpcpar.runtime.grid.GRID, which this module cannot import:
# the checkpoint tools run without MPI); a manifest's keys are sorted.
AXES = ("dp", "pp", "tp", "cp")


def layout_words(layout: dict) -> str:
    """A recorded layout ({axis: size, "world": n}; cp only above 1) in words: "dp 2 x pp 1 x tp 1 x cp 2"."""
    return " x ".join(f"{name} {layout[name]}" for name in AXES if name in layout)
