"""Which data file a run trained on, in a few numbers: enough to tell another file from the same one.

    file_identity("data/stdlib.h5")
    {"path": "data/stdlib.h5", "bytes": 8912384, "tokens": 8388608, "sample_sha256": "3f0c..."}

Hashing a whole multi-GiB token file at every start would cost more than a step; the first and
the last MiB (which hold the HDF5 header and the ends of both splits) plus the exact size and
token count tell files apart in practice, and a moved or renamed copy is still the same data.
"""
from __future__ import annotations

import hashlib
import os

SAMPLE_BYTES = 1 << 20  # hashed at each end of the file


def sample_digest(path: str, sample: int = SAMPLE_BYTES) -> str:
    """SHA-256 of the first and last ``sample`` bytes of the file (all of it when it is smaller)."""
    digest = hashlib.sha256()
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        digest.update(f.read(sample))
        if size > sample:
            f.seek(max(sample, size - sample))
            digest.update(f.read(sample))
    return digest.hexdigest()


def file_identity(path: str) -> dict:
    """Path, size, token count (train + val) and the digest of both ends of a token file."""
    from .loader import dataset_info

    info = dataset_info(path)
    return {"path": path, "bytes": os.path.getsize(path), "tokens": int(info.get("train", 0)) + int(info.get("val", 0)),
            "sample_sha256": sample_digest(path)}
