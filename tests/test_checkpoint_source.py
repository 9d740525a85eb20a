"""The byte layer of a load (``hpcpar.checkpoint.source``) against plain rules: which rank checks
which MiB, the runs of MiBs a rank reads, the CRC-32 of many spans at once, the copy table."""
import random
import zlib

import numpy as np
import pytest

from hpcpar.checkpoint import crc, fastcopy
from hpcpar.checkpoint.manifest import CHUNK_BYTES
from hpcpar.checkpoint.source import RawSource, verifier_chunks


def checkers_by_rule(everyone: list[dict], rank: int) -> dict:
    """The rule, chunk by chunk: chunk c is checked by the ``c % n``-th of its n readers in rank order."""
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


def test_each_chunk_is_checked_by_exactly_the_reader_the_rule_names():
    rng = random.Random(1)
    for _ in range(500):
        everyone = []
        for _ in range(rng.randint(1, 5)):
            runs = {}
            for name in ("a", "b", "c"):
                if rng.random() < 0.7:
                    at, file_runs = 0, []
                    for _ in range(rng.randint(0, 4)):
                        at += rng.randint(1 if file_runs else 0, 5)
                        file_runs.append((at, at + rng.randint(1, 6)))
                        at = file_runs[-1][1]
                    runs[name] = file_runs
            everyone.append(runs)
        for rank in range(len(everyone)):
            found = verifier_chunks(everyone, rank)
            assert {name: set(chunks.tolist()) for name, chunks in found.items()} == checkers_by_rule(everyone, rank)
            assert all(len(chunks) == len(set(chunks.tolist())) for chunks in found.values())


def test_chunk_runs_merge_the_mibs_of_pieces_that_touch_or_share_one():
    source = RawSource.__new__(RawSource)
    mib = CHUNK_BYTES
    pieces = [(0, 10), (10, mib + 5), (3 * mib, 3 * mib + 1), (3 * mib + 7, 4 * mib), (4 * mib, 4 * mib + 3),
              (9 * mib + 1, 9 * mib + 2)]
    source.needed = {"f": {begin: (end, None, None) for begin, end in reversed(pieces)}}
    assert source.chunk_runs() == {"f": [(0, 2), (3, 5), (9, 10)]}


@pytest.mark.parametrize("library", ["built", "without the spans function", "none"])
def test_the_crc_of_many_spans_is_zlibs_of_each(monkeypatch, library):
    if library != "built":  # a library built before hpcpar_crc32_spans: a call per span
        monkeypatch.setitem(crc._state, "spans", None)
    if library == "none":  # zlib
        monkeypatch.setitem(crc._state, "blocks", None)
    data = np.random.default_rng(2).integers(0, 256, 3 * CHUNK_BYTES + 77, dtype=np.uint8)
    offsets = np.array([0, 1, 5, 17, 100, CHUNK_BYTES, 2 * CHUNK_BYTES + 3, 0], dtype=np.int64)
    lengths = np.array([0, 1, 63, 64, 1000, CHUNK_BYTES, CHUNK_BYTES + 74, 3 * CHUNK_BYTES + 77], dtype=np.int64)
    found = crc.crc32_spans(data, offsets, lengths)
    assert found.tolist() == [zlib.crc32(data[a: a + n]) for a, n in zip(offsets.tolist(), lengths.tolist())]
    assert crc.crc32_spans(data, offsets[:0], lengths[:0]).size == 0


def test_the_copy_table_copies_each_span_and_nothing_else(monkeypatch):
    rng = np.random.default_rng(3)
    source = rng.integers(0, 256, 1 << 20, dtype=np.uint8)
    for native in (True, False):
        if not native:
            monkeypatch.setitem(fastcopy._state, "copy", None)
        destination = np.zeros(1 << 20, dtype=np.uint8)
        spans = [(5, 9, 300 << 10), (400 << 10, 3, 1), (600 << 10, 700 << 10, 100)]
        fastcopy.copy_spans(np.array([fastcopy.address(destination) + d for d, _, _ in spans], dtype=np.uint64),
                            np.array([source.ctypes.data + s for _, s, _ in spans], dtype=np.uint64),
                            np.array([n for _, _, n in spans], dtype=np.uint64))
        expected = np.zeros_like(destination)
        for d, s, n in spans:
            expected[d: d + n] = source[s: s + n]
        assert np.array_equal(destination, expected)


def test_a_plans_copies_go_alike_arrays_in_one_native_call_and_the_rest_by_assignment(monkeypatch):
    """``LoadPlan.copies`` (ZeRO-1's shard of its flat parameters): host arrays of one dtype through
    ``copy_pieces``, a cast (float64 into float32 here) by assignment; each destination ends equal
    to its source."""
    calls = []
    monkeypatch.setattr(fastcopy, "copy_pieces", lambda pairs: calls.append(len(pairs)) or
                        [d.__setitem__(Ellipsis, s) for d, s in pairs])
    rng = np.random.default_rng(4)
    flat = rng.standard_normal(1000).astype(np.float32)
    alike, cast = np.zeros(400, np.float32), np.zeros(300, np.float32)
    wide = rng.standard_normal(300)
    fastcopy.copy_arrays([(alike, flat[600:]), (cast, wide)])
    assert calls == [1]
    assert np.array_equal(alike, flat[600:]) and np.array_equal(cast, wide.astype(np.float32))
