"""The bytes a load reads and checks, without HDF5: which pieces of which shard files this rank's
reads overlap, the MiB chunks holding them (each checked by one of the ranks that read it,
against its CRC-32 in the manifest), and the copy of checked bytes into their destinations.

``reader`` runs the load as a transaction over the ranks; this module is its byte layer (its
docstring describes how the bytes are mapped, checked and copied).
"""
from __future__ import annotations

import bisect
import functools
import math
import mmap
import os

import h5py
import numpy as np

from .crc import crc32, crc32_spans
from .fastcopy import address, copy_spans
from .manifest import CHUNK_BYTES, CheckpointDamaged, chunk_problems


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
        self.exact: list = []  # per read: (file, first byte) of the piece that is exactly its slab, or None
        shared: set = set()
        exact: dict = {}
        rows: list = []  # (file, first byte, bytes, destination address) of each exact piece with a target
        tensors, files = manifest["tensors"], manifest["files"]
        for read in reads:  # one pass: the pieces each read overlaps, their bytes, whether direct
            table = tensors[read.key]
            dtype, parts, exactly = dtype_named(table["dtype"]), [], None
            wanted = [[a, b] for a, b in read.slab]  # as the manifest's JSON writes a slab
            for piece in table["pieces"]:
                same = piece["slab"] == wanted
                both = read.slab if same else overlap(read.slab, piece["slab"])
                if both is None:
                    continue
                parts.append((piece, both))
                name = piece["file"]
                if "start" not in piece:
                    self.legacy.add(name)
                    continue
                shape = tuple([b - a for a, b in piece["slab"]])
                nbytes = math.prod(shape) * dtype.itemsize
                if not nbytes:
                    continue
                begin = files[name]["blobs"][piece["dataset"]] + piece["start"] * dtype.itemsize
                where = (name, begin)
                pieces = self.needed.setdefault(name, {})
                if begin in pieces:  # a piece more than one read takes
                    shared.add(where)
                pieces[begin] = (begin + nbytes, shape, dtype)
                if same:
                    exactly = where
                    at = destination_address(read.target, dtype, shape)
                    if at is not None:
                        exact[where] = read.target
                        rows.append((name, begin, nbytes, at))
            self.parts.append(parts)
            self.exact.append(exactly)
        # Read straight into the destination once the load commits (no new memory, no copy): a
        # read that is exactly one piece, the only read of it, whose ``target`` is a writable
        # contiguous host array of the checkpoint's dtype. Their MiBs are checked from the file first.
        self.direct = {where: target for where, target in exact.items() if where not in shared}
        self.spans = direct_spans([row for row in rows if row[:2] not in shared] if shared else rows)

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
            merged: list = []
            for begin in sorted(pieces):  # pieces in byte order: each extends the last run or starts one
                first, end = begin // CHUNK_BYTES, (pieces[begin][0] - 1) // CHUNK_BYTES + 1
                if merged and first <= merged[-1][1]:
                    merged[-1][1] = max(merged[-1][1], end)
                else:
                    merged.append([first, end])
            runs[name] = [tuple(run) for run in merged]
        return runs

    def read_and_verify(self, mine: dict) -> list[str]:
        """Read every needed piece that is not direct into an array of its own (no copy; pieces
        that lie end to end in one request); map the bytes this rank reads or checks (the page
        cache's own pages: nothing copied, kept for ``fill_targets``); check the CRC-32 of the
        chunks in ``mine`` ({file: chunk numbers}) from those arrays where they hold the bytes,
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
                chunks = np.sort(np.asarray(mine.get(name, ()), dtype=np.int64))[::-1]
                mapped = self.maps[name] = FileMap(fd, self._mapped_range(name, chunks, facts["bytes"]))
                problems += chunk_problems_of(path, chunks, chunk_crcs(mapped, segments, chunks, facts["bytes"]),
                                              facts["chunks"])
            finally:
                os.close(fd)
        return problems

    def _mapped_range(self, name: str, chunks: np.ndarray, size: int) -> tuple[int, int]:
        """[begin, end) of the file to map: the chunks this rank checks and the direct pieces' bytes."""
        ends = [(int(chunks.min()) * CHUNK_BYTES, min((int(chunks.max()) + 1) * CHUNK_BYTES, size))] if chunks.size else []
        if name in self.spans:
            begins, lengths, _ = self.spans[name]
            ends.append((int(begins[0]), int(begins[-1] + lengths[-1])))
        return (min(b for b, _ in ends), max(e for _, e in ends)) if ends else (0, 0)

    def _read_pieces(self, fd: int, name: str, pieces: dict) -> list | None:
        """[(first byte, uint8 view of the piece's new array)] in file order; None when the file is short."""
        segments = []
        if name in self.spans and len(self.spans[name][0]) == len(pieces):
            return segments  # every piece is direct (a load into the layout that saved): none to read
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

    def read_all(self, reads) -> list:
        """``read`` of each of the plan's reads (None for the direct ones, without a call)."""
        return [None if where in self.direct else self.read(n, read)
                for n, (read, where) in enumerate(zip(reads, self.exact))]

    def fill_targets(self) -> list[str]:
        """Copy the direct pieces into their destinations, in file order (after the load committed:
        from the mapped pages whose chunks were checked against the manifest); the files that
        shrank since (then nothing is copied)."""
        shrunk = [f"{os.path.join(self.step_dir, name)}: shorter than when it was checked"
                  for name, mapped in self.maps.items() if mapped.shrunk()]
        if shrunk:
            return shrunk
        table = [(addresses, self.maps[name].address(begins), lengths)
                 for name, (begins, lengths, addresses) in sorted(self.spans.items())]
        if table:
            copy_spans(*(np.concatenate(column) for column in zip(*table)))
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

    def address(self, begins: np.ndarray) -> np.ndarray:
        """The addresses of the file's bytes ``begins`` (inside the mapped span), as uint64."""
        return (begins - self.begin).astype(np.uint64) + np.uint64(self.data.ctypes.data)

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


def destination_address(target, dtype, shape: tuple) -> int | None:
    """The first byte of ``target`` when it can take a piece's bytes as they are (a writable
    contiguous host array of that dtype and shape), else None."""
    if not isinstance(target, np.ndarray) or target.dtype != dtype or target.shape != shape or not target.size \
            or not target.flags.c_contiguous:
        return None
    try:
        return address(target)  # a buffer export, which a read-only array refuses
    except TypeError:
        return None


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


def direct_spans(rows: list) -> dict:
    """{file: (first bytes, lengths, destination addresses)} in byte order, of the direct pieces'
    ``rows`` (file, first byte, bytes, address): the copy's table, and the span ``FileMap`` maps."""
    by_file: dict = {}
    for name, begin, nbytes, where in rows:
        by_file.setdefault(name, []).append((begin, nbytes, where))
    spans = {}
    for name, file_rows in by_file.items():
        file_rows.sort()
        begins, lengths, addresses = zip(*file_rows)
        spans[name] = (np.array(begins, dtype=np.int64), np.array(lengths, dtype=np.int64),
                       np.array(addresses, dtype=np.uint64))
    return spans


def chunk_crcs(mapped: FileMap, segments: list, chunks: np.ndarray, size: int) -> list[str]:
    """The CRC-32 of each of the file's ``chunks``, as the manifest writes them: from the mapping in
    one call, except where a piece read into an array of its own (``segments``) covers part of a
    chunk: those bytes are the ones used, so ``chunk_crc`` takes them from there."""
    begins = chunks * CHUNK_BYTES
    ends = np.minimum(begins + CHUNK_BYTES, size)
    if not segments:  # no piece of the file read into an array of its own: all from the mapping
        return [f"{crc:08x}" for crc in crc32_spans(mapped.data, begins - mapped.begin, ends - begins).tolist()]
    starts = np.array([start for start, _ in segments], dtype=np.int64)
    stops = starts + np.array([raw.size for _, raw in segments], dtype=np.int64)
    following = np.searchsorted(stops, begins, side="right")  # the first segment ending after the chunk's start
    covered = (following < len(segments)) & (starts[np.minimum(following, len(segments) - 1)] < ends)
    crcs = np.zeros(chunks.size, dtype=np.uint32)
    plain = ~covered
    crcs[plain] = crc32_spans(mapped.data, begins[plain] - mapped.begin, ends[plain] - begins[plain])
    found = [f"{crc:08x}" for crc in crcs.tolist()]
    for k in np.flatnonzero(covered).tolist():
        found[k] = chunk_crc(mapped, segments, int(begins[k]), int(ends[k]))
    return found


def chunk_problems_of(path: str, chunks: np.ndarray, found: list[str], expected: list[str]) -> list[str]:
    """``chunk_problems`` of chunks in any order, in chunk order; a manifest listing too few is damage."""
    if chunks.size and int(chunks.max()) >= len(expected):
        return [f"{path}: the manifest lists {len(expected)} checksums, the file has chunk {int(chunks.max())} (damaged)"]
    bad = sorted((c, crc) for c, crc in zip(chunks.tolist(), found) if crc != expected[c])
    return [line for c, crc in bad for line in chunk_problems(path, [crc], expected, c)]


def verifier_chunks(everyone: list[dict], rank: int) -> dict:
    """{file: chunks this rank checks}: each chunk some rank reads is checked by one of its readers
    (in turn, so replicas that read the same file share the CRC work: chunk c by the
    ``c % readers``-th of its readers in rank order). Worked out per stretch of chunks with the
    same readers, not per chunk: a replica's runs are one stretch per file."""
    mine: dict = {}
    for name in sorted(set().union(*everyone)):
        runs = [rank_runs.get(name, []) for rank_runs in everyone]
        starts = [[first for first, _ in file_runs] for file_runs in runs]
        cuts = sorted({bound for file_runs in runs for run in file_runs for bound in run})
        picked = []
        for low, high in zip(cuts, cuts[1:]):
            readers = [r for r, file_runs in enumerate(runs)
                       if (k := bisect.bisect_right(starts[r], low) - 1) >= 0 and low < file_runs[k][1]]
            if rank in readers and (first := low + (readers.index(rank) - low) % len(readers)) < high:
                picked.append(np.arange(first, high, len(readers)))
        if picked:
            mine[name] = np.concatenate(picked)
    return mine
