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
itself (``Read.target``: a parameter, an optimizer's current state), is read straight into
it at step 3, after its MiBs were checked (from the page cache, into one reused buffer): no
new memory, no copy. Any other piece is read into an array of its own at step 2 (pieces
that lie end to end in one request) and checked from there; a rank that now holds part of
a piece (another layout) copies its part out. ``index.h5`` stays the global view for other
readers. Checkpoints of format 1 (a dataset per piece) load through h5py. (A file that
changes or fails between its check and step 3 is reported as damage after the load began.)
"""
from __future__ import annotations

import bisect
import math
import os

import h5py
import numpy as np

from .. import log
from ..state import Saved, checkpointable, slab_slices
from .crc import crc32
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
    """The pieces this rank's reads overlap, each read into an array of its own and kept until
    the load commits; the MiBs holding them are checked against their CRC-32 first."""

    def __init__(self, step_dir: str, manifest: dict, reads):
        self.step_dir, self.manifest = step_dir, manifest
        self.needed: dict = {}  # file -> [(piece, dtype)] of the pieces read without HDF5
        self.legacy: set = set()  # files of pieces with a dataset each (format 1, collective saves)
        for read in reads:
            for piece in manifest["tensors"][read.key]["pieces"]:
                if overlap(read.slab, piece["slab"]) is None:
                    continue
                if "start" in piece:
                    self.needed.setdefault(piece["file"], []).append((piece, np.dtype(read_dtype(manifest, read))))
                else:
                    self.legacy.add(piece["file"])
        self.values: dict = {}  # (file, first byte) -> the piece's array
        self.given: set = set()  # pieces handed to a read (another read of the same one gets a copy)
        self.h5files: dict = {}
        self.direct = self._direct_targets(reads)  # (file, first byte) -> array filled once the load commits
        self.scratch = np.empty(CHUNK_BYTES, dtype=np.uint8)  # bytes between pieces, for their checksums

    def _direct_targets(self, reads) -> dict:
        """The pieces read straight into their destination once the load commits (no new memory,
        no copy): a read that is exactly one piece, the only read of it, whose ``target`` is a
        contiguous host array of the checkpoint's dtype. Their MiBs are checked from the file first."""
        uses: dict = {}
        exact: dict = {}
        for read in reads:
            dtype = np.dtype(read_dtype(self.manifest, read))
            for piece in self.manifest["tensors"][read.key]["pieces"]:
                if "start" not in piece or overlap(read.slab, piece["slab"]) is None:
                    continue
                where = (piece["file"], self.byte_range(piece, dtype)[0])
                uses[where] = uses.get(where, 0) + 1
                target = read.target
                if (piece["slab"] == [list(map(int, b)) for b in read.slab] and isinstance(target, np.ndarray)
                        and target.dtype == dtype and target.flags.c_contiguous and target.size
                        and target.shape == tuple(b - a for a, b in read.slab)):
                    exact[where] = target
        return {where: target for where, target in exact.items() if uses[where] == 1}

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
            for piece, dtype in pieces:
                begin, end = self.byte_range(piece, dtype)
                if end > begin:
                    chunks.update(range(begin // CHUNK_BYTES, (end - 1) // CHUNK_BYTES + 1))
            runs[name] = merge_runs(sorted(chunks))
        return runs

    def read_and_verify(self, mine: dict) -> list[str]:
        """Read every needed piece into an array of its own (no copy; pieces that lie end to end
        in one request); check the CRC-32 of the chunks in ``mine`` ({file: set of chunks}) from
        those arrays, in file order, reading only the bytes between them (HDF5's headers,
        pieces this rank does not need)."""
        problems = []
        for name, pieces in self.needed.items():
            path = os.path.join(self.step_dir, name)
            fd = os.open(path, os.O_RDONLY)
            try:
                segments = self._read_pieces(fd, name, pieces)
                if segments is None:
                    problems.append(f"{path}: shorter than the manifest says (truncated?)")
                    continue
                starts = [start for start, _ in segments]
                facts = self.manifest["files"][name]
                for chunk in sorted(mine.get(name, ())):
                    crc = chunk_crc(fd, segments, starts, chunk * CHUNK_BYTES,
                                    min((chunk + 1) * CHUNK_BYTES, facts["bytes"]), self.scratch)
                    problems += chunk_problems(path, [crc], facts["chunks"], chunk)
            finally:
                os.close(fd)
        return problems

    def _read_pieces(self, fd: int, name: str, pieces: list) -> list | None:
        """[(first byte, uint8 view of the piece's new array)] in file order; None when the file is short."""
        segments = []
        for piece, dtype in pieces:
            begin, end = self.byte_range(piece, dtype)
            if end > begin and (name, begin) not in self.values and (name, begin) not in self.direct:
                values = self.values[(name, begin)] = np.empty(tuple(b - a for a, b in piece["slab"]), dtype=dtype)
                segments.append((begin, values.reshape(-1).view(np.uint8)))
        segments.sort(key=lambda segment: segment[0])
        return read_segments(fd, segments)

    def piece_values(self, piece: dict, dtype) -> np.ndarray:
        """The piece's array: its own the first time (the receiver may keep it), a copy after."""
        begin, end = self.byte_range(piece, dtype)
        shape = tuple(b - a for a, b in piece["slab"])
        if begin == end:
            return np.empty(shape, dtype)
        if (piece["file"], begin) in self.direct:
            return None  # read straight into its destination by fill_targets
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

    def read(self, key: str, slab) -> np.ndarray:
        """The values of ``slab`` of tensor ``key``: the piece's own array when the slab is exactly
        a piece (the layout that saved), else assembled from the parts of the pieces it overlaps."""
        table = self.manifest["tensors"][key]
        dtype = np.dtype(table["dtype"])
        wanted = [list(map(int, bounds)) for bounds in slab]
        out = None
        for piece in table["pieces"]:
            both = overlap(slab, piece["slab"])
            if both is None:
                continue
            values = self.piece_values(piece, dtype) if "start" in piece else self.legacy_values(piece, dtype)
            if piece["slab"] == wanted:
                return values
            if out is None:
                out = np.empty(tuple(b - a for a, b in slab), dtype=dtype)
            out[tuple(slice(a - s, b - s) for (a, b), (s, _) in zip(both, slab))] = \
                values[tuple(slice(a - p, b - p) for (a, b), (p, _) in zip(both, piece["slab"]))]
        return out if out is not None else np.empty(tuple(b - a for a, b in slab), dtype=dtype)

    def fill_targets(self) -> list[str]:
        """Read the direct pieces into their destinations (after the load committed; their MiBs
        were checked against the manifest, so this reads the same bytes again, from the page cache)."""
        problems = []
        by_file: dict = {}
        for (name, begin), target in self.direct.items():
            by_file.setdefault(name, []).append((begin, target.reshape(-1).view(np.uint8)))
        for name, segments in by_file.items():
            fd = os.open(os.path.join(self.step_dir, name), os.O_RDONLY)
            try:
                if read_segments(fd, sorted(segments, key=lambda segment: segment[0])) is None:
                    problems.append(f"{os.path.join(self.step_dir, name)}: shorter than when it was checked")
            finally:
                os.close(fd)
        return problems

    def close(self) -> None:
        for f in self.h5files.values():
            f.close()


def read_dtype(manifest: dict, read) -> str:
    return manifest["tensors"][read.key]["dtype"]


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


def chunk_crc(fd: int, segments: list, starts: list, begin: int, end: int, scratch: np.ndarray) -> str:
    """CRC-32 of the file's bytes [begin, end) (one chunk at most): from the pieces' arrays
    (``segments``: (first byte, uint8 array), sorted; ``starts``: their first bytes) where they
    cover it, read from the file into ``scratch`` between them."""
    crc, at = 0, begin
    first = max(bisect.bisect_right(starts, begin) - 1, 0)
    for start, raw in segments[first:]:
        if start >= end:
            break
        stop = start + raw.size
        if stop <= at:
            continue
        if start > at:
            crc = crc32(read_into(fd, scratch, at, start - at), crc)
            at = start
        upto = min(stop, end)
        crc = crc32(raw[at - start: upto - start], crc)
        at = upto
    if at < end:
        crc = crc32(read_into(fd, scratch, at, end - at), crc)
    return f"{crc:08x}"


def read_into(fd: int, scratch: np.ndarray, at: int, size: int) -> np.ndarray:
    """``size`` bytes of the file from ``at``, in the reused ``scratch`` (fewer if the file is short)."""
    return scratch[:os.preadv(fd, [scratch[:size]], at)]


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
    comm = ctx.world.mpi
    step_dir = resolve_step_dir(path, step)
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
    damaged, values, extras, restored = [], [], {}, []
    try:
        damaged = source.read_and_verify(verifier_chunks([mine["runs"] for mine in everyone], comm.Get_rank()))
        if not damaged:
            values = [source.read(read.key, read.slab) for read in plan.reads]
    except (OSError, ValueError, KeyError) as error:
        damaged.append(f"{type(error).__name__}: {error}")
    finally:
        source.close()
    refused = []
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
    if failed:
        raise CheckpointDamaged(f"{what}: {'; '.join(failed)} (the model is partly loaded: load again)")
    for read, value in zip(plan.reads, values):
        if value is not None:
            read.assign(value)
    for finish in plan.finish:
        finish()
    restore_streams(manifest, extra, ctx)
    return {"step": manifest["step"], "step_dir": step_dir, "layout": manifest["layout"], "extra": extras}


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
