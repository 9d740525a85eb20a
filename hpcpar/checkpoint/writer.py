"""Sharded, atomic HDF5 checkpoints written by every rank in parallel.

    save("ckpt", step, model, optimizer, ctx, extra={"schedule": schedule, "data": batches})

1. Every rank lists the pieces it holds; one small all-gather of their descriptions lets
   each (tensor, slab) be written by exactly one of the ranks holding it, chosen to even
   out the bytes per rank (replicas share the writing; nothing goes through rank 0).
2. Each rank writes its pieces to ``step-N.tmp/shard-R.h5`` and fsyncs it.
3. Rank 0 gathers the file facts (names, sizes, CRC-32), writes ``index.h5`` (a virtual
   dataset per tensor at its global shape) and ``manifest.json``, renames the folder to
   ``step-N``, fsyncs the root, points ``latest`` at it, and removes all but the last ``keep``.
A crash at any moment leaves at worst a ``.tmp`` folder that nothing reads.

``extra`` maps names to objects with ``state_dict()`` (schedule, loss scaler, sampler: the
same on every rank), NumPy Generators (random streams, saved per rank), or plain JSON values.
With ``asynchronous=True`` the state is first copied to host memory, then written and
committed by a background thread on its own communicator; call ``wait()`` before the next
save (``save`` does) and before exit (registered with atexit). With ``collective=True``, where
h5py is built against parallel HDF5, all ranks write one ``shared.h5`` with ``driver="mpio"``
instead of a file each (PyPI's h5py is serial: then it is a clear error).
"""
from __future__ import annotations

import atexit
import io
import json
import os
import shutil
import threading
import time
import zlib

import h5py
import numpy as np

from ..backend import to_host
from ..dist.waiting import wait_politely
from .manifest import (FORMAT, INDEX, LATEST, MANIFEST, SHARED_FILE, VERSION, CheckpointError, fsync_path,
                       list_steps, shard_filename, step_dirname, sync_and_checksum, write_json_atomically)
from ..state import checkpointable, slab_slices


def split_extra(extra: dict | None) -> tuple[dict, dict]:
    """(shared JSON state, this rank's random-stream states) from the ``extra`` mapping."""
    shared, per_rank = {}, {}
    for name, value in (extra or {}).items():
        if isinstance(value, np.random.Generator):
            per_rank[name] = value.bit_generator.state
        elif hasattr(value, "state_dict"):
            shared[name] = {"state_dict": value.state_dict()}
        else:
            shared[name] = {"value": value}
    json.dumps(shared)  # fail here, on every rank, if something is not JSON
    return shared, per_rank


class SaveJob:
    """One checkpoint: built on the calling thread, written by ``run`` (possibly on another)."""

    def __init__(self, root: str, step: int, model, optimizer, ctx, extra=None, keep: int | None = None,
                 copy: bool = False, collective: bool = False):
        if collective and not h5py.get_config().mpi:  # the same verdict on every rank, before any waits
            raise CheckpointError("collective=True writes one shared file with driver='mpio', which needs h5py "
                                  "built against parallel HDF5 (h5py.get_config().mpi is False here); the "
                                  "default file-per-rank layout works everywhere")
        self.collective = collective
        pieces, self.scalars = checkpointable(model).checkpoint_pieces()
        if optimizer is not None:
            opt_pieces, opt_scalars = checkpointable(optimizer).checkpoint_pieces()
            pieces += opt_pieces
            self.scalars.update(opt_scalars)
        for piece in pieces:
            if piece.array.dtype.kind not in "fiub":
                raise CheckpointError(f"{piece.key}: dtype {piece.array.dtype} cannot be stored in HDF5; "
                                      "checkpoint float32 master weights instead")
        self.root, self.step, self.keep = root, step, keep
        self.layout = ctx.layout
        self.rank, self.world_size = ctx.rank, ctx.world_size
        self.shared_extra, self.rank_state = split_extra(extra)
        self.step_dir = os.path.join(root, step_dirname(step))
        self.tmp_dir = self.step_dir + ".tmp"

        if self.rank == 0:  # a folder left by a save that died is stale: start clean
            shutil.rmtree(self.tmp_dir, ignore_errors=True)
            os.makedirs(self.tmp_dir)
        described = [(p.key, p.slab, p.global_shape, str(p.array.dtype)) for p in pieces]
        gathered = ctx.world.allgather_object((described, self.scalars))  # also the barrier after mkdir
        everyone = [entries for entries, _ in gathered]
        for _, scalars in gathered:  # ZeRO ranks each know the step counts of their own parameters
            self.scalars.update(scalars)
        owner, load = assign_writers(everyone)
        # index.h5 needs only the plan, not the data: the rank with the fewest bytes to write
        # makes it while the others write their shards.
        self.index_writer = min(range(len(everyone)), key=lambda r: (load[r], -r))  # ties: not rank 0, which commits
        self.tensors = (_tensor_table(everyone, owner, SHARED_FILE if collective else None)
                        if collective or self.rank in (0, self.index_writer) else None)
        mine = [p for p in pieces if owner[(p.key, p.slab)] == self.rank]
        # Host arrays to write: copies when the writer runs later (async), views otherwise.
        self.pieces = [(p, np.array(to_host(p.array), copy=True) if copy else to_host(p.array)) for p in mine]

    def run(self, comm) -> str:
        """Write this rank's shard, then commit on rank 0; collective over ``comm``."""
        start = time.perf_counter()
        facts = {"files": {}, "rank_state": self.rank_state, "error": None}
        try:
            if self.rank == self.index_writer:
                facts["files"][INDEX] = self._write_index()
            if self.collective:
                self._write_shared_file(comm, facts)
            else:
                self._write_shard(facts)
        except (OSError, ValueError, RuntimeError) as exc:  # a full disk, a quota: every rank must hear of it
            facts["error"] = f"rank {self.rank}: {type(exc).__name__}: {exc}"
        # Ranks finish their shards at different times; waiting politely first keeps the early
        # ones from spinning in gather on the cores the late ones still write from.
        wait_politely(comm.Ibarrier())
        gathered = comm.gather(facts, root=0)
        error = None
        if self.rank == 0:
            failed = [f["error"] for f in gathered if f["error"]]
            try:
                if failed:  # nothing is committed: the previous checkpoint stays the latest
                    shutil.rmtree(self.tmp_dir, ignore_errors=True)
                    raise CheckpointError("; ".join(failed))
                self._commit(gathered)
            except Exception as exc:  # noqa: BLE001 - reported on every rank below
                error = str(exc) if isinstance(exc, CheckpointError) else f"{type(exc).__name__}: {exc}"
        wait_politely(comm.Ibarrier())  # while rank 0 commits
        error = comm.bcast(error, root=0)
        if error:
            raise CheckpointError(f"checkpoint {self.step_dir} was not committed: {error}")
        self.seconds = time.perf_counter() - start
        return self.step_dir

    def _write_shard(self, facts: dict) -> None:
        name = shard_filename(self.rank)
        path = os.path.join(self.tmp_dir, name)
        with h5py.File(path, "w", libver="latest") as f:
            for n, (piece, array) in enumerate(self.pieces):
                write_dataset(f, dataset_name(n, piece.key), array)
        facts["files"][name] = sync_and_checksum(path)

    def _write_shared_file(self, comm, facts: dict) -> None:
        """All pieces in one file written collectively (``driver="mpio"``, parallel HDF5 only).

        Creating datasets is collective in parallel HDF5: every rank creates every piece's
        dataset in the same order (from the plan); then each writes its own pieces' data.
        """
        path = os.path.join(self.tmp_dir, SHARED_FILE)
        mine = {(piece.key, piece.slab): array for piece, array in self.pieces}
        with h5py.File(path, "w", driver="mpio", comm=comm) as f:
            for key, table in self.tensors.items():
                for piece in table["pieces"]:
                    slab = tuple(map(tuple, piece["slab"]))
                    dataset = f.create_dataset(piece["dataset"], shape=tuple(b - a for a, b in slab),
                                               dtype=table["dtype"])
                    if (key, slab) in mine:
                        dataset[...] = mine[(key, slab)]
        if self.rank == 0:
            facts["files"][SHARED_FILE] = sync_and_checksum(path)

    # ----- the index writer and rank 0 --------------------------------------------------
    def _write_index(self) -> dict:
        """index.h5: one virtual dataset per tensor at its global shape, over the planned shard datasets."""
        plan = json.dumps([self.layout, self.tensors], sort_keys=True)
        if plan not in _index_images:  # the index depends on the plan only: built once per layout
            _index_images.clear()
            _index_images[plan] = index_image(self.tensors, self.layout)
        image = _index_images[plan]
        index_path = os.path.join(self.tmp_dir, INDEX)
        with open(index_path, "wb") as f:
            f.write(image)
            f.flush()
            os.fsync(f.fileno())
        return {"bytes": len(image), "crc32": f"{zlib.crc32(image):08x}"}

    def _commit(self, gathered: list) -> None:
        files, rank_state = {}, {}
        for rank, facts in enumerate(gathered):
            files.update(facts["files"])
            rank_state[str(rank)] = facts["rank_state"]

        manifest = {"format": FORMAT, "version": VERSION, "step": self.step, "layout": self.layout,
                    "created": time.time(), "tensors": self.tensors, "scalars": self.scalars,
                    "files": files, "extra": self.shared_extra, "rank_state": rank_state}
        write_json_atomically(os.path.join(self.tmp_dir, MANIFEST), manifest)
        fsync_path(self.tmp_dir)
        replaced = self.step_dir + ".old"
        if os.path.exists(self.step_dir):  # re-saving a step: the old copy goes once the new one is in place
            shutil.rmtree(replaced, ignore_errors=True)
            os.rename(self.step_dir, replaced)
        os.rename(self.tmp_dir, self.step_dir)
        fsync_path(self.root)
        shutil.rmtree(replaced, ignore_errors=True)
        latest_tmp = os.path.join(self.root, LATEST + ".tmp")
        with open(latest_tmp, "w") as f:
            f.write(step_dirname(self.step) + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(latest_tmp, os.path.join(self.root, LATEST))
        fsync_path(self.root)
        if self.keep:
            for old in list_steps(self.root)[:-self.keep]:
                shutil.rmtree(os.path.join(self.root, step_dirname(old)), ignore_errors=True)


_index_images: dict = {}  # plan -> the bytes of its index.h5


def index_image(tensors: dict, layout: dict) -> bytes:
    """The bytes of index.h5: one virtual dataset per tensor at its global shape over the shard datasets.

    Source files are named relative to the index, so the same bytes serve every step (and
    the folder can be moved or copied as a whole); creating the virtual datasets costs
    ~0.4 ms each, which made up half of a save before the image was reused.
    """
    buffer = io.BytesIO()
    with h5py.File(buffer, "w", libver="latest") as index:
        index.attrs["layout"] = json.dumps(layout)
        for key, table in tensors.items():
            virtual = h5py.VirtualLayout(shape=tuple(table["shape"]), dtype=table["dtype"])
            for piece in table["pieces"]:
                shape = tuple(stop - start for start, stop in piece["slab"])
                virtual[slab_slices(piece["slab"])] = h5py.VirtualSource(piece["file"], piece["dataset"], shape=shape)
            index.create_virtual_dataset(key, virtual)
    return buffer.getvalue()


def assign_writers(everyone: list) -> dict:
    """``({(key, slab): rank}, bytes per rank)``: one writer per distinct piece, evening out the bytes.

    Largest pieces first, each to the holder with the fewest bytes so far (ties: lowest rank),
    so data-parallel replicas split the writing instead of rank 0 writing everything.
    """
    holders: dict = {}
    sizes: dict = {}
    for rank, entries in enumerate(everyone):
        for key, slab, _, dtype in entries:
            piece = (key, tuple(map(tuple, slab)))
            holders.setdefault(piece, []).append(rank)
            sizes[piece] = int(np.prod([b - a for a, b in piece[1]])) * np.dtype(dtype).itemsize
    load = [0] * len(everyone)
    owner = {}
    for piece in sorted(holders, key=lambda p: (-sizes[p], p[0])):
        rank = min(holders[piece], key=lambda r: (load[r], r))
        owner[piece] = rank
        load[rank] += sizes[piece]
    return owner, load


def write_dataset(file, name: str, array: np.ndarray) -> None:
    """A contiguous dataset holding ``array``, through h5py's low-level API: a third of the
    per-dataset cost of ``create_dataset``, which dominated the save of a small model."""
    array = np.ascontiguousarray(array)
    space = h5py.h5s.create_simple(array.shape) if array.ndim else h5py.h5s.create(h5py.h5s.SCALAR)
    dataset = h5py.h5d.create(file.id, name.encode(), h5py.h5t.py_create(array.dtype), space)
    if array.size:
        dataset.write(h5py.h5s.ALL, h5py.h5s.ALL, array)


def dataset_name(n: int, key: str) -> str:
    """The name of a rank's n-th piece in its shard file: flat, in the root group (creating the
    intermediate groups of "model/x/y" took half the time of a save; index.h5 has the hierarchy)."""
    return f"{n:05d}:{key.replace('/', '|')}"


def _tensor_table(everyone: list, owner: dict, shared_file: str | None = None) -> dict:
    """``{key: {shape, dtype, pieces: [{slab, rank, file, dataset}]}}``, each distinct slab once; checks coverage.

    The dataset names are the ones each writer will give its pieces (in its own order), in its
    shard file, or in ``shared_file`` when all ranks write one file collectively.
    """
    tensors = {}
    for rank, entries in enumerate(everyone):
        written = 0 if shared_file is None else sum(1 for e in everyone[:rank] for _ in e)  # unique names
        for key, slab, shape, dtype in entries:
            table = tensors.setdefault(key, {"shape": list(shape), "dtype": dtype, "pieces": []})
            if list(shape) != table["shape"]:
                raise CheckpointError(f"{key}: ranks disagree on its global shape ({table['shape']} vs {list(shape)})")
            slab = tuple(map(tuple, slab))
            if owner[(key, slab)] == rank:
                table["pieces"].append({"slab": [list(s) for s in slab], "rank": rank,
                                        "file": shared_file or shard_filename(rank),
                                        "dataset": dataset_name(written, key)})
                written += 1
    for key, table in tensors.items():
        covered = sum(int(np.prod([b - a for a, b in p["slab"]])) for p in table["pieces"])
        if covered != int(np.prod(table["shape"])):
            raise CheckpointError(f"{key}: the pieces held by the ranks cover {covered} of "
                                  f"{int(np.prod(table['shape']))} elements (overlapping or missing shards)")
    return tensors


# ----------------------------------------------------------------------------------------
# Entry points
# ----------------------------------------------------------------------------------------
_pending: list = []
_async_comm = {}


class AsyncSave:
    def __init__(self, thread: threading.Thread, job: SaveJob):
        self.thread, self.job, self.error = thread, job, None

    def __str__(self) -> str:
        return f"{self.job.step_dir} (being written in the background)"

    def wait(self) -> str:
        self.thread.join()
        if self in _pending:
            _pending.remove(self)
        if self.error is not None:
            raise self.error
        return self.job.step_dir


def wait() -> None:
    """Block until every asynchronous save of this process is committed."""
    for handle in list(_pending):
        handle.wait()


atexit.register(wait)


def save(root: str, step: int, model, optimizer, ctx, extra: dict | None = None, keep: int | None = None,
         asynchronous: bool = False, collective: bool = False):
    """Write a checkpoint of ``model`` and ``optimizer`` (Checkpointables of ``hpcpar.state``, or
    (name, param) pairs; ``optimizer`` may be None); collective over ``ctx.world``.

    Returns the committed step folder, or an ``AsyncSave`` whose ``wait()`` returns it.
    """
    wait()  # one save at a time: the previous asynchronous one must be committed first
    if ctx.rank == 0:
        os.makedirs(root, exist_ok=True)
    job = SaveJob(root, step, model, optimizer, ctx, extra, keep, copy=asynchronous, collective=collective)
    if not asynchronous:
        return job.run(ctx.world.mpi)
    comm = _async_comm.get(id(ctx.world.mpi))
    if comm is None:  # the writer thread gets its own communicator: no mixing with training's collectives
        comm = _async_comm[id(ctx.world.mpi)] = ctx.world.mpi.Dup()

    def write():
        try:
            job.run(comm)
        except BaseException as error:  # noqa: BLE001 - re-raised by wait() on the caller's thread
            handle.error = error

    thread = threading.Thread(target=write, name=f"hpcpar-checkpoint-{step}", daemon=False)
    handle = AsyncSave(thread, job)
    _pending.append(handle)
    thread.start()
    return handle
