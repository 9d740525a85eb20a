"""Sharded, atomic HDF5 checkpoints written by every rank in parallel: a save as a transaction.

    save("ckpt", step, model, optimizer, ctx, extra={"schedule": schedule, "data": batches})

Every rank describes its pieces; one all-gather makes the plan (``save_plan``: each piece written
by one of the ranks holding it, the bytes evened out) and checks each file system's free space,
refusing on every rank before a byte is written. Each rank then writes ``step-N.tmp/shard-R.h5``
(``save_files``), one rank ``index.h5``, and rank 0 commits (``commit``): the manifest, the
folder's rename, ``latest``, retention. A crash leaves at worst a ``.tmp`` folder nothing reads;
an error on any rank is the same ``CheckpointError`` on every rank, and ``latest`` stays.
``asynchronous=True`` writes in the background (``async_save``). docs/architecture.md has the
format and the reasons.
"""
from __future__ import annotations

import json
import os
import shutil
import time

import h5py
import numpy as np

from .. import log
from ..backend import to_host
from ..runtime.waiting import wait_politely
from ..state import checkpointable
from . import async_save, commit
from .manifest import (FORMAT, INDEX, LATEST, SHARED_FILE, VERSION, CheckpointError, NonFiniteCheckpoint, chunk_checksums,
                       latest_step, must_be_finite, shard_filename, step_dirname, sync_and_checksum)
from .reader import raise_if_any
from .save_files import DurableFile, allocate_flat_dataset, free_space, space_shortfalls, write_array
from .save_plan import Plan, index_image

logger = log.get_logger(__name__)


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


def unwritable(pieces: list, collective: bool) -> str | None:
    """Why this rank cannot write its part of a save (None: it can). Ranks can differ here: each
    holds its own pieces, and nodes can have differently built h5py."""
    if collective and not h5py.get_config().mpi:
        return ("collective=True writes one shared file with driver='mpio', which needs h5py built against "
                "parallel HDF5 (h5py.get_config().mpi is False here); the default file-per-rank layout works "
                "everywhere")
    for piece in pieces:
        if piece.array.dtype.kind not in "fiub":
            return (f"{piece.key}: dtype {piece.array.dtype} cannot be stored in HDF5; checkpoint float32 master "
                    f"weights instead")
    return None


class SaveJob:
    """One checkpoint: built on the calling thread, written by ``run`` (possibly on another)."""

    def __init__(self, root: str, step: int, model, optimizer, ctx, extra=None, keep: int | None = None,
                 copy: bool = False, collective: bool = False):
        self.collective = collective
        pieces, self.scalars = checkpointable(model).checkpoint_pieces()
        if optimizer is not None:
            opt_pieces, opt_scalars = checkpointable(optimizer).checkpoint_pieces()
            pieces += opt_pieces
            self.scalars.update(opt_scalars)
        self.root, self.step, self.keep = root, step, keep
        self.layout = ctx.layout
        self.rank, self.world_size = ctx.rank, ctx.world_size
        self.shared_extra, self.rank_state = split_extra(extra)
        self.step_dir = os.path.join(root, step_dirname(step))
        self.tmp_dir = self.step_dir + ".tmp"

        # What this rank finds unwritable travels with the plan: raised here alone, it would leave
        # the others in the all-gather forever (under checkpoint.on_error = "warn" this rank trains on).
        refused = unwritable(pieces, collective)
        made = self._make_folder() if self.rank == 0 and not refused else None
        described = [(p.key, p.slab, p.global_shape, str(p.array.dtype)) for p in pieces]
        # (the all-gather is also the barrier after rank 0's mkdir)
        gathered = ctx.world.allgather_object((described, self.scalars, free_space(root), made or refused))
        problems = [[problem] if problem else [] for *_, problem in gathered]
        everyone = [entries for entries, _, _, _ in gathered]
        for _, scalars, _, _ in gathered:  # ZeRO ranks each know the step counts of their own parameters
            self.scalars.update(scalars)
        plan = None if any(problems) else Plan.of(everyone, SHARED_FILE if collective else None, ctx.layout)
        short = [] if plan is None else space_shortfalls([space for _, _, space, _ in gathered], plan.load, everyone)
        if short or plan is None:  # the same verdict on every rank, from the same gathered numbers
            if self.rank == 0:
                shutil.rmtree(self.tmp_dir, ignore_errors=True)
            what = f"checkpoint {self.step_dir} was not written"
            raise_if_any(problems, what, CheckpointError)
            raise CheckpointError(f"{what}: not enough free space: " + "; ".join(short))
        owner, load = plan.owner, plan.load
        # index.h5 needs only the plan, not the data: the rank with the fewest bytes to write
        # makes it (in a thread, while it writes its own shard).
        self.index_writer = min(range(len(everyone)), key=lambda r: (load[r], -r))  # ties: not rank 0, which commits
        self.tensors = plan.tensors() if collective or self.rank in (0, self.index_writer) else None
        self.plan = plan
        mine = [p for p in pieces if owner[(p.key, p.slab)] == self.rank]
        # Host arrays to write: copies when the writer runs later (async), views otherwise.
        self.pieces = [(p, np.array(to_host(p.array), copy=True) if copy else to_host(p.array)) for p in mine]

    def _make_folder(self) -> str | None:
        """Rank 0: a clean ``step-N.tmp`` (one left by a save that died is stale); the error, if any,
        goes to every rank with the plan instead of leaving them waiting."""
        try:
            os.makedirs(self.root, exist_ok=True)
            shutil.rmtree(self.tmp_dir, ignore_errors=True)
            os.makedirs(self.tmp_dir)
        except OSError as error:
            return f"rank 0 cannot make {self.tmp_dir}: {error}"
        return None

    def run(self, comm) -> str:
        """Write this rank's shard, then commit on rank 0; collective over ``comm``."""
        start = time.perf_counter()
        facts = {"files": {}, "rank_state": self.rank_state, "error": None}
        # Rank 0 prepares the new ``latest`` (a small fsync'd file) while the shards are written.
        self.latest_ready = (DurableFile(os.path.join(self.root, LATEST + ".tmp"), (step_dirname(self.step) + "\n").encode())
                             if self.rank == 0 else None)
        index = None
        try:
            index = self._write_index() if self.rank == self.index_writer else None  # in a thread, meanwhile:
            if self.collective:
                self._write_shared_file(comm, facts)
            else:
                self._write_shard(facts)
            if index is not None:
                index.path()
                facts["files"][INDEX] = {"bytes": len(index.data), "chunks": chunk_checksums(index.data)}
        except Exception as exc:  # noqa: BLE001 - a full disk, a quota, any failure here: every rank must hear of it
            # (an error kept to this rank would leave the others in the barrier below forever)
            facts["error"] = f"rank {self.rank}: {type(exc).__name__}: {exc}"
            if index is not None:
                index.thread.join()  # nothing may still write into the folder rank 0 removes
        # Ranks finish their shards at different times; waiting politely first keeps the early
        # ones from spinning in gather on the cores the late ones still write from.
        wait_politely(comm.Ibarrier())
        gathered = comm.gather(facts, root=0)
        error = None
        if self.rank == 0:
            failed = [f["error"] for f in gathered if f["error"]]
            nonfinite = [entry for f in gathered for entry in f.get("nonfinite", ())]
            try:
                if failed:  # nothing is committed: the previous checkpoint stays the latest
                    raise CheckpointError("; ".join(failed))
                if nonfinite:
                    raise NonFiniteCheckpoint(f"non-finite values (inf or NaN) in {len(nonfinite)} tensor "
                                              f"piece(s), first {', '.join(nonfinite[:3])}; latest stays "
                                              f"{latest_name(self.root)}")
                self._commit(gathered)
            except Exception as exc:  # noqa: BLE001 - reported on every rank below
                error = (type(exc).__name__ if isinstance(exc, CheckpointError) else "CheckpointError",
                         str(exc) if isinstance(exc, CheckpointError) else f"rank 0: {type(exc).__name__}: {exc}")
                shutil.rmtree(self.tmp_dir, ignore_errors=True)
                self.latest_ready.discard()
        wait_politely(comm.Ibarrier())  # while rank 0 commits
        error = comm.bcast(error, root=0)
        if error:
            kind = NonFiniteCheckpoint if error[0] == NonFiniteCheckpoint.__name__ else CheckpointError
            raise kind(f"checkpoint {self.step_dir} was not committed: {error[1]}")
        self.seconds = time.perf_counter() - start
        return self.step_dir

    def _write_shard(self, facts: dict) -> None:
        """One flat dataset per dtype holding this rank's pieces end to end (in plan order).

        HDF5 only lays the file out (datasets allocated at creation, never filled); the bytes
        go in with plain writes at each dataset's offset: no HDF5 call per piece, no copy.
        """
        name = shard_filename(self.rank)
        path = os.path.join(self.tmp_dir, name)
        blobs: dict = {}
        for _, array in self.pieces:
            blobs.setdefault(array.dtype.name, []).append(np.ascontiguousarray(array))
        offsets = {}
        # 64-byte alignment: each dataset, so every piece a load reads, starts on a cache line.
        with h5py.File(path, "w", libver=("v110", "v110"), alignment_threshold=1, alignment_interval=64) as f:
            for dtype, arrays in blobs.items():
                offsets[dtype] = allocate_flat_dataset(f, dtype, sum(a.size for a in arrays))
        fd = os.open(path, os.O_WRONLY)
        try:
            for dtype, arrays in blobs.items():
                if offsets[dtype] is not None:
                    write_array(fd, arrays, offsets[dtype])
        finally:
            os.close(fd)
        floats = float_ranges(self.pieces, offsets)
        measured = sync_and_checksum(path, [(start, size, dtype) for start, size, dtype, _ in floats])
        facts["nonfinite"] = [f"{key} ({bad} of {size})" for (_, size, _, key), bad in
                              zip(floats, measured.pop("nonfinite")) if bad]
        facts["files"][name] = measured | {"blobs": offsets}

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
        facts["nonfinite"] = nonfinite_in_memory(self.pieces)
        if self.rank == 0:
            facts["files"][SHARED_FILE] = sync_and_checksum(path)
            del facts["files"][SHARED_FILE]["nonfinite"]

    # ----- the index writer and rank 0 --------------------------------------------------
    def _write_index(self) -> "DurableFile":
        """index.h5 (one virtual dataset per tensor at its global shape, over the planned shard
        datasets), written and fsynced by a thread while this rank writes its shard."""
        if self.plan.index is None:  # the index depends on the plan only: built once per layout
            self.plan.index = index_image(self.tensors, self.layout)
        return DurableFile(os.path.join(self.tmp_dir, INDEX), self.plan.index)

    def _commit(self, gathered: list) -> None:
        """Rank 0: the manifest from every rank's file facts, then the atomic publication and retention."""
        files, rank_state = {}, {}
        for rank, facts in enumerate(gathered):
            files.update(facts["files"])
            rank_state[str(rank)] = facts["rank_state"]
        manifest = {"format": FORMAT, "version": VERSION, "step": self.step, "layout": self.layout,
                    "created": time.time(), "tensors": self.tensors, "scalars": self.scalars,
                    "files": files, "extra": self.shared_extra, "rank_state": rank_state}
        commit.publish(manifest, self.tmp_dir, self.step_dir, self.root, self.latest_ready)
        commit.retire(self.root, self.step, self.keep)


def float_ranges(pieces: list, offsets: dict) -> list[tuple[int, int, str, str]]:
    """(first byte in the shard file, elements, dtype, key) of each floating piece ``_write_shard``
    lays out (one flat dataset per dtype from ``offsets``, its pieces end to end), by first byte."""
    ranges, ends = [], dict(offsets)
    for piece, array in pieces:
        dtype = array.dtype.name
        if must_be_finite(piece.key, array.dtype) and ends[dtype] is not None:
            ranges.append((ends[dtype], array.size, dtype, piece.key))
        if ends[dtype] is not None:
            ends[dtype] += array.nbytes
    return sorted(ranges)


def nonfinite_in_memory(pieces: list) -> list[str]:
    """The floating pieces holding inf or NaN, checked in memory (the collective file's path)."""
    found = []
    for piece, array in pieces:
        if must_be_finite(piece.key, array.dtype) and (bad := array.size - int(np.count_nonzero(np.isfinite(array)))):
            found.append(f"{piece.key} ({bad} of {array.size})")
    return found


def latest_name(root: str) -> str:
    """The step folder ``latest`` names, for messages ("none": no committed step yet)."""
    step = latest_step(root)
    return "none" if step is None else step_dirname(step)


_warned_threads = []


def threads_may_call_mpi() -> bool:
    """Whether a writer thread may call MPI (``MPI.THREAD_MULTIPLE``); warns once when it may not."""
    from mpi4py import MPI

    if MPI.Query_thread() == MPI.THREAD_MULTIPLE:
        return True
    if not _warned_threads:
        _warned_threads.append(True)
        logger.warning("asynchronous checkpoints need MPI.THREAD_MULTIPLE (the writer thread calls MPI), and this "
                       f"MPI gives thread level {MPI.Query_thread()}: checkpoints are written synchronously")
    return False


def save(root: str, step: int, model, optimizer, ctx, extra: dict | None = None, keep: int | None = None,
         asynchronous: bool = False, collective: bool = False):
    """Write a checkpoint of ``model`` and ``optimizer`` (Checkpointables of ``hpcpar.state``, or
    (name, param) pairs; ``optimizer`` may be None); collective over ``ctx.world``.

    ``extra`` maps names to objects with ``state_dict()`` (schedule, loss scaler, sampler: the same
    on every rank), NumPy Generators (random streams, saved per rank), or plain JSON values; ``keep``
    the steps retention keeps. ``asynchronous=True`` copies the state to host memory and returns
    while a thread writes it (``async_save``), synchronously with one warning where MPI threads
    cannot call MPI. ``collective=True``, where h5py is built against parallel HDF5, has all ranks
    write one ``shared.h5`` with ``driver="mpio"``, a dataset per piece (PyPI's h5py is serial:
    then it is a clear error).

    Returns the committed step folder, or an ``AsyncSave`` whose ``wait()`` returns it.
    """
    async_save.wait()  # one save at a time: the previous asynchronous one must be committed first
    if asynchronous and not threads_may_call_mpi():
        asynchronous = False
    job = SaveJob(root, step, model, optimizer, ctx, extra, keep, copy=asynchronous, collective=collective)
    return async_save.start(job, ctx) if asynchronous else job.run(ctx.world.mpi)
