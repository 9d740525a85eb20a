"""``hpcpar bench ckpt``: checkpoint save and load against raw writes and reads of the same bytes.

    mpiexec -n 4 hpcpar bench ckpt [--dir DIR] [--repeats 3] [--zero]

Every rank builds the GPT of ``hpcpar bench dp`` with AdamW state from one step (sharded over the
ranks by ZeRO-1 with ``--zero``), then times, ``--repeats`` times, a save, an asynchronous save, a
raw write, a load and a raw read (``measure``). Each time runs from a barrier to the slowest
rank's finish; the table shows medians. Bandwidths divide the checkpoint's shard bytes by the
time. Reads come from the page cache (the files were just written and nothing is dropped), so
the load row measures checksums and copies rather than the disk. Without ``--zero`` every rank
is a replica: each tensor is written once (by the lowest rank holding it) but every rank reads
all of it back. The files go to a fresh folder under ``--dir`` (default: the system temp
folder), removed at the end.
"""
from __future__ import annotations

import contextlib
import statistics
from dataclasses import replace
import os
import shutil
import tempfile
import time

import numpy as np
from mpi4py import MPI

from ..cli import at_least
from .. import checkpoint
from ..checkpoint import writer
from ..checkpoint.manifest import shard_filename, step_dirname
from ..runtime.context import init
from ..runtime.failfast import UsageError
from ..nn.gpt import GPT
from ..optim import AdamW
from ..parallel.zero import ZeroRedundancyOptimizer
from .dp import BENCH_CONFIG
from ..tables import format_table, human_bytes


def build(ctx, zero: bool, device: str, config=BENCH_CONFIG):
    """The bench GPT and its optimizer with state from one step (the same batch on every rank)."""
    model = GPT(config, dtype=np.float32, device=device)
    if zero:
        optimizer = ZeroRedundancyOptimizer(model.named_parameters(), ctx.dp, AdamW, lr=1e-4)
    else:
        optimizer = AdamW(model.named_parameters(), lr=1e-4)
    ids = np.random.default_rng(0).integers(0, BENCH_CONFIG.vocab_size, (2, BENCH_CONFIG.block_size + 1))
    model.loss(ids[:, :-1], ids[:, 1:]).backward()
    optimizer.step()
    optimizer.zero_grad()
    return model, optimizer


def timed(comm: MPI.Comm, fn) -> float:
    """Seconds from a barrier until the slowest rank has finished ``fn``."""
    comm.Barrier()
    start = time.perf_counter()
    fn()
    return comm.allreduce(time.perf_counter() - start, op=MPI.MAX)


def raw_write(path: str, data: np.ndarray) -> None:
    with open(path, "wb") as f:
        data.tofile(f)
        f.flush()
        os.fsync(f.fileno())


def raw_files(folder: str, rank: int, size: int, nbytes: int) -> list[tuple[str, int]]:
    """(path, bytes) of the ranks' raw files, this rank's first, that hold ``nbytes``: the bytes a
    load of this rank reads (a data-parallel replica loads the whole model, more than it wrote)."""
    files = []
    for other in range(rank, rank + size):
        if nbytes <= 0:
            break
        path = os.path.join(folder, f"raw-{other % size:05d}.bin")
        files.append((path, min(nbytes, os.path.getsize(path))))
        nbytes -= files[-1][1]
    return files


def raw_read(files: list) -> None:
    """Each file into new memory (``np.fromfile``, freed at once: the next file reuses it)."""
    for path, count in files:
        np.fromfile(path, dtype=np.uint8, count=count)


def raw_read_into(files: list, buffer: np.ndarray) -> None:
    """The files end to end into ``buffer``, memory that exists and was written before, as the
    model's arrays are for a load (``preadv``, one call per file)."""
    at = 0
    for path, count in files:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.preadv(fd, [buffer[at: at + count]], 0)
        finally:
            os.close(fd)
        at += count


def async_save(root: str, step: int, model, optimizer, ctx) -> tuple[float, float]:
    """(seconds training is blocked, seconds the background write then takes) of one async save.

    Training waits only for the snapshot to host memory; the writer thread then writes,
    fsyncs and commits. Joining it at once, with nothing else running, times its own work.
    """
    ctx.world.mpi.Barrier()
    start = time.perf_counter()
    pending = checkpoint.save(root, step, model, optimizer, ctx, asynchronous=True, keep=1)
    returned = time.perf_counter()
    pending.wait()
    return returned - start, time.perf_counter() - returned


@contextlib.contextmanager
def without_finite_check():
    """Saves that leave out the check for inf and NaN: the shard's read-back pass then computes the
    CRC-32s alone (the same native call with no float ranges), the baseline of the check's cost."""
    ranges = writer.float_ranges
    writer.float_ranges = lambda pieces, offsets: []
    try:
        yield
    finally:
        writer.float_ranges = ranges


def measure(ctx, folder: str, repeats: int, zero: bool, device: str, config=BENCH_CONFIG) -> dict:
    """Every row's times, ``repeats`` times:

    - **save**: ``hpcpar.checkpoint.save`` (shard files, fsync, index.h5, manifest, atomic commit,
      every float checked finite in the pass that computes the CRC-32s); **save without the finite
      check**: the same save, in the same repeat, with that check left out;
    - **async save**: the same with ``asynchronous=True``: how long training is blocked (the
      snapshot to host memory, in ms), and the background write's own time (the writer thread
      joined at once), next to the raw write;
    - **raw write**: each rank writes as many bytes as its shard file holds into its own file
      with ``ndarray.tofile`` and fsyncs it: the file system's speed for the same bytes;
    - **load**: ``hpcpar.checkpoint.load`` (each rank checks the CRC-32 of its share of the MiBs
      it reads, from the file's pages in the page cache, and once every rank has checked, copies
      the pieces into the model's and the optimizer's existing arrays);
    - **raw read**: each rank reads as many bytes of the raw files (its own first) into an
      existing buffer of that size with ``preadv``: the same operation, reading into memory that
      was written before. A second table gives another baseline, ``np.fromfile`` into new memory
      per file (freed at once, so the next file reuses it: at 37 MiB that memory is half the
      bytes and stays in the cache; at 652 MiB it is slower than the read into existing memory).
    """
    comm = ctx.world.mpi
    model, optimizer = build(ctx, zero, device, config)
    root, unchecked = os.path.join(folder, "ckpt"), os.path.join(folder, "unchecked")
    raw_path = os.path.join(folder, f"raw-{ctx.rank:05d}.bin")
    times = {"save": [], "save without the finite check": [], "raw write": [], "load": [], "raw read": [], "raw read into": [], "async blocks": [],
             "async writes": []}
    held = sum(p.data.nbytes for p in model.parameters())
    held += optimizer.state_bytes() if zero else sum(v.nbytes for s in optimizer.state.values()
                                                     for v in s.values() if hasattr(v, "nbytes"))
    into = np.ones(held, dtype=np.uint8)  # the destination of "raw read into", written once like a model
    for repeat in range(repeats):
        blocks, writes = async_save(os.path.join(folder, "async"), repeat, model, optimizer, ctx)
        times["async blocks"].append(comm.allreduce(blocks, op=MPI.MAX))
        times["async writes"].append(comm.allreduce(writes, op=MPI.MAX))
        for checked in ((True, False) if repeat % 2 else (False, True)):  # alternating: neither always goes first
            if checked:
                times["save"].append(timed(comm, lambda: checkpoint.save(root, repeat, model, optimizer, ctx)))
                continue
            with without_finite_check():  # a root of its own: each save writes a new step, as the other does
                times["save without the finite check"].append(
                    timed(comm, lambda: checkpoint.save(unchecked, repeat, model, optimizer, ctx)))
        step_dir = os.path.join(root, step_dirname(repeat))
        written = os.path.getsize(os.path.join(step_dir, shard_filename(ctx.rank)))
        data = np.ones(written, dtype=np.uint8)
        times["raw write"].append(timed(comm, lambda: raw_write(raw_path, data)))
        times["load"].append(timed(comm, lambda: checkpoint.load(root, model, optimizer, ctx)))
        files = raw_files(folder, ctx.rank, ctx.world_size, held)
        times["raw read"].append(timed(comm, lambda: raw_read(files)))
        times["raw read into"].append(timed(comm, lambda: raw_read_into(files, into)))
        comm.Barrier()
        if ctx.rank == 0 and repeat:  # outside the timings: keep one step on disk
            for saved in (root, unchecked):
                shutil.rmtree(os.path.join(saved, step_dirname(repeat - 1)))
    shard_bytes = comm.allgather(written)
    return {name: statistics.median(values) for name, values in times.items()} | {
        "shard_bytes": shard_bytes, "held_bytes": comm.allgather(held),
        "folder_bytes": sum(e.stat().st_size for e in os.scandir(step_dir) if e.is_file())}


def add_arguments(parser) -> None:
    parser.add_argument("--dir", default=None, help="where to write: a temporary folder is made inside (default: the system's temporary folder)")
    parser.add_argument("--repeats", type=at_least(1), default=5, help="saves and loads timed; medians shown")
    parser.add_argument("--zero", action="store_true", help="optimizer state sharded by ZeRO-1 over the ranks")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda", "auto"), help="where the model lives")
    parser.add_argument("--n-layer", type=at_least(1), default=BENCH_CONFIG.n_layer, help="GPT blocks of the model saved")
    parser.add_argument("--n-embd", type=at_least(1), default=BENCH_CONFIG.n_embd, help="GPT width of the model saved")
    parser.set_defaults(func=run)


def run(args) -> None:
    if args.dir is not None and not os.path.isdir(args.dir):  # mkdtemp failed on rank 0 alone, a traceback
        raise UsageError(f"hpcpar bench ckpt: error: --dir {args.dir} is not a folder; give an existing one")
    config = replace(BENCH_CONFIG, n_layer=args.n_layer, n_embd=args.n_embd)

    ctx = init(device=args.device)
    comm = ctx.world.mpi
    folder = tempfile.mkdtemp(prefix="hpcpar-bench-ckpt-", dir=args.dir) if ctx.rank == 0 else None
    folder = comm.bcast(folder, root=0)
    try:
        result = measure(ctx, folder, args.repeats, args.zero, ctx.device, config)
        comm.Barrier()  # every rank is done with the folder (not on an error: a rank that failed alone
        # must reach fail-fast's abort, not a barrier the others, waiting in the timings, never enter)
    finally:
        if ctx.rank == 0:
            shutil.rmtree(folder, ignore_errors=True)
    if ctx.rank != 0:
        return
    total = sum(result["shard_bytes"])
    gbs = lambda seconds: total / seconds / 1e9  # noqa: E731
    rows = [[what, human_bytes(total), result[what], result[raw], gbs(result[what]), gbs(result[raw]),
             result[raw] / result[what]]
            for what, raw in (("save", "raw write"), ("load", "raw read into"), ("load", "raw read"))]
    fresh = rows.pop()
    shards, held = result["shard_bytes"], result["held_bytes"]
    background = [["async save", result["async blocks"] * 1e3, result["async writes"], result["raw write"],
                   result["raw write"] / result["async writes"]]]
    print(format_table(
        ["", "bytes", "hpcpar s", "raw s", "hpcpar GB/s", "raw GB/s", "hpcpar/raw bw"], rows,
        f"checkpoint of the GPT (layers {config.n_layer}, width {config.n_embd}; {'ZeRO-1 ' if args.zero else ''}AdamW, {ctx.world_size} ranks, {ctx.device}) "
        f"in {os.path.dirname(folder)}, median of {args.repeats}, time = slowest rank"), flush=True)
    print()
    print(format_table(["", "hpcpar s", "raw s", "hpcpar/raw bw"], [[fresh[0]] + fresh[2:4] + fresh[-1:]],
                       "load against a raw read into new memory (np.fromfile per file, freed at once, so the "
                       "next file reuses it)"), flush=True)
    print()
    print(format_table(["", "blocks training ms", "background write s", "raw write s", "raw/background"], background,
                       "asynchronous save: training waits for the snapshot to host memory only; the writer thread "
                       "then writes, fsyncs and commits (timed alone)"), flush=True)
    check = result["save"] - result["save without the finite check"]
    print(format_table(["", "save s", "save without the check s", "check s", "check / save"],
                       [["finite check", result["save"], result["save without the finite check"], check,
                         check / result["save"]]],
                       "the check for inf and NaN, fused into the read-back pass of the CRC-32s"), flush=True)
    print()
    print(f"shard bytes by rank: {', '.join(human_bytes(b) for b in shards)} (step folder "
          f"{human_bytes(result['folder_bytes'])} with index.h5 and manifest.json)\n"
          f"bytes each rank loads: {', '.join(human_bytes(b) for b in held)}; raw read reads as many bytes "
          f"of the raw files into existing memory of that size (preadv: the same operation as a load into "
          f"the model's arrays)\nreads are served from the page cache (nothing is "
          f"dropped): load and raw read are not disk speeds", flush=True)
