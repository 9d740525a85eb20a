"""Real text without downloads: the Python standard library's own source files, as bytes.

Every machine with Python has tens of MB of it, so byte-level language models train on
real text everywhere, and the same files in the same (sorted) order give the same corpus.
"""
from __future__ import annotations

import os
import sysconfig

import numpy as np


def stdlib_files() -> list[str]:
    """The standard library's .py files, sorted, excluding site-packages and tests."""
    root = sysconfig.get_paths()["stdlib"]
    files = []
    for folder, subfolders, names in os.walk(root):
        subfolders[:] = sorted(d for d in subfolders if d not in ("site-packages", "test", "tests", "__pycache__"))
        files += [os.path.join(folder, n) for n in sorted(names) if n.endswith(".py")]
    return files


def read_text_bytes(paths, max_bytes: int | None = None) -> np.ndarray:
    """Concatenate files as uint8 bytes (one byte = one token), stopping after ``max_bytes``."""
    chunks, total = [], 0
    for path in paths:
        with open(path, "rb") as f:
            data = f.read()
        if max_bytes is not None:
            data = data[: max_bytes - total]
        chunks.append(np.frombuffer(data, dtype=np.uint8))
        total += len(data)
        if max_bytes is not None and total >= max_bytes:
            break
    if not chunks:
        raise FileNotFoundError("no text files to read")
    return np.concatenate(chunks)


def stdlib_corpus(max_bytes: int | None = 1 << 20) -> np.ndarray:
    return read_text_bytes(stdlib_files(), max_bytes)


def batch_windows(tokens: np.ndarray, starts: np.ndarray, block_size: int) -> tuple[np.ndarray, np.ndarray]:
    """Inputs (B, T) and next-token targets (B, T) from windows starting at ``starts``."""
    offsets = starts[:, None] + np.arange(block_size + 1)[None, :]
    windows = tokens[offsets].astype(np.int64)
    return windows[:, :-1], windows[:, 1:]
