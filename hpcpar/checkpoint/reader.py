"""Loading a checkpoint into any layout: each rank reads exactly the slabs it now holds.

The objects being loaded say what they need through the checkpoint protocol (``hpcpar.state``):
a ``LoadPlan`` of reads (key, global shape, slab, dtype) and what to do once all are in. A
load is a transaction over all ranks:

1. every rank checks every read of its plans against the manifest: the tensor exists, with
   that global shape and a dtype of the same kind (float, integer, bool: the precision may
   change), the slab lies inside it, and (``strict``) every model tensor
   lands on some rank. A mismatch is a ``CheckpointError``;
2. every file the load needs is checked for presence and size, and every byte it reads
   against the CRC-32 of its MiB in the manifest (each MiB by one of the ranks reading it,
   so replicas share the work). Damage is a ``CheckpointDamaged``, on which ``load_latest``
   tries the previous step;
3. only when every rank got this far (all values in host memory, the ``extra`` states
   restored, and put back if any rank failed) are the values assigned and the plans finished.

Any failure before step 3 raises the same error on every rank and leaves the model, the
optimizer and every ``extra`` (scaler, data position, random streams) exactly as they were.

Tensors are read without HDF5: a piece is a byte range of its shard's flat dataset (offsets
in the manifest). A piece that is exactly what a read wants, into a destination that offers
itself (``Read.target``: a parameter, an optimizer's current state), is copied straight into
it at step 3 from the file's pages, mapped (the page cache's own pages, nothing read twice),
whose MiBs were checked at step 2 in the same mapping: no new memory, one copy (native, with
streaming stores; ``fastcopy``). Any other piece is read into an array of its own at step 2
(pieces that lie end to end in one request) and checked from there; a rank that now holds
part of a piece (another layout) copies its part out. The chunks are checked last file and
last MiB first, so that the copy, which goes first to last, finds the bytes checked last
still in the cache. ``index.h5`` stays the global view for other readers. Checkpoints of
format 1 (a dataset per piece) load through h5py. (A file that changes between its check and
step 3 is reported as damage after the load began, or, cut short while being copied, ends
the process with SIGBUS.)
"""
from __future__ import annotations

import bisect
import contextlib
import functools
import gc
import math
import mmap
import os

import h5py
import numpy as np

from .. import log
from ..state import Saved, checkpointable, slab_slices
from .crc import crc32
from .fastcopy import copy_pieces
from .manifest import (CHUNK_BYTES, CheckpointDamaged, CheckpointError, chunk_problems, latest_step, list_steps,
                       read_manifest, resolve_step_dir, step_dirname, verify_files)

logger = log.get_logger(__name__)


def check_reads(reads, manifest: dict) -> list[str]:
    """What does not fit: a tensor the checkpoint lacks, another global shape or dtype, a slab outside it."""
    problems = []
    for read in reads:
        table = manifest["tensors"].get(read.key)
        if table is None:
            problems.append(f"the checkpoint has no tensor {read.key!r}")
        elif tuple(table["shape"]) != tuple(read.global_shape):
            problems.append(f"{read.key} has global shape {tuple(table['shape'])} in the checkpoint but "
                            f"{tuple(read.global_shape)} here")
        elif read.dtype is not None and number_kind(table["dtype"]) != number_kind(read.dtype):
            problems.append(f"{read.key} is {table['dtype']} in the checkpoint but {np.dtype(read.dtype)} here")
        elif len(read.slab) != len(table["shape"]) or any(
                not 0 <= a <= b <= n for (a, b), n in zip(read.slab, table["shape"])):
            problems.append(f"{read.key}: this rank's slab {[list(s) for s in read.slab]} is not inside its "
                            f"global shape {tuple(table['shape'])}")
    return problems


@functools.lru_cache(maxsize=256)
def number_kind(dtype) -> str:
    """"float", "integer" or "bool": a load may change the precision (float32 masters into
    bfloat16 working copies, a float64 run into a float32 model for sampling), never the kind."""
    dtype = np.dtype(dtype)
    if dtype.kind in "fc" or (dtype.kind == "V" and "float" in dtype.name):  # ml_dtypes' bfloat16 is kind V
        return "float"
    return {"i": "integer", "u": "integer", "b": "bool"}.get(dtype.kind, dtype.name)


def overlap(slab, piece_slab):
    """The intersection of two slabs, or None when they do not meet."""
    both = tuple((max(a, c), min(b, d)) for (a, b), (c, d) in zip(slab, piece_slab))
    return both if all(a < b for a, b in both) or not both else None


class RawSource:
    """The pieces this rank's reads overlap: those read straight into their destination at
    commit (``direct``), the others read into arrays of their own and kept until the load
    commits; the MiBs holding them are checked against their CRC-32 first."""

    def __init__(self, step_dir: str, manifest: dict, reads):
        self.step_dir, self.manifest = step_dir, manifest
        self.needed: dict = {}  # file -> {first byte: (end byte, shape, dtype)} of the pieces read without HDF5
        self.legacy: set = set()  # files of pieces with a dataset each (format 1, collective saves)
        self.parts: list = []  # per read: [(piece, the part of the read's slab it holds)]
        self.values: dict = {}  # (file, first byte) -> the piece's array
        self.given: set = set()  # pieces handed to a read (another read of the same one gets a copy)
        self.h5files: dict = {}
        self.maps: dict = {}  # file -> FileMap of the bytes checked and copied from
        uses: dict = {}
        exact: dict = {}
        self.exact: list = []  # per read: (file, first byte) of the piece that is exactly its slab, or None
        files = manifest["files"]
        for read in reads:  # one pass: the pieces each read overlaps, their bytes, whether direct
            table = manifest["tensors"][read.key]
            dtype, parts, exactly = dtype_named(table["dtype"]), [], None
            wanted = [list(map(int, bounds)) for bounds in read.slab]
            for piece in table["pieces"]:
                same = piece["slab"] == wanted
                both = tuple(map(tuple, wanted)) if same else overlap(read.slab, piece["slab"])
                if both is None:
                    continue
                parts.append((piece, both))
                if "start" not in piece:
                    self.legacy.add(piece["file"])
                    continue
                shape = tuple(b - a for a, b in piece["slab"])
                nbytes = math.prod(shape) * dtype.itemsize
                if not nbytes:
                    continue
                begin = files[piece["file"]]["blobs"][piece["dataset"]] + piece["start"] * dtype.itemsize
                where = (piece["file"], begin)
                self.needed.setdefault(piece["file"], {})[begin] = (begin + nbytes, shape, dtype)
                uses[where] = uses.get(where, 0) + 1
                if same:
                    exactly = where
                    if fits(read.target, dtype, shape):
                        exact[where] = read.target
            self.parts.append(parts)
            self.exact.append(exactly)
        # Read straight into the destination once the load commits (no new memory, no copy): a
        # read that is exactly one piece, the only read of it, whose ``target`` is a contiguous
        # host array of the checkpoint's dtype. Their MiBs are checked from the file first.
        self.direct = {where: target for where, target in exact.items() if uses[where] == 1}

    def byte_range(self, piece: dict, dtype) -> tuple[int, int]:
        """[begin, end) of the piece's bytes in its file ((0, 0) for an empty piece: not in the file)."""
        nbytes = math.prod(b - a for a, b in piece["slab"]) * dtype.itemsize
        if not nbytes:
            return 0, 0
        begin = self.manifest["files"][piece["file"]]["blobs"][piece["dataset"]] + piece["start"] * dtype.itemsize
        return begin, begin + nbytes

    def chunk_runs(self) -> dict:
        """{file: [(first chunk, end chunk)]}: the MiBs holding the bytes this rank reads, merged into runs."""
        runs = {}
        for name, pieces in self.needed.items():
            chunks = set()
            for begin, (end, _, _) in pieces.items():
                chunks.update(range(begin // CHUNK_BYTES, (end - 1) // CHUNK_BYTES + 1))
            runs[name] = merge_runs(sorted(chunks))
        return runs

    def read_and_verify(self, mine: dict) -> list[str]:
        """Read every needed piece that is not direct into an array of its own (no copy; pieces
        that lie end to end in one request); map the bytes this rank reads or checks (the page
        cache's own pages: nothing copied, kept for ``fill_targets``); check the CRC-32 of the
        chunks in ``mine`` ({file: set of chunks}) from those arrays where they hold the bytes,
        else from the mapping. Last file and chunk first, so that ``fill_targets``, which copies
        from the first, finds the bytes checked last still in the cache."""
        problems = []
        for name in reversed(list(self.needed)):
            path = os.path.join(self.step_dir, name)
            fd = os.open(path, os.O_RDONLY)
            try:
                segments = self._read_pieces(fd, name, self.needed[name])
                facts = self.manifest["files"][name]
                if segments is None or os.fstat(fd).st_size < facts["bytes"]:
                    problems.append(f"{path}: shorter than the manifest says (truncated?)")
                    continue
                chunks = sorted(mine.get(name, ()), reverse=True)
                mapped = self.maps[name] = FileMap(fd, self._mapped_range(name, chunks, facts["bytes"]))
                crcs = {c: chunk_crc(mapped, segments, c * CHUNK_BYTES, min((c + 1) * CHUNK_BYTES, facts["bytes"]))
                        for c in chunks}
                problems += [line for c in sorted(crcs) for line in chunk_problems(path, [crcs[c]], facts["chunks"], c)]
            finally:
                os.close(fd)
        return problems

    def _mapped_range(self, name: str, chunks: list, size: int) -> tuple[int, int]:
        """[begin, end) of the file to map: the chunks this rank checks and the direct pieces' bytes."""
        ends = [(c * CHUNK_BYTES, min((c + 1) * CHUNK_BYTES, size)) for c in chunks]
        ends += [(begin, self.needed[name][begin][0]) for where, begin in self.direct if where == name]
        return (min(b for b, _ in ends), max(e for _, e in ends)) if ends else (0, 0)

    def _read_pieces(self, fd: int, name: str, pieces: dict) -> list | None:
        """[(first byte, uint8 view of the piece's new array)] in file order; None when the file is short."""
        segments = []
        for begin, (_, shape, dtype) in sorted(pieces.items()):
            if (name, begin) not in self.values and (name, begin) not in self.direct:
                values = self.values[(name, begin)] = np.empty(shape, dtype=dtype)
                segments.append((begin, values.reshape(-1).view(np.uint8)))
        return read_segments(fd, segments)

    def piece_values(self, piece: dict, dtype) -> np.ndarray | None:
        """The piece's array: its own the first time (the receiver may keep it), a copy after;
        None for a direct piece (read into its destination by ``fill_targets``)."""
        begin, end = self.byte_range(piece, dtype)
        shape = tuple(b - a for a, b in piece["slab"])
        if begin == end:
            return np.empty(shape, dtype)
        if (piece["file"], begin) in self.direct:
            return None
        values = self.values[(piece["file"], begin)]
        if (piece["file"], begin) in self.given:
            return values.copy()
        self.given.add((piece["file"], begin))
        return values

    def legacy_values(self, piece: dict, dtype) -> np.ndarray:
        """A format-1 piece: its own dataset, through h5py."""
        if piece["file"] not in self.h5files:
            self.h5files[piece["file"]] = h5py.File(os.path.join(self.step_dir, piece["file"]), "r")
        out = np.empty(tuple(b - a for a, b in piece["slab"]), dtype=dtype)
        dataset = h5py.h5d.open(self.h5files[piece["file"]].id, piece["dataset"].encode())
        if dataset.shape != out.shape:
            raise CheckpointDamaged(f"{os.path.join(self.step_dir, piece['file'])}: dataset {piece['dataset']} has "
                                    f"shape {dataset.shape}, the manifest says {out.shape}")
        if out.size:
            dataset.read(h5py.h5s.ALL, h5py.h5s.ALL, out)
        return out

    def read(self, n: int, read) -> np.ndarray | None:
        """The values of read ``n`` of the plan (``read``): the piece's own array when the slab is
        exactly a piece (the layout that saved; None when it is direct), else assembled from the
        parts of the pieces it overlaps."""
        if self.exact[n] in self.direct:
            return None
        dtype = np.dtype(self.manifest["tensors"][read.key]["dtype"])
        slab, out = read.slab, None
        for piece, both in self.parts[n]:
            values = self.piece_values(piece, dtype) if "start" in piece else self.legacy_values(piece, dtype)
            if all(a == c and b == d for (a, b), (c, d) in zip(piece["slab"], slab)):
                return values
            if out is None:
                out = np.empty(tuple(b - a for a, b in slab), dtype=dtype)
            out[tuple(slice(a - s, b - s) for (a, b), (s, _) in zip(both, slab))] = \
                values[tuple(slice(a - p, b - p) for (a, b), (p, _) in zip(both, piece["slab"]))]
        return out if out is not None else np.empty(tuple(b - a for a, b in slab), dtype=dtype)

    def fill_targets(self) -> list[str]:
        """Copy the direct pieces into their destinations, in file order (after the load committed:
        from the mapped pages whose chunks were checked against the manifest); the files that
        shrank since (then nothing is copied)."""
        shrunk = [f"{os.path.join(self.step_dir, name)}: shorter than when it was checked"
                  for name, mapped in self.maps.items() if mapped.shrunk()]
        if shrunk:
            return shrunk
        pairs = []
        for (name, begin), target in sorted(self.direct.items(), key=lambda item: item[0]):
            raw = target.reshape(-1).view(np.uint8)
            pairs.append((raw, self.maps[name].bytes(begin, begin + raw.size)))
        copy_pieces(pairs)
        return []

    def close(self) -> None:
        for f in self.h5files.values():
            f.close()
        for mapped in self.maps.values():
            mapped.close()
        self.h5files, self.maps = {}, {}


class FileMap:
    """Bytes [begin, end) of an open file, mapped read-only: the page cache's pages themselves,
    their page-table entries made at once (``MAP_POPULATE``: no fault per page). Where the file
    system cannot map files, the bytes are read into an array instead."""

    def __init__(self, fd: int, span: tuple[int, int]):
        self.begin = span[0] - span[0] % mmap.ALLOCATIONGRANULARITY  # a mapping starts on a page
        self.mapped, self.data = None, np.empty(0, dtype=np.uint8)
        if span[1] <= span[0]:
            return
        try:
            self.mapped = mmap.mmap(fd, span[1] - self.begin, prot=mmap.PROT_READ, offset=self.begin,
                                    flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
            self.data = np.frombuffer(self.mapped, dtype=np.uint8)
        except (OSError, ValueError):
            self.data = np.empty(span[1] - self.begin, dtype=np.uint8)
            self.data = self.data[:os.preadv(fd, [self.data], self.begin)]

    def bytes(self, begin: int, end: int) -> np.ndarray:
        """The file's bytes [begin, end), inside the mapped span."""
        return self.data[begin - self.begin: end - self.begin]

    def shrunk(self) -> bool:
        """Whether the file is now shorter than the mapped span (reading past its end would kill
        the process with SIGBUS, not raise)."""
        return self.mapped is not None and self.mapped.size() < self.begin + self.data.size

    def close(self) -> None:
        self.data = np.empty(0, dtype=np.uint8)  # no view may outlive the mapping
        if self.mapped is not None:
            self.mapped.close()
            self.mapped = None


@functools.lru_cache(maxsize=64)
def dtype_named(name: str) -> np.dtype:
    return np.dtype(name)


def fits(target, dtype, shape: tuple) -> bool:
    """Whether ``target`` can take a piece's bytes as they are: a contiguous host array of that dtype and shape."""
    return (isinstance(target, np.ndarray) and target.dtype == dtype and target.flags.c_contiguous
            and target.size > 0 and target.shape == shape)


def read_segments(fd: int, segments: list) -> list | None:
    """Fill each (first byte, uint8 array) of ``segments`` (sorted) from the file: one preadv for
    arrays whose bytes follow each other. ``segments``, or None when the file is short."""
    batch: list = []
    for n, (begin, raw) in enumerate(segments):
        batch.append(raw)
        following = segments[n + 1][0] if n + 1 < len(segments) else None
        if following != begin + raw.size or len(batch) == 512:
            first = begin + raw.size - sum(b.size for b in batch)
            if os.preadv(fd, batch, first) != sum(b.size for b in batch):
                return None
            batch = []
    return segments


def chunk_crc(mapped: FileMap, segments: list, begin: int, end: int) -> str:
    """CRC-32 of the file's bytes [begin, end) (one chunk at most): from the pieces' arrays
    (``segments``: (first byte, uint8 array), sorted) where they cover it, from the mapped
    file between them."""
    crc, at = 0, begin
    first = max(bisect.bisect_right(segments, begin, key=lambda segment: segment[0]) - 1, 0)
    for start, raw in segments[first:]:
        if start >= end:
            break
        stop = start + raw.size
        if stop <= at:
            continue
        if start > at:
            crc = crc32(mapped.bytes(at, start), crc)
            at = start
        upto = min(stop, end)
        crc = crc32(raw[at - start: upto - start], crc)
        at = upto
    if at < end:
        crc = crc32(mapped.bytes(at, end), crc)
    return f"{crc:08x}"


def merge_runs(chunks: list[int]) -> list[tuple[int, int]]:
    runs = []
    for c in chunks:
        if runs and runs[-1][1] == c:
            runs[-1] = (runs[-1][0], c + 1)
        else:
            runs.append((c, c + 1))
    return runs


def verifier_chunks(everyone: list[dict], rank: int) -> dict:
    """{file: chunks this rank checks}: each chunk some rank reads is checked by one of its readers
    (in turn, so replicas that read the same file share the CRC work)."""
    readers: dict = {}
    for r, runs in enumerate(everyone):
        for name, file_runs in runs.items():
            for first, end in file_runs:
                for c in range(first, end):
                    readers.setdefault((name, c), []).append(r)
    mine: dict = {}
    for (name, c), ranks in readers.items():
        if ranks[c % len(ranks)] == rank:
            mine.setdefault(name, set()).add(c)
    return mine


def restore_extra(manifest: dict, extra: dict | None, ctx) -> tuple[dict, list]:
    """Restore the ``extra`` states (all of them or, on an error, none): (the plain JSON values,
    [(object, its state before)] to put back if the load fails later)."""
    values, restored = {}, []
    try:
        for name, saved in manifest["extra"].items():
            if "value" in saved:
                values[name] = saved["value"]
            elif extra and name in extra:
                before = extra[name].state_dict()
                restored.append((extra[name], before))
                extra[name].load_state_dict(saved["state_dict"])
    except Exception:
        for target, before in reversed(restored):  # back to how they were, then the error
            target.load_state_dict(before)
        raise
    return values, restored


def restore_streams(manifest: dict, extra: dict | None, ctx) -> None:
    """Random streams belong to ranks: restored only when each rank is the same rank again."""
    mine = manifest["rank_state"].get(str(ctx.rank), {})
    if manifest["layout"] != ctx.layout:
        return
    for name, target in (extra or {}).items():
        if isinstance(target, np.random.Generator) and name in mine:
            target.bit_generator.state = mine[name]


def load(path: str, model, optimizer, ctx, extra: dict | None = None, step: int | None = None,
         strict: bool = True) -> dict:
    """Load the checkpoint at ``path`` (a root: the step ``latest`` names, or ``step``; or a step folder).

    ``model`` and ``optimizer`` are Checkpointables (``hpcpar.state``: a Module, a pipeline, an
    optimizer, ZeRO-1, a parameter server) or (name, parameter) pairs; ``optimizer`` may be None.
    Returns ``{"step", "step_dir", "layout", "extra"}`` (``extra``: the plain JSON values).
    Collective over ``ctx.world`` (two all-gathers); every rank raises the same error, and then
    nothing has changed: ``CheckpointDamaged`` for damaged files, ``CheckpointError`` for a
    checkpoint that does not fit (names, shapes, dtypes, slabs).
    """
    with collector_paused():
        return load_step(resolve_step_dir(path, step), model, optimizer, ctx, extra, strict)


@contextlib.contextmanager
def collector_paused():
    """Python's cyclic garbage collector off for the duration, then as it was: a load makes
    thousands of small containers (the manifest, the plan), none in a cycle, and each collection
    they would trigger walks every object of the process, the model's included (1-2 ms a load)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def load_step(step_dir: str, model, optimizer, ctx, extra: dict | None, strict: bool) -> dict:
    """``load`` of one step folder."""
    comm = ctx.world.mpi
    what = f"loading {step_dir}"
    plan, source, found = plan_load(step_dir, model, optimizer, comm)
    everyone = comm.allgather(found)  # 1: what each rank found before reading a byte
    for kind, error in (("damaged", CheckpointDamaged), ("mismatch", CheckpointError)):
        raise_if_any([mine[kind] for mine in everyone], what, error)
    manifest = source.manifest
    if strict:
        loaded = set().union(*(mine["model_keys"] for mine in everyone))
        unused = sorted(k for k in manifest["tensors"] if k.startswith("model/") and k not in loaded)
        if unused:
            raise CheckpointError(f"{what}: tensors no rank of this model takes: {unused[:5]}"
                                  f"{' ...' if len(unused) > 5 else ''} (pass strict=False to ignore)")
    refused, extras, restored = [], {}, []
    try:  # the mappings and HDF5 files stay open until the checked bytes are in their places
        damaged, values = read_checked(source, plan, verifier_chunks([mine["runs"] for mine in everyone],
                                                                     comm.Get_rank()))
        if not damaged:
            try:  # the extras before the point of no return: they can refuse a state, and are put back
                extras, restored = restore_extra(manifest, extra, ctx)
            except Exception as error:  # noqa: BLE001 - every rank raises below
                refused.append(f"restoring the extra state: {type(error).__name__}: {error}")
        everyone = comm.allgather((damaged, refused))  # 2: every rank has every value, or none goes in
        if any(d or r for d, r in everyone):
            for target, before in reversed(restored):
                target.load_state_dict(before)
            raise_if_any([d for d, _ in everyone], what, CheckpointDamaged)
            raise_if_any([r for _, r in everyone], what, CheckpointError)
        failed = source.fill_targets()  # the point of no return: the checked bytes, into their places
    finally:
        source.close()
    if failed:
        raise CheckpointDamaged(f"{what}: {'; '.join(failed)} (the model is partly loaded: load again)")
    for read, value in zip(plan.reads, values):
        if value is not None:
            read.assign(value)
    for finish in plan.finish:
        finish()
    restore_streams(manifest, extra, ctx)
    return {"step": manifest["step"], "step_dir": step_dir, "layout": manifest["layout"], "extra": extras}


def read_checked(source: RawSource, plan, mine: dict) -> tuple[list[str], list]:
    """(damage found, the values of the plan's reads: None for those filled at commit) after
    checking the chunks in ``mine``; no values when anything is damaged."""
    damaged, values = [], []
    try:
        damaged = source.read_and_verify(mine)
        if not damaged:
            values = [source.read(n, read) for n, read in enumerate(plan.reads)]
    except (OSError, ValueError, KeyError) as error:
        damaged.append(f"{type(error).__name__}: {error}")
    return damaged, values


def plan_load(step_dir: str, model, optimizer, comm) -> tuple:
    """(load plan, RawSource, what this rank found: damage, mismatches, the model tensors it
    reads, the MiBs it will read) before reading any tensor."""
    rank, size = comm.Get_rank(), comm.Get_size()
    found = {"damaged": [], "mismatch": [], "model_keys": set(), "runs": {}}
    try:
        manifest = read_manifest(step_dir)
    except CheckpointDamaged as error:
        found["damaged"].append(str(error))
        return None, None, found
    saved = Saved(manifest["tensors"], manifest["scalars"])
    plan = checkpointable(model).load_plan(saved)
    if optimizer is not None:
        plan.extend(checkpointable(optimizer).load_plan(saved))
    found["mismatch"] = check_reads(plan.reads, manifest)
    if found["mismatch"]:
        return plan, None, found
    found["model_keys"] = {r.key for r in plan.reads if r.key.startswith("model/")}
    source = RawSource(step_dir, manifest, plan.reads)
    names = sorted(manifest["files"])
    # Presence and size of every file (a share each) and of those this rank reads; the full
    # checksum of the files read through h5py (format 1, collective saves: one CRC-32 each).
    problems = verify_files(step_dir, manifest, set(names[rank::size]) | set(source.needed), checksums=False)
    problems += verify_files(step_dir, manifest, source.legacy)
    found["damaged"] = problems
    found["runs"] = source.chunk_runs()
    return plan, source, found


def raise_if_any(everyone: list, what: str, error) -> None:
    """Raise ``error`` naming each problem once, with the ranks that found it, when any rank found one."""
    ranks: dict = {}
    for rank, mine in enumerate(everyone):
        for problem in mine:
            ranks.setdefault(problem, []).append(rank)
    if ranks:
        found = [f"{problem} (rank{'s' if len(r) > 1 else ''} {', '.join(map(str, r))})" for problem, r in ranks.items()]
        shown = "; ".join(found[:6]) + (f"; ... ({len(found) - 6} more)" if len(found) > 6 else "")
        raise error(f"{what}: {shown}")


def load_latest(root: str, model, optimizer, ctx, extra: dict | None = None, strict: bool = True) -> dict | None:
    """Load the step ``latest`` names under ``root``; None when there is no committed step.

    ``latest`` is the source of truth: steps above it (another run's, left in the folder) are
    never loaded. A damaged step (``CheckpointDamaged``) is reported and the next older one is
    tried; any other error (a checkpoint that does not fit the model) is raised.
    """
    newest = latest_step(root)
    if newest is None:
        return None
    above = [s for s in list_steps(root) if s > newest]
    if above:
        logger.warning(f"{root}: ignoring steps {above} above the one 'latest' names ({newest})")
    for step in [newest] + [s for s in reversed(list_steps(root)) if s < newest]:
        if not os.path.isdir(os.path.join(root, step_dirname(step))):
            logger.warning(f"skipping checkpoint step {step}: 'latest' names it but {root} has no such folder")
            continue
        try:
            return load(os.path.join(root, step_dirname(step)), model, optimizer, ctx, extra, strict=strict)
        except CheckpointDamaged as error:
            logger.warning(f"skipping damaged checkpoint step {step}: {error}")
    return None
