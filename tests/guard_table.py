"""The guarded copies per training step of each layout of tests/test_guard_training.py, as a table.

    mpiexec -n 4 python tests/guard_table.py      # layouts that run at 4 ranks (1 and 2 likewise)

One row per layout and rank role: host-to-device and device-to-host copies of an ordinary
step and of a log step, split by kind (batch, norm, staging, loss), with MPI staged (not
CUDA-aware) as on a plain MPI build; the suite asserts these same counts.
"""
import collections
import os
import sys
import tempfile

from mpi4py import MPI

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
os.environ["HPCPAR_CUDA_AWARE"] = "0"

import test_guard_training as suite  # noqa: E402
from hpcpar.data.prepare import prepare  # noqa: E402


def describe(kinds: collections.Counter) -> str:
    arrows = {"to_device": "h2d", "to_host": "d2h"}
    return ", ".join(f"{kind} {n} {arrows[direction]}" for (kind, direction), n in sorted(kinds.items()))


def main() -> None:
    world = MPI.COMM_WORLD
    path = os.path.join(tempfile.mkdtemp(), "stdlib.h5") if world.rank == 0 else None
    if path:
        prepare(path, max_mb=1)
    path = world.bcast(path)
    rows = []
    for name in suite.params(world.size):
        run = suite.guarded_steps(suite.make_job(name, world.size, path))
        if run is None:
            rows.append(None)
            continue
        role = f"pp {run.ctx.pp_rank}" if run.job.parallel.pp > 1 else "every rank"
        (plain, _), (logged, _) = run.steps[2], run.steps[3]  # steps 3 and 4: steady state, 4 logs
        rows.append((name, role, sum(plain.values()), describe(plain), sum(logged.values()) - sum(plain.values())))
    gathered = world.gather(rows)
    if world.rank == 0:
        print(f"| layout ({world.size} ranks) | rank | copies per step | of which | extra at a log step |")
        print("|---|---|---|---|---|")
        for row in dict.fromkeys(r for ranks in zip(*gathered) for r in ranks if r is not None):
            print("| " + " | ".join(map(str, row)) + " |")


if __name__ == "__main__":
    main()
