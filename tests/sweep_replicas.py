"""The MPI side of `tests/sweep.py replicas` (run under mpiexec): a job trained a few steps through
the Python API, then every copy of every parameter compared, across the dp replicas and, for the
parameters every tp rank holds whole (LayerNorms, row-parallel biases, the position embedding),
across the tp ranks. Rank 0 prints one JSON line: {"differ": [[group, name], ...]}; a job the
validation refuses exits 2 with one `error:` line, as `hpcpar train` does.

    mpiexec -n 4 python tests/sweep_replicas.py JOB.toml '{"parallel.dp": 2, ...}' [STEPS]
"""
import json
import sys

import numpy as np
from mpi4py import MPI

import hpcpar
from hpcpar.backend import to_host
from hpcpar.train.build import build
from hpcpar.train.config import JobError
from hpcpar.train.config_load import load_job
from hpcpar.train.loop import train_one_step
from hpcpar.train.validate import validate


def differing_copies(strategy, ctx) -> list[tuple[str, str]]:
    """(group, name) of each parameter whose copies differ within a dp or tp group (collective)."""
    found = []
    for name, param in strategy.named_parameters():
        mine = np.ascontiguousarray(to_host(param.data))
        whole = getattr(param, "global_shape", None) is None  # a tp shard has its global shape
        for group, comm in [("dp", ctx.dp.mpi)] + ([("tp", ctx.tp.mpi)] if whole else []):
            copies = comm.allgather(mine)
            if not all(c.shape == mine.shape and np.array_equal(c, mine) for c in copies):
                found.append((group, name))
    return found


def main(path: str, keys: dict, steps: int) -> int:
    world = MPI.COMM_WORLD
    overrides = [f"{key}={value}" for key, value in keys.items()] + ['train.device="cpu"']
    try:
        job = validate(load_job(path, overrides), world.Get_size())
    except JobError as err:
        if world.Get_rank() == 0:
            print(f"sweep_replicas: error: {err}", file=sys.stderr)
        return 2
    ctx = hpcpar.init(dp=job.parallel.dp, pp=job.parallel.pp, tp=job.parallel.tp, device="cpu")
    run = build(job, ctx)
    for step in range(steps):
        train_one_step(run, step)
    everyone = world.gather(differing_copies(run.strategy, ctx), root=0)
    if world.Get_rank() == 0:
        print(json.dumps({"differ": sorted({tuple(item) for mine in everyone for item in mine})}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3]) if len(sys.argv) > 3 else 4))
