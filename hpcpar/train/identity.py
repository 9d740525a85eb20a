"""Who a run is (its fingerprint) and where it came from (its provenance).

The fingerprint decides whether a checkpoint belongs to this run: the model config, the data
file's identity (``hpcpar.data.identity``), the optimizer kind and the precision. A checkpoint
of another model, data file, optimizer or precision does not continue this run: resuming it is
refused with every difference named (``differences``). Optimizer hyper-parameters, the run's
length and the layout may change between segments: each change is one line (``changes``).

Provenance is what reproduces a segment: the resolved job, the command line with world size
and launcher, the versions of everything numerical and the hosts. Both go into every
checkpoint's manifest (as plain extras) and into the run folder (``checkpoint.dir``):
``job.toml``, ``command.txt``, ``env.json`` and ``run.json`` (run id and fingerprint).
"""
from __future__ import annotations

import hashlib
import json
import os
import platform
import shlex
import subprocess
import sys
import time

from ..checkpoint.manifest import layout_words


def version() -> str:
    """hpcpar's version. The package is loaded whenever this module is (it is its parent); reading it
    from ``sys.modules`` keeps the layers' rule that nothing here imports the facade above ``train``."""
    return sys.modules["hpcpar"].__version__


IDENTITY = ("model", "data", "optimizer", "precision")  # what may not change within a run
WEIGHTS_ONLY = ("model",)  # what --load-weights-only compares
# May change between segments, said in a line each (lr, warm-up, min_lr and train.steps: by the
# LR schedule's line, lifecycle.adopt_job_schedule; weight decay: refused by the strategy).
ADJUSTABLE = ("optimizer.betas", "optimizer.momentum", "optimizer.grad_clip", "model.recompute")
# Model keys that change how a step runs but not a number it computes (activation recomputation gives
# the same gradients): like the layout, they are no part of the identity and may change on resume.
NOT_IDENTITY = ("recompute", "load_warning")


def fingerprint(job, data_identity: dict | None) -> dict:
    """The run's identity: model config, data file, optimizer kind, precision (and the hpcpar version)."""
    model = {k: v for k, v in job.to_dict()["model"].items() if job.applies(f"model.{k}") and k not in NOT_IDENTITY}
    if job.moe_config() is not None:  # a dense model's identity is what it was before [model.moe] existed
        model["moe"] = {k: v for k, v in job.to_dict()["moe"].items() if k not in NOT_IDENTITY}
    return {"model": model, "data": data_identity or {"kind": job.data.kind},
            "optimizer": job.optimizer.name, "precision": job.precision.name, "hpcpar": version()}


def digest(print_: dict) -> str:
    """A short name of a fingerprint's identity (the version left out), for log lines."""
    text = json.dumps({k: print_.get(k) for k in IDENTITY}, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def job_digest(job) -> str:
    """A hash of every setting of ``job``: ranks that hold the same job have the same one."""
    return hashlib.sha256(json.dumps(job.to_dict(), sort_keys=True, default=str).encode()).hexdigest()


def ranks_with_another_job(job, comm) -> list[int]:
    """The ranks of ``comm`` (an mpi4py communicator) whose job differs from rank 0's (collective:
    one small all-gather). Ranks read the job file each: one that read it while it was being
    rewritten, or on a node whose copy differs, would build another grid or model, and call other
    collectives than the rest, which would then fail or wait forever."""
    digests = comm.allgather(job_digest(job))
    return [rank for rank, theirs in enumerate(digests) if theirs != digests[0]]


def describe(print_: dict) -> str:
    data = print_.get("data") or {}
    shown = (f"{data.get('path')} ({data.get('tokens', 0):,} tokens)" if "path" in data else data.get("kind", "?"))
    model = print_.get("model") or {}
    shape = (f"{model.get('n_layer')} layers x {model.get('n_embd')}" if model.get("kind") == "gpt"
             else f"channels {model.get('channels')}")
    return (f"fingerprint {digest(print_)} (model {model.get('kind', '?')} {shape}, data {shown}, "
            f"{print_.get('optimizer')}, {print_.get('precision')})")


def differences(saved: dict, current: dict, parts=IDENTITY) -> list[str]:
    """Each way the checkpoint's identity differs from this job's, one line each (empty: the same run)."""
    found = []
    for part in parts:
        old, new = saved.get(part), current.get(part)
        if part == "data" and isinstance(old, dict) and isinstance(new, dict):
            old, new = ({k: v for k, v in d.items() if k != "path"} for d in (old, new))  # a moved copy is the same
        if old is None or old == new:
            continue
        if isinstance(old, dict) and isinstance(new, dict):
            keys = sorted(set(old) | set(new), key=str)
            found += [f"{part}.{k}: {_shown(old.get(k))} in the checkpoint, {_shown(new.get(k))} now"
                      for k in keys if old.get(k) != new.get(k)]
        else:
            found.append(f"{part}: {_shown(old)} in the checkpoint, {_shown(new)} now")
    return found


def changes(saved_job: dict | None, job, saved_layout: dict | None, layout: dict, saved_print: dict,
            current_print: dict) -> list[str]:
    """What may change between segments and did: one line each (the job's values are used)."""
    lines = []
    now = job.to_dict()
    for dotted in ADJUSTABLE if saved_job else ():
        section, key = dotted.split(".")
        old, new = saved_job.get(section, {}).get(key), now[section][key]
        if key in saved_job.get(section, {}) and old != new and job.applies(dotted):
            lines.append(f"{dotted}: {_shown(old)} in the checkpoint, {_shown(new)} now (allowed: the job's value is used)")
    if saved_layout and any(saved_layout.get(k, 1) != layout.get(k, 1) for k in {*saved_layout, *layout}):
        lines.append(f"layout: {layout_words(saved_layout)} in the checkpoint, {layout_words(layout)} now "
                     f"(allowed: resharded)")
    old_path, new_path = (saved_print.get("data") or {}).get("path"), (current_print.get("data") or {}).get("path")
    if old_path and new_path and old_path != new_path:
        lines.append(f"data.path: {old_path} in the checkpoint, {new_path} now (the same data: size, tokens and "
                     f"content agree)")
    if saved_print.get("hpcpar") not in (None, current_print.get("hpcpar")):
        lines.append(f"hpcpar {saved_print['hpcpar']} wrote the checkpoint, {current_print['hpcpar']} runs now")
    return lines


def _shown(value) -> str:
    return json.dumps(value) if not isinstance(value, str) else value


# ----- provenance ------------------------------------------------------------------------------------
def new_run_id() -> str:
    return time.strftime("%Y%m%d-%H%M%S") + "-" + os.urandom(3).hex()


def launcher() -> str:
    """How the ranks were started, from the environment the launcher leaves."""
    env = os.environ
    if "SLURM_STEP_ID" in env and "SLURM_PROCID" in env:
        return f"srun (SLURM job {env.get('SLURM_JOB_ID')})"
    if "PMI_RANK" in env or "HYDRA_CONTROL_FD" in env or "PMI_FD" in env:
        return "mpiexec (hydra)" + (f" in SLURM job {env['SLURM_JOB_ID']}" if "SLURM_JOB_ID" in env else "")
    if "OMPI_COMM_WORLD_SIZE" in env:
        return "mpiexec (Open MPI)"
    return "single process"


def command_line() -> list[str]:
    """This process's command line as typed (``hpcpar ...`` rather than the path of ``__main__.py``)."""
    first = os.path.basename(sys.argv[0]) if sys.argv else ""
    return ["hpcpar", *sys.argv[1:]] if first in ("hpcpar", "__main__.py") else list(sys.argv)


def git_sha() -> str | None:
    """The commit of the hpcpar checkout that runs (None outside a git checkout)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(sys.modules["hpcpar"].__file__)))
    if not os.path.exists(os.path.join(root, ".git")):
        return None
    try:
        done = subprocess.run(["git", "-C", root, "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() or None if done.returncode == 0 else None


def environment(hosts: list[str]) -> dict:
    """Versions of hpcpar and everything numerical under it, and the hosts of the ranks."""
    import h5py
    import mpi4py
    import numpy
    from mpi4py import MPI

    return {"hpcpar": version(), "git_sha": git_sha(), "python": platform.python_version(),
            "numpy": numpy.__version__, "mpi4py": mpi4py.__version__,
            "mpi_library": MPI.Get_library_version().strip().splitlines()[0],
            "h5py": h5py.version.version, "hdf5": h5py.version.hdf5_version, "hosts": hosts}


def provenance(job, run_id: str, world_size: int, hosts: list[str], started_from: str | None = None) -> dict:
    """What reproduces this segment of the run (rank 0 builds it once)."""
    return {"run_id": run_id, "job": job.to_dict(), "job_source": job.source,
            "command": {"argv": shlex.join(command_line()), "world_size": world_size, "launcher": launcher(),
                        "cwd": os.getcwd()},
            "env": environment(hosts), "started": time.time(), "started_from": started_from}


def write_run_folder(folder: str, job, record: dict, print_: dict) -> None:
    """``job.toml``, ``command.txt``, ``env.json`` and ``run.json`` in the run folder (rank 0)."""
    os.makedirs(folder, exist_ok=True)
    command = record["command"]
    files = {"job.toml": job.describe(),
             "command.txt": f"{command['argv']}\n# world size {command['world_size']}, launcher {command['launcher']}, "
                            f"in {command['cwd']}\n",
             "env.json": json.dumps(record["env"], indent=1, sort_keys=True) + "\n",
             "run.json": json.dumps({"run_id": record["run_id"], "fingerprint": print_,
                                     "started_from": record["started_from"]}, indent=1, sort_keys=True) + "\n"}
    for name, text in files.items():
        tmp = os.path.join(folder, name + ".tmp")
        with open(tmp, "w") as f:
            f.write(text)
        os.replace(tmp, os.path.join(folder, name))
