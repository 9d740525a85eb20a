"""Context parallelism (`parallel.cp`) through `hpcpar train`: float64 with dropout 0.1, five steps
in every layout with cp equal one process; a cp 2 checkpoint resumes bit for bit at cp 2 and
continues exactly at cp 1 and cp 4; a cp-trained checkpoint generates; the trace shows the ring's
transfers; impossible settings are one line each. (The ring itself, against plain attention, and
its bytes: test_ring_attention.py; the chunks' arithmetic: below.)"""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from conftest import REPO, final_parameters, venv_bin
from hpcpar.autograd.ops.ring_attention import pairs_per_rank
from hpcpar.autograd.ops.sequence_chunks import ChunkLayout, SequencePlace
from hpcpar.train.config import JobError
from hpcpar.train.config_load import load_job
from hpcpar.train.validate import validate
import test_zero2
from test_zero2 import largest_difference, resumed_from_step_3, run

one_process = test_zero2.one_process  # the same module fixture, built once for this module too

LAYOUTS = {  # ranks, overrides; cp 2 alone: the resume test below
    "cp4": (4, ["parallel.cp=4"]),
    "cp2-dp2": (4, ["parallel.cp=2", "parallel.dp=2", "parallel.bucket_mb=0.01"]),  # DDP over dp x cp, many buckets
    "cp2-dp2-zero1": (4, ["parallel.cp=2", "parallel.dp=2", "parallel.zero=1"]),
    "cp2-dp2-zero2": (4, ["parallel.cp=2", "parallel.dp=2", "parallel.zero=2"]),
    "cp2-dp2-zero3": (4, ["parallel.cp=2", "parallel.dp=2", "parallel.zero=3"]),
    "cp2-tp2-sp": (4, ["parallel.cp=2", "parallel.tp=2", "parallel.sequence_parallel=true"]),
    "cp2-pp2-1f1b-selective": (4, ["parallel.cp=2", "parallel.pp=2", "parallel.micro_batches=2",
                                   'model.recompute="selective"']),
    "cp2-pp2-interleaved-full": (4, ["parallel.cp=2", "parallel.pp=2", "parallel.micro_batches=2",
                                     'parallel.schedule="interleaved"', "parallel.chunks=2", 'model.recompute="full"']),
    "pp2-tp2-cp2-sp": (8, ["parallel.cp=2", "parallel.pp=2", "parallel.tp=2", "parallel.sequence_parallel=true",
                           "parallel.micro_batches=2"]),
}


def test_zigzag_chunks_give_every_rank_the_same_causal_work():
    for size in (1, 2, 4, 8):
        zigzag = [ChunkLayout(rank, size) for rank in range(size)]
        held = sorted(chunk for layout in zigzag for chunk in layout.chunks())
        assert held == list(range(2 * size))  # each chunk on one rank
        assert set(pairs_per_rank(size)) == {2 * size + 1}
        if size > 1:
            assert pairs_per_rank(size, zigzag=False) == [4 * rank + 3 for rank in range(size)]  # the last works most
    assert ChunkLayout(1, 2).ranges(16) == (range(4, 12),) == ChunkLayout(0, 2).ranges(16, rank=1)  # chunks 1, 2
    assert ChunkLayout(0, 2).ranges(16) == (range(0, 4), range(12, 16))
    ids = np.arange(16)[None, :]
    assert ChunkLayout(0, 2).take(ids).tolist() == [[0, 1, 2, 3, 12, 13, 14, 15]]
    # sequence parallelism then splits a rank's positions over tp, across the chunk boundary
    assert SequencePlace(ChunkLayout(0, 2), shards=2, shard=0).ranges(4) == (range(0, 4),)
    assert SequencePlace(ChunkLayout(0, 2), shards=4, shard=1).ranges(2) == (range(2, 4),)
    assert SequencePlace(ChunkLayout(0, 2), shards=4, shard=2).ranges(2) == (range(12, 14),)
    assert SequencePlace(ChunkLayout(0, 2), shards=2).total(4) == 16
    with pytest.raises(ValueError, match="2 x cp = 4 chunks: 10 tokens do not divide"):
        ChunkLayout(0, 2).ranges(10)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_context_parallel_equals_one_process_in_every_layout(tmp_path, token_file, one_process, layout):
    ranks, overrides = LAYOUTS[layout]
    proc = run(tmp_path, token_file, ranks, *overrides, "checkpoint.interval=5")
    cp = next(o for o in overrides if o.startswith("parallel.cp="))[-1]
    assert f"x cp {cp}" in proc.stdout, proc.stdout  # the layout line names cp, and the strategy line what it does
    assert f"context parallel: each sequence over {cp} ranks (zigzag chunks, ring attention)" in proc.stdout
    assert largest_difference(final_parameters(str(tmp_path / "ckpt")), one_process) <= 1e-12


def test_a_cp_2_checkpoint_resumes_bitwise_and_continues_exactly_at_cp_1_and_cp_4(tmp_path, token_file, one_process):
    """cp 2 equals one process; stopped after step 3 and resumed at cp 2 it ends bit for bit as the
    uninterrupted run; at cp 1 (one process) and cp 4 it ends as one process does. The checkpoint
    holds nothing of cp."""
    layout = ["parallel.cp=2", f'train.trace="{tmp_path}/trace.json"']
    run(tmp_path / "straight", token_file, 2, *layout, "checkpoint.interval=3")
    straight = final_parameters(str(tmp_path / "straight" / "ckpt"))
    assert largest_difference(straight, one_process) <= 1e-12  # cp 2 equals one process
    same = resumed_from_step_3(tmp_path / "straight", tmp_path / "same", token_file, 2, "parallel.cp=2")
    for name in straight:
        np.testing.assert_array_equal(same[name], straight[name], err_msg=name)
    for folder, ranks, overrides in (("cp1", 1, ["parallel.cp=1"]), ("cp4", 4, ["parallel.cp=4"])):
        other = resumed_from_step_3(tmp_path / "straight", tmp_path / folder, token_file, ranks, *overrides)
        assert largest_difference(other, one_process) <= 1e-12, folder
    events = json.load(open(tmp_path / "trace.json"))["traceEvents"]
    ring = [e for e in events if e.get("cat") == "comm" and e.get("args", {}).get("comm") == "cp"]
    assert {e["name"] for e in ring} >= {"isend", "irecv", "irecv wait"}, sorted({e["name"] for e in ring})
    generate = subprocess.run([sys.executable, "-m", "hpcpar", "generate", str(tmp_path / "straight" / "ckpt"),
                               "--tokens", "12", "--prompt", "def "], capture_output=True, text=True, timeout=120)
    assert generate.returncode == 0 and generate.stdout.startswith("def "), generate.stdout + generate.stderr


JOB, CNN = (os.path.join(REPO, "jobs", name) for name in ("gpt-dp.toml", "cnn-digits-dp.toml"))


@pytest.mark.parametrize("job, overrides, world, line", [
    (JOB, ["parallel.cp=2", "model.block_size=30"], 2,
     "parallel.cp: block_size = 30 is not divisible by 2 x cp = 4: each sequence is cut into 2 x cp zigzag chunks"),
    (CNN, ["parallel.cp=2"], 2,
     'parallel.cp: context parallelism splits the GPT\'s sequences; model.kind = "cnn" needs cp = 1, got 2'),
    (JOB, ["parallel.cp=2", 'parallel.compression="topk"'], 2,
     'parallel.compression: compression = "topk" is not supported with context parallelism (cp = 2)'),
    (JOB, ["parallel.cp=2", 'parallel.mode="local_sgd"'], 2, "set pp = tp = cp = 1 or mode = \"allreduce\""),
    (JOB, ["parallel.cp=2", "parallel.dp=2", "parallel.zero=1", "parallel.shard_size=3"], 4,
     "parallel.shard_size: 3 does not divide dp x cp = 2 x 2 = 4"),
    (JOB, ["parallel.cp=2", "parallel.tp=4", "parallel.sequence_parallel=true", "model.block_size=36"], 8,
     "do not split over the tp = 4 ranks of each of cp = 2; use a block_size that is a multiple of 8"),
    (JOB, ["parallel.cp=3"], 4, "world size 4 is not divisible by pp x tp x cp = 1 x 1 x 3 = 3"),
])
def test_impossible_settings_are_one_line_each(job, overrides, world, line):
    with pytest.raises(JobError) as raised:
        validate(load_job(job, overrides), world)
    assert line in str(raised.value), str(raised.value)


def test_hpcpar_info_shows_the_cp_row_of_the_grid_and_its_communicators():
    proc = subprocess.run([venv_bin("mpiexec"), "-n", "2", sys.executable, "-m", "hpcpar", "info", "--cp", "2"],
                          capture_output=True, text=True, timeout=120, env={**os.environ, "OPENBLAS_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr
    assert "layout dp=1 pp=1 tp=1 cp=2" in proc.stdout and "cp (chunk)    0  1" in proc.stdout, proc.stdout
    assert "comm cp" in proc.stdout and "comm dp*cp" in proc.stdout
