"""``hpcpar ckpt``: look at, check and export checkpoints from a login node (serial, no MPI).

    hpcpar ckpt ls ROOT               every step: when committed, layout, size, valid?, which is latest
    hpcpar ckpt inspect PATH          step, layout, extras, and each tensor: global shape, pieces, files
    hpcpar ckpt verify PATH           files vs manifest (size, CRC-32) and the index's virtual sources
    hpcpar ckpt export PATH OUT.h5    one plain HDF5 file (no virtual datasets) of every global tensor

PATH is a checkpoint root (its ``latest`` step) or one step folder. ``verify`` exits 1 and
prints one line per problem, each naming the file; any other failure is one line on stderr
and exit status 1. ``export`` checks OUT before it reads a tensor: never inside a step folder
(it would damage that checkpoint), its missing folders made. Started by mpiexec, rank 0 alone
acts and speaks.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time

import h5py

from .. import log
from ..paths import output_problem
from ..tables import format_table, human_bytes
from .manifest import (INDEX, LATEST, MANIFEST, CheckpointError, latest_step, layout_words, list_steps,
                       read_manifest, resolve_step_dir, step_dirname, verify_files)
from ..state import saved_weight_decays

TMP_PATTERN = re.compile(r"^step-(\d{8})\.tmp$")
EXPORT_BLOCK_BYTES = 64 << 20  # export copies big tensors in row blocks of about this size


# ----------------------------------------------------------------------------------------
# Checks
# ----------------------------------------------------------------------------------------
def check(step_dir: str, nonfinite: list | None = None, checksums: bool = True) -> list[str]:
    """Every problem of one step folder, one line each naming the file (empty when valid); a
    ``nonfinite`` list gets the tensor pieces holding inf or NaN (``verify_files``)."""
    try:
        manifest = read_manifest(step_dir)
    except CheckpointError as error:
        return [str(error)]
    if checksums:
        problems = verify_files(step_dir, manifest, nonfinite=nonfinite)
    else:
        problems = []
        for name, facts in sorted(manifest["files"].items()):
            size = _size(os.path.join(step_dir, name))
            if size != facts["bytes"]:
                problems.append(f"{os.path.join(step_dir, name)}: " + ("missing" if size is None else
                                f"{size} bytes, the manifest says {facts['bytes']} (truncated?)"))
    for key, table in sorted(manifest["tensors"].items()):
        for piece in table["pieces"]:
            if piece["file"] not in manifest["files"]:
                problems.append(f"{os.path.join(step_dir, piece['file'])}: holds a piece of {key} but is not "
                                f"among the manifest's files")
    return problems + _check_index(step_dir, manifest, problems)


def _check_index(step_dir: str, manifest: dict, known: list[str]) -> list[str]:
    """Each manifest tensor is a virtual dataset of index.h5 whose source files all exist.

    HDF5 reads a missing source file as fill values without an error, so this is checked
    here rather than discovered by reading.
    """
    index_path = os.path.join(step_dir, INDEX)
    if any(line.startswith(f"{index_path}:") for line in known):
        return []  # already reported as missing or damaged; its contents cannot be trusted
    problems, missing = [], {}
    try:
        with h5py.File(index_path, "r") as index:
            for key in sorted(manifest["tensors"]):
                if key not in index:
                    problems.append(f"{index_path}: no dataset {key!r} (the manifest lists it)")
                    continue
                dataset = index[key]
                if not dataset.is_virtual:
                    problems.append(f"{index_path}: {key!r} is not a virtual dataset")
                    continue
                for source in dataset.virtual_sources():
                    if source.file_name == ".":  # a source inside index.h5 itself
                        continue
                    path = os.path.join(step_dir, source.file_name)
                    if not os.path.isfile(path):
                        missing.setdefault(path, []).append(key)
                    elif os.path.basename(source.file_name) not in manifest["files"]:
                        problems.append(f"{path}: a source of {key!r} in index.h5 but not among the manifest's files")
    except OSError as error:
        return [f"{index_path}: unreadable ({error})"]
    for path, keys in sorted(missing.items()):
        problems.append(f"{path}: missing, yet index.h5 maps {len(keys)} virtual dataset(s) onto it "
                        f"(e.g. {keys[0]}); reading them would return fill values")
    return problems


def _size(path: str) -> int | None:
    return os.path.getsize(path) if os.path.isfile(path) else None


def _folder_bytes(path: str) -> int:
    return sum(entry.stat().st_size for entry in os.scandir(path) if entry.is_file())


def _layout(layout: dict) -> str:
    cp = f" cp{layout['cp']}" if layout.get("cp", 1) > 1 else ""  # the column's dp/pp/tp/world, cp named
    return f"{layout['dp']}/{layout['pp']}/{layout['tp']}/{layout['world']}{cp}"


def _when(seconds: float | None) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(seconds)) if seconds else "-"


# ----------------------------------------------------------------------------------------
# Subcommands (each returns the exit status)
# ----------------------------------------------------------------------------------------
def ls(args) -> int:
    root = args.root
    if not os.path.isdir(root):
        raise CheckpointError(f"{root}: " + ("a file, not a folder; give a checkpoint root (checkpoint.dir)"
                                            if os.path.lexists(root) else "no such folder"))
    latest = latest_step(root)
    steps = list_steps(root)
    rows, invalid = [], []
    for step in steps:
        step_dir = os.path.join(root, step_dirname(step))
        problems = check(step_dir, checksums=not args.quick)
        try:
            manifest = read_manifest(step_dir)
            committed, layout = _when(manifest.get("created")), _layout(manifest["layout"])
        except CheckpointError:
            committed, layout = "-", "-"
        if problems:
            invalid.append(step_dir)
        rows.append(["latest" if step == latest else "", step, committed, layout, human_bytes(_folder_bytes(step_dir)),
                     f"NO ({len(problems)} problem{'s' if len(problems) > 1 else ''})" if problems else "yes"])
    leftovers = sorted(name for name in os.listdir(root) if TMP_PATTERN.match(name)
                       and os.path.isdir(os.path.join(root, name)))
    for name in leftovers:
        rows.append(["", int(TMP_PATTERN.match(name).group(1)), "-", "-",
                     human_bytes(_folder_bytes(os.path.join(root, name))), "incomplete (ignored)"])
    if not rows:
        print(f"{root}: no checkpoints")
        return 0
    checked = "sizes only" if args.quick else "sizes and CRC-32"
    print(format_table(["", "step", "committed", "dp/pp/tp/world", "size", "valid?"], rows,
                       f"checkpoints under {root} (valid?: files vs manifest, {checked}; index.h5 sources)"))
    if latest is not None and latest not in steps:
        print(f"warning: {os.path.join(root, LATEST)} names {step_dirname(latest)}, which does not exist; "
              f"loading the latest will fail", file=sys.stderr)
    for step_dir in invalid:
        print(f"details: hpcpar ckpt verify {step_dir}")
    return 0


def inspect(args) -> int:
    step_dir = resolve_step_dir(args.path)
    manifest = read_manifest(step_dir)
    layout = manifest["layout"]
    data_bytes = sum(facts["bytes"] for name, facts in manifest["files"].items() if name != INDEX)
    shards = sum(1 for name in manifest["files"] if name != INDEX)
    lines = [f"checkpoint  {step_dir}",
             f"step        {manifest['step']}",
             f"committed   {_when(manifest.get('created'))}",
             f"layout      {layout_words(layout)} = {layout['world']} ranks",
             f"files       {shards} shard file(s), {human_bytes(data_bytes)}; {INDEX}, {MANIFEST}"]
    lines += provenance_lines(manifest["extra"])
    for name, saved in sorted(manifest["extra"].items()):
        if name in ("provenance", "fingerprint"):
            continue
        shown = json.dumps(saved.get("value", saved.get("state_dict")), sort_keys=True)
        kind = "" if "value" in saved else " (state_dict)"
        lines.append(f"extra       {name}{kind} = {shown if len(shown) <= 100 else shown[:97] + '...'}")
    per_rank = sorted({name for state in manifest["rank_state"].values() for name in state})
    for name in per_rank:
        holders = sum(1 for state in manifest["rank_state"].values() if name in state)
        lines.append(f"rank state  {name} (random stream, {holders} rank(s))")
    decays = saved_weight_decays(manifest["scalars"])
    scalars = {}
    for key, value in manifest["scalars"].items():
        if key.startswith("optim/"):
            scalars.setdefault(key.rsplit("/", 1)[-1], []).append(value)
    for name, values in sorted(scalars.items()):
        lines.append(f"scalars     optim/*/{name} = {', '.join(map(str, sorted(set(values))))} ({len(values)} tensors)")
    for value in sorted(set(decays.values()), reverse=True):
        named = sorted(name for name, v in decays.items() if v == value)
        shown = ", ".join(named) if len(named) <= 3 else f"{', '.join(named[:3])}, ..."
        lines.append(f"decay       weight_decay {value:g}: {len(named)} parameter(s) ({shown})")
    print("\n".join(lines) + "\n")

    rows = []
    width = max((len(key) for key in manifest["tensors"]), default=0)
    for key, table in sorted(manifest["tensors"].items()):
        files = sorted({piece["file"] for piece in table["pieces"]})
        shown = ", ".join(files) if len(files) <= 3 else f"{files[0]} .. {files[-1]} ({len(files)} files)"
        rows.append([key.ljust(width), "x".join(map(str, table["shape"])) or "scalar", table["dtype"],
                     len(table["pieces"]), shown])
    print(format_table(["tensor", "global shape", "dtype", "pieces", "files"], rows,
                       f"{len(rows)} tensors (read any of them at its global shape from {INDEX} with plain h5py)"))
    return 0


def provenance_lines(extra: dict) -> list[str]:
    """Where a checkpoint of ``hpcpar train`` came from: run, command, versions, hosts, fingerprint."""
    record = (extra.get("provenance") or {}).get("value")
    lines = []
    if record:
        command, env = record.get("command", {}), record.get("env", {})
        lines += [f"run         {record.get('run_id')} (job {record.get('job_source')}"
                  + (f", initialised from {record['started_from']}" if record.get("started_from") else "") + ")",
                  f"command     {command.get('argv')}",
                  f"            world size {command.get('world_size')}, launcher {command.get('launcher')}, "
                  f"in {command.get('cwd')}",
                  f"versions    hpcpar {env.get('hpcpar')} (git {env.get('git_sha') or '-'}), Python {env.get('python')}, "
                  f"NumPy {env.get('numpy')}, mpi4py {env.get('mpi4py')}, h5py {env.get('h5py')} (HDF5 {env.get('hdf5')})",
                  f"MPI         {env.get('mpi_library')}",
                  f"hosts       {', '.join(env.get('hosts') or [])}"]
    fingerprint = (extra.get("fingerprint") or {}).get("value")
    if fingerprint:
        data = fingerprint.get("data") or {}
        shown = (f"{data['path']} ({data.get('bytes')} bytes, {data.get('tokens')} tokens, sha256 of both ends "
                 f"{str(data.get('sample_sha256'))[:16]})" if "path" in data else data.get("kind"))
        model = ", ".join(f"{k} {v}" for k, v in sorted((fingerprint.get("model") or {}).items()))
        lines += [f"fingerprint model: {model}",
                  f"            data: {shown}; optimizer {fingerprint.get('optimizer')}, "
                  f"precision {fingerprint.get('precision')}"]
    return lines


def verify(args) -> int:
    step_dir = resolve_step_dir(args.path)
    nonfinite: list = []
    problems = check(step_dir, nonfinite)
    for line in problems + nonfinite:
        print(line)
    if problems or nonfinite:
        what = [f"{len(problems)} problem(s)"] if problems else []
        what += [f"{len(nonfinite)} tensor piece(s) with inf or NaN"] if nonfinite else []
        print(f"hpcpar ckpt verify: {step_dir} is NOT valid ({', '.join(what)})", file=sys.stderr)
        return 1
    manifest = read_manifest(step_dir)
    print(f"{step_dir}: valid ({len(manifest['files'])} files checked (size, CRC-32, every float finite), "
          f"{len(manifest['tensors'])} virtual datasets with all sources present)")
    return 0


def export(args) -> int:
    """Copy every tensor, read at its global shape through index.h5, into one plain HDF5 file."""
    step_dir = resolve_step_dir(args.path)
    if problem := export_problem(args.out):
        raise CheckpointError(f"{args.out}: {problem}")
    problems = check(step_dir)
    if problems:
        raise CheckpointError(f"refusing to export {step_dir}: it fails verification ({len(problems)} problem(s); "
                              f"see hpcpar ckpt verify), first: {problems[0]}")
    manifest = read_manifest(step_dir)
    tmp = f"{args.out}.tmp"  # a failed export leaves no half-written OUT behind
    total = 0
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    try:
        with h5py.File(os.path.join(step_dir, INDEX), "r") as index, h5py.File(tmp, "w", libver="latest") as out:
            out.attrs["step"] = manifest["step"]
            out.attrs["layout"] = json.dumps(manifest["layout"])
            out.attrs["manifest"] = json.dumps(manifest, sort_keys=True)  # libver latest: no 64 KiB attribute limit
            for key, table in sorted(manifest["tensors"].items()):
                source = index[key]
                target = out.create_dataset(key, shape=source.shape, dtype=source.dtype)
                if source.ndim == 0:
                    target[()] = source[()]
                else:
                    row_bytes = max(1, source.dtype.itemsize * source.size // max(1, source.shape[0]))
                    block = max(1, EXPORT_BLOCK_BYTES // row_bytes)
                    for start in range(0, source.shape[0], block):
                        target[start: start + block] = source[start: start + block]
                total += source.dtype.itemsize * source.size
        os.replace(tmp, args.out)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
    print(f"exported step {manifest['step']} of {step_dir}: {len(manifest['tensors'])} tensors, "
          f"{human_bytes(total)} -> {args.out}")
    return 0


def export_problem(out: str) -> str | None:
    """Why ``out`` cannot take an export (before any tensor is read): a step folder's own files are
    never replaced (an export onto index.h5 made its checkpoint unloadable)."""
    folder = os.path.dirname(os.path.abspath(out))
    if os.path.isfile(os.path.join(folder, MANIFEST)):
        return f"{folder} is a checkpoint's step folder, and writing into it would damage it; write elsewhere"
    problem = output_problem(out)
    return None if problem is None else f"it {problem}"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``hpcpar ckpt``'s actions, each with its own arguments."""
    parser.description = __doc__.split("\n\n")[1]
    sub = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
    listing = sub.add_parser("ls", help="list the steps under a checkpoint root")
    listing.add_argument("root", help="the checkpoint root (checkpoint.dir of the job)")
    listing.add_argument("--quick", action="store_true", help="check presence and sizes only, not CRC-32")
    listing.set_defaults(func=_reporting(ls))
    inspecting = sub.add_parser("inspect", help="step, layout, extras and tensors of one checkpoint")
    inspecting.add_argument("path", help="checkpoint root (its latest step) or a step folder")
    inspecting.set_defaults(func=_reporting(inspect))
    verifying = sub.add_parser("verify", help="check every file against the manifest; exit 1 if damaged")
    verifying.add_argument("path", help="checkpoint root (its latest step) or a step folder")
    verifying.set_defaults(func=_reporting(verify))
    exporting = sub.add_parser("export", help="write one consolidated, non-virtual HDF5 file")
    exporting.add_argument("path", help="checkpoint root (its latest step) or a step folder")
    exporting.add_argument("out", help="the HDF5 file to write (replaced if it exists)")
    exporting.set_defaults(func=_reporting(export))


def _reporting(action):
    """``action(args)``, with a checkpoint or file error as one line on stderr and exit status 1. Serial:
    started by mpiexec, rank 0 alone does it (every rank exporting to OUT.tmp at once failed, each saying so)."""
    def run(args) -> int:
        if log.world_rank() != 0:
            return 0
        try:
            return action(args)
        except (CheckpointError, OSError) as error:
            print(f"hpcpar ckpt {args.action}: error: {error}", file=sys.stderr)
            return 1

    return run
