"""Checks of the paths a command is given, made before it reads or writes anything.

Each returns None when the path will do, else what is wrong and the fix, as the end of a sentence
that starts with the path (``"afile/m.jsonl" cannot be made: afile is a file, not a folder; give a
path under a folder``), so that the caller names the key or flag in front of it:

- ``input_problem(path)``: an existing regular file. A folder fails late with an error that
  names neither, and opening a FIFO (a named pipe) blocks until someone writes to it.
- ``output_problem(path, folder=False)``: a file (``folder``: a folder) that can be made: not a
  folder where a file goes nor a file where a folder goes, and under a writable folder. Missing
  folders in between are fine: the writer makes them.
"""
from __future__ import annotations

import os
import stat


def input_problem(path: str) -> str | None:
    """Why ``path`` is not a readable regular file, or None."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return "does not exist"
    except OSError as error:
        return f"cannot be read ({error.strerror})"
    if stat.S_ISDIR(mode):
        return "is a folder, not a file"
    if not stat.S_ISREG(mode):
        return "is not a regular file (a named pipe or a device: reading it would wait for a writer)"
    if not os.access(path, os.R_OK):
        return "cannot be read (no read permission)"
    return None


def output_problem(path: str, folder: bool = False) -> str | None:
    """Why ``path`` cannot be written as a file (``folder``: made as a folder), or None."""
    if os.path.isdir(path) and not folder:
        return "is a folder; give the path of a file"
    if os.path.lexists(path) and not os.path.isdir(path):
        if folder:
            return "is a file, not a folder; give the path of a folder"
        if not os.path.isfile(path):
            return "is not a regular file (a named pipe or a device); give the path of a file"
    parent = os.path.dirname(os.path.abspath(path))
    while not os.path.lexists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        return f"cannot be made: {parent} is a file, not a folder; give a path under a folder"
    target = path if os.path.exists(path) else parent
    if not os.access(target, os.W_OK):
        return f"cannot be written: no write permission on {target}; give a path you may write"
    return None
