"""The file side of a save: small files written and fsynced by a thread (``DurableFile``), flat
datasets allocated in a shard file and filled with ``pwritev`` at their offsets, the free space
of each rank's file system and the check that the planned bytes fit.

``writer`` runs the save as a transaction over the ranks; this module writes and measures its files.
"""
from __future__ import annotations

import os
import socket
import threading

import h5py
import numpy as np

# What a save may write besides its data: HDF5's headers per file, index.h5 and the manifest
# per piece. Generous on purpose: a refused save costs a warning, a full disk mid-write more.
MARGIN_BYTES = 1 << 20
MARGIN_PER_PIECE = 4096


class DurableFile:
    """A small file (index.h5, ``latest.tmp``) written and fsynced by a thread while the shards
    are written; ``path()`` waits for it (and raises its error)."""

    def __init__(self, path: str, data: bytes):
        self.file, self.data, self.error = path, data, None
        self.thread = threading.Thread(target=self._write)
        self.thread.start()

    def _write(self) -> None:
        try:
            with open(self.file, "wb") as f:
                f.write(self.data)
                f.flush()
                os.fsync(f.fileno())
        except OSError as error:
            self.error = error

    def path(self) -> str:
        self.thread.join()
        if self.error is not None:
            raise self.error
        return self.file

    def discard(self) -> None:
        self.thread.join()
        if os.path.exists(self.file):
            os.remove(self.file)


def allocate_flat_dataset(file, dtype: str, size: int) -> int | None:
    """Create the 1-D dataset ``dtype`` of ``size`` elements, its space allocated now and never
    filled (the caller writes every byte); its byte offset in the file (None when empty)."""
    plist = h5py.h5p.create(h5py.h5p.DATASET_CREATE)
    plist.set_alloc_time(h5py.h5d.ALLOC_TIME_EARLY)
    plist.set_fill_time(h5py.h5d.FILL_TIME_NEVER)
    space = h5py.h5s.create_simple((size,))
    dataset = h5py.h5d.create(file.id, dtype.encode(), h5py.h5t.py_create(np.dtype(dtype)), space, dcpl=plist)
    return dataset.get_offset() if size else None


def write_array(fd: int, arrays: list, offset: int) -> None:
    """Write contiguous arrays end to end from byte ``offset`` of the file (a full disk raises
    OSError): ``pwritev`` of up to 1024 at once, so the kernel sees large writes and keeps the
    bytes in large page-cache folios (per-array writes of small tensors leave 4 KiB pages, which
    a load then reads and maps at half the speed)."""
    views = [memoryview(array).cast("B") for array in arrays if array.size]
    for first in range(0, len(views), 1024):
        batch = views[first: first + 1024]
        while batch:
            written = os.pwritev(fd, batch, offset)
            if not written:
                raise OSError(28, "No space left on device (a write wrote nothing)")
            offset += written
            while batch and written >= batch[0].nbytes:  # a short write: go on where it stopped
                written -= batch[0].nbytes
                batch = batch[1:]
            if written:
                batch[0] = batch[0][written:]


def free_space(folder: str) -> dict:
    """Where this rank writes and how much room there is: the file system (host, fsid) and free
    bytes (None when it cannot be told: the writes will say)."""
    folder = os.path.abspath(folder)
    while not os.path.isdir(folder) and os.path.dirname(folder) != folder:
        folder = os.path.dirname(folder)  # rank 0 may not have made it yet: its parent tells the same
    try:
        stat = os.statvfs(folder)
    except OSError:
        return {"fs": (socket.gethostname(), None), "free": None}
    return {"fs": (socket.gethostname(), stat.f_fsid), "free": stat.f_bavail * stat.f_frsize}


def space_shortfalls(spaces: list, load: list, everyone: list) -> list[str]:
    """One line per file system (ranks that share one add up) where the planned bytes plus the
    margin exceed the free bytes, naming the ranks and the numbers; empty when all fit."""
    pieces = sum(len(entries) for entries in everyone)
    need: dict = {}
    for rank, space in enumerate(spaces):
        if space["free"] is None:
            continue
        extra = MARGIN_BYTES + MARGIN_PER_PIECE * (len(everyone[rank]) + (pieces if rank == 0 else 0) * 2)
        fs = need.setdefault(tuple(space["fs"]), {"ranks": [], "bytes": 0, "free": space["free"]})
        fs["ranks"].append(rank)
        fs["bytes"] += load[rank] + extra
        fs["free"] = min(fs["free"], space["free"])
    return [f"rank{'s' if len(fs['ranks']) > 1 else ''} {', '.join(map(str, fs['ranks']))} on {host} need "
            f"{fs['bytes']} bytes (data and a margin for metadata), {fs['free']} bytes are free"
            for (host, _), fs in need.items() if fs["bytes"] > fs["free"]]

