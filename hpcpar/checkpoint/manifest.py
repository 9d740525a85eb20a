"""The checkpoint folder: names, the JSON manifest, checksums, and verification.

    ckpt/
      latest                  "step-00000200" (replaced atomically)
      step-00000100/
        manifest.json         format version, layout, step, tensors and their pieces, file checksums
        index.h5              one virtual dataset per tensor at its global shape (plain h5py reads it)
        shard-00000.h5 ...    the pieces each rank wrote (or shared.h5, written collectively with
                              driver="mpio" where h5py has parallel HDF5: save(..., collective=True))
      step-00000200.tmp/      a save in progress or one that died: never read

No pickle anywhere: arrays live in HDF5, everything else is JSON.
"""
from __future__ import annotations

import json
import os
import re
import threading
import zlib

FORMAT = "hpcpar-checkpoint"
VERSION = 1
MANIFEST = "manifest.json"
INDEX = "index.h5"
SHARED_FILE = "shared.h5"  # the one file of a collective (driver="mpio") save, instead of shard-R.h5
LATEST = "latest"
STEP_PATTERN = re.compile(r"^step-(\d{8})$")


class CheckpointError(RuntimeError):
    """A checkpoint is missing, damaged or does not fit the model; the message names the file."""


def step_dirname(step: int) -> str:
    return f"step-{step:08d}"


def shard_filename(rank: int) -> str:
    return f"shard-{rank:05d}.h5"


def file_checksum(path: str, chunk: int = 8 << 20) -> str:
    """CRC-32 of the file's bytes (catches truncation and flipped bytes; not a security hash)."""
    crc = 0
    with open(path, "rb") as f:
        while block := f.read(chunk):
            crc = zlib.crc32(block, crc)
    return f"{crc:08x}"


def sync_and_checksum(path: str) -> dict:
    """fsync a just-written file and take its size and CRC-32, the two at once.

    The CRC reads the file back from the page cache while fsync pushes it to the disk; both
    release the GIL, so a thread for the fsync saves the shorter of the two from a save.
    """
    syncing = threading.Thread(target=fsync_path, args=(path,))
    syncing.start()
    crc = file_checksum(path)
    syncing.join()
    return {"bytes": os.path.getsize(path), "crc32": crc}


def fsync_path(path: str) -> None:
    """fsync a file or a folder (a rename is durable only once its folder is synced)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_json_atomically(path: str, data) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        f.write(json.dumps(data, sort_keys=True))  # dumps uses the C encoder; dump(f) the Python one
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def read_manifest(step_dir: str) -> dict:
    path = os.path.join(step_dir, MANIFEST)
    if not os.path.exists(path):
        raise CheckpointError(f"{path}: no manifest (an unfinished or foreign checkpoint)")
    try:
        with open(path) as f:
            manifest = json.load(f)
    except (OSError, ValueError) as error:
        raise CheckpointError(f"{path}: unreadable manifest ({error})") from None
    if manifest.get("format") != FORMAT or manifest.get("version") != VERSION:
        raise CheckpointError(f"{path}: format {manifest.get('format')!r} version {manifest.get('version')!r}, "
                              f"expected {FORMAT!r} version {VERSION}")
    return manifest


def verify_files(step_dir: str, manifest: dict, names=None) -> list[str]:
    """Problems with the listed files (all by default): missing, wrong size, wrong checksum."""
    problems = []
    for name, facts in sorted(manifest["files"].items()):
        if names is not None and name not in names:
            continue
        path = os.path.join(step_dir, name)
        if not os.path.exists(path):
            problems.append(f"{path}: missing")
        elif os.path.getsize(path) != facts["bytes"]:
            problems.append(f"{path}: {os.path.getsize(path)} bytes, the manifest says {facts['bytes']} (truncated?)")
        elif file_checksum(path) != facts["crc32"]:
            problems.append(f"{path}: checksum {file_checksum(path)} != {facts['crc32']} in the manifest (damaged)")
    return problems


def list_steps(root: str) -> list[int]:
    """Committed steps under ``root``, oldest first (``.tmp`` folders are never listed)."""
    if not os.path.isdir(root):
        return []
    return sorted(int(m.group(1)) for name in os.listdir(root) if (m := STEP_PATTERN.match(name)))


def latest_step(root: str) -> int | None:
    path = os.path.join(root, LATEST)
    if os.path.exists(path):
        with open(path) as f:
            match = STEP_PATTERN.match(f.read().strip())
        if match:
            return int(match.group(1))
    steps = list_steps(root)
    return steps[-1] if steps else None


def resolve_step_dir(path: str, step: int | None = None) -> str:
    """A step folder from a checkpoint root (``latest`` or ``step``) or a step folder itself."""
    if os.path.exists(os.path.join(path, MANIFEST)) and step is None:
        return path
    if step is None:
        step = latest_step(path)
        if step is None:
            raise CheckpointError(f"{path}: no committed checkpoint here")
    step_dir = os.path.join(path, step_dirname(step))
    if not os.path.isdir(step_dir):
        raise CheckpointError(f"{step_dir}: no such checkpoint (have steps {list_steps(path)})")
    return step_dir
