"""`hpcpar bench moe` runs at 2 ranks and prints its table; the ep counters' bytes are its own.

No timing is asserted (a shared machine): only that the table comes out with its rows and
columns, that ep = 1 moves no bytes on an ep communicator and ep = 2 does, and that the
forced router puts every token's rows on one rank of the group.
"""
import os
import re
import subprocess
import sys

from conftest import venv_bin

HEADERS = ["variant", "ep", "step ms", "vs ep=1", "a2a ms max", "a2a ms min", "a2a share", "ep MiB", "wire MiB",
           "expert rows max rank", "even share"]


def test_bench_moe_prints_its_table_at_two_ranks():
    tiny = ["--n-layer", "1", "--n-embd", "16", "--n-head", "2", "--experts", "4", "--block", "16", "--batch", "2",
            "--repeats", "1"]
    command = ["timeout", "25", venv_bin("mpiexec"), "-n", "2", sys.executable, "-m", "hpcpar", "bench", "moe", *tiny]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=28,
                          env={**os.environ, "OPENBLAS_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    assert "command: mpiexec -n 2 hpcpar bench moe --n-layer 1" in out and "one BLAS thread each" in out, out
    lines = out.splitlines()
    head = next(i for i, line in enumerate(lines) if line.split()[:2] == ["variant", "ep"])
    cells = [re.split(r"\s{2,}", line.strip()) for line in lines[head:head + 5]]  # columns: 2+ spaces apart
    assert cells[0] == HEADERS and set(cells[1][0]) == {"-"}, out
    rows = {row[0]: dict(zip(HEADERS, row)) for row in cells[2:]}
    assert list(rows) == ["ep = 1", "ep = 2", "ep = 2, router forced"], out
    assert float(rows["ep = 1"]["ep MiB"]) == 0 and float(rows["ep = 1"]["wire MiB"]) == 0, out
    assert float(rows["ep = 2"]["ep MiB"]) > 0 and float(rows["ep = 2"]["wire MiB"]) > 0, out
    # the forced router: 2 sequences x 16 tokens x top-2 on each of 2 ranks, all at rank 0's experts 0 and 1
    forced = rows["ep = 2, router forced"]
    assert (forced["expert rows max rank"], forced["even share"]) == ("128", "64"), out
    assert "imbalance at ep = 2 (every token on experts 0 and 1)" in out, out
