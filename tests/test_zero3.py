"""ZeRO-3 (`parallel.zero = 3`) through `hpcpar train`: float64 with dropout 0.1 in every layout
equals one process (a pipeline keeping its units gathered by default, or resharding them), a
checkpoint resumes bit for bit in its layout and loads into one process and into DDP at dp 4,
and a rank-dependent forward path fails within the stall watchdog's time instead of hanging.
(The store itself, its bytes, memory and debug check: test_zero_params.py.)"""
import os
import subprocess
import sys

import numpy as np
import pytest

from conftest import REPO, final_parameters, venv_bin
import test_zero2
from test_zero2 import LAYOUTS, largest_difference, resumed_from_step_3, run

one_process = test_zero2.one_process  # the same module fixture, built once for this module too
LAYOUTS_3 = {**LAYOUTS, "dp2-pp2-zb1-resharded": (4, [*LAYOUTS["dp2-pp2-zb1"][1], "parallel.reshard_after_forward=true"]),
             "dp2-pp2-interleaved-resharded": (4, ["parallel.dp=2", "parallel.pp=2", "parallel.micro_batches=2",
                                                   'parallel.schedule="interleaved"', "parallel.chunks=2",
                                                   "parallel.reshard_after_forward=true"]),
             "dp2-recompute-full": (2, ["parallel.dp=2", 'model.recompute="full"'])}  # a recomputed region inside a unit's


@pytest.mark.parametrize("layout", list(LAYOUTS_3))
def test_zero_3_equals_one_process_in_every_layout(tmp_path, token_file, one_process, layout):
    ranks, overrides = LAYOUTS_3[layout]
    proc = run(tmp_path, token_file, ranks, *overrides, "parallel.zero=3", "checkpoint.interval=5")
    assert "ZeRO-3:" in proc.stdout, proc.stdout
    assert largest_difference(final_parameters(str(tmp_path / "ckpt")), one_process) <= 1e-12


def test_zero_3_resumes_bitwise_and_loads_into_one_process_and_zero_0(tmp_path, token_file, one_process):
    """dp 2 x tp 2 under ZeRO-3, stopped after step 3: resumed in its layout it ends bit for bit as
    the uninterrupted run; resumed in one process, and as DDP at dp 4, it equals one process."""
    layout = ["parallel.dp=2", "parallel.tp=2", "parallel.zero=3"]
    run(tmp_path / "straight", token_file, 4, *layout, "checkpoint.interval=3")
    straight = final_parameters(str(tmp_path / "straight" / "ckpt"))
    same = resumed_from_step_3(tmp_path / "straight", tmp_path / "same", token_file, 4, *layout)
    for name in straight:
        np.testing.assert_array_equal(same[name], straight[name], err_msg=name)
    for folder, ranks, overrides in (("one", 1, ["parallel.dp=1"]), ("dp4", 4, ["parallel.dp=4", "parallel.zero=0"])):
        other = resumed_from_step_3(tmp_path / "straight", tmp_path / folder, token_file, ranks, *overrides)
        assert largest_difference(other, one_process) <= 1e-12, folder


PLANTED = """
import sys
sys.path.insert(0, sys.argv[1])
import hpcpar
from hpcpar.runtime import fail_fast
from dp_reference import global_batch, make_model
from test_zero_params import step, zero_3

ctx = hpcpar.init(device="cpu")
with fail_fast():
    model = make_model()
    params, sync, optimizer = zero_3(ctx, model)
    ids, targets = global_batch(0)
    x = model.embed(ids[:2])
    for block in [model.blocks[0]] * (2 if ctx.dp_rank == 1 else 1) + list(model.blocks[1:]):
        x = block(x)  # rank 1 runs block 0 twice
    model.loss_from_logits(model.head(x), targets[:2]).backward()
    step(sync, optimizer)
"""


def test_a_rank_dependent_forward_path_fails_within_the_watchdogs_time(tmp_path):
    script = tmp_path / "planted.py"
    script.write_text(PLANTED)
    proc = subprocess.run([venv_bin("mpiexec"), "-n", "2", sys.executable, str(script), os.path.join(REPO, "tests")],
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": REPO, "HPCPAR_STALL_S": "1", "HPCPAR_STALL_ABORT_S": "5",
                               "OPENBLAS_NUM_THREADS": "1"})
    assert proc.returncode != 0
    assert "which can never complete" in proc.stderr or "hpcpar: stall:" in proc.stderr, proc.stderr
