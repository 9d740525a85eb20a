"""Rank 0's end of a save: the written ``step-N.tmp`` folder becomes ``step-N`` atomically, ``latest``
points at it, and retention removes the steps the save retires.

``writer`` runs the save as a transaction over the ranks and calls these once every rank's files
are written and measured.
"""
from __future__ import annotations

import json
import os
import shutil

from .manifest import LATEST, MANIFEST, fsync_path, fsync_together, list_steps, step_dirname


def publish(manifest: dict, tmp_dir: str, step_dir: str, root: str, latest_ready) -> None:
    """Write ``manifest.json`` into ``tmp_dir``, rename the folder to ``step_dir`` and point
    ``latest`` at it (``latest_ready``: the new ``latest``, a ``DurableFile`` written meanwhile)."""
    # The folder's rename makes the manifest appear atomically; it and the folder's entries
    # must be on disk first (the two fsyncs at once). dumps uses the C encoder, dump(f) Python's.
    with open(os.path.join(tmp_dir, MANIFEST), "w") as f:
        f.write(json.dumps(manifest, sort_keys=True))
    fsync_together(os.path.join(tmp_dir, MANIFEST), tmp_dir)
    latest_tmp = latest_ready.path()  # written before the rename: a full disk fails here, nothing renamed
    replaced = step_dir + ".old"
    if os.path.exists(step_dir):  # re-saving a step: the old copy goes once the new one is in place
        shutil.rmtree(replaced, ignore_errors=True)
        os.rename(step_dir, replaced)
    os.rename(tmp_dir, step_dir)
    os.replace(latest_tmp, os.path.join(root, LATEST))
    fsync_path(root)  # both renames at once (a crash between them leaves the previous latest)
    shutil.rmtree(replaced, ignore_errors=True)


def retire(root: str, written: int, keep: int | None) -> None:
    """Keep the last ``keep`` steps up to ``written`` (None or 0: keep all)."""
    if keep:
        for old in retired_steps(list_steps(root), written, keep):
            shutil.rmtree(os.path.join(root, step_dirname(old)), ignore_errors=True)


def retired_steps(steps: list[int], written: int, keep: int) -> list[int]:
    """The steps a save of ``written`` removes: all but the last ``keep`` up to and including it.
    Steps above it are left alone (another run's, or a run that went further before a restart)."""
    mine = [s for s in steps if s <= written]
    return mine[:-keep] if keep > 0 else []
