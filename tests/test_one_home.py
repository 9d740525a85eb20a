"""One home each: the job's precision is decoded in one place (``Job.precision``), and the mode is
named only by the strategies and the job schema."""
import pathlib
import re

import numpy as np
import pytest

from hpcpar.optim import PRECISIONS, FullPrecision, MasterWeights, MixedPrecision, precision_named
from hpcpar.train.config_load import load_job
from hpcpar.train.strategies import STRATEGIES, strategy_class

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "hpcpar"
PRECISION_READ = re.compile(r"\.train\.precision\b")  # an attribute read, not the key's name in a message
MODE_COMPARED = re.compile(r"\.mode\s*==")


def lines_matching(pattern, allowed) -> list[str]:
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(PACKAGE).as_posix()
        if any(relative == a or relative.startswith(a.rstrip("/") + "/") for a in allowed):
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if pattern.search(line):
                found.append(f"hpcpar/{relative}:{number}: {line.strip()}")
    return found


def test_train_precision_is_read_in_one_place():
    found = lines_matching(PRECISION_READ, allowed=())
    assert len(found) == 1 and found[0].startswith("hpcpar/train/config.py:"), found  # Job.precision


def test_the_mode_is_compared_only_by_the_strategies_and_the_schema():
    assert lines_matching(MODE_COMPARED, allowed=("train/strategies/", "train/config.py")) == []


def test_the_grep_finds_what_it_looks_for():
    assert PRECISION_READ.search("dtype = job.train.precision") and not PRECISION_READ.search('("train.precision", x)')
    assert MODE_COMPARED.search('if p.mode == "ps":') and not MODE_COMPARED.search("mode = job.parallel.mode")


@pytest.mark.parametrize("name", list(PRECISIONS))
def test_the_job_decodes_its_precision(name):
    precision = load_job(None, [f'train.precision="{name}"']).precision
    assert precision is precision_named(name) and precision.name == name
    assert precision.mixed == (name in ("fp16", "bf16"))
    assert (precision.scaler() is not None) == (name == "fp16")  # bfloat16 has float32's range
    assert precision.master_itemsize == (4 if precision.mixed else precision.itemsize)
    if name != "bf16":
        assert precision.compute_dtype.itemsize == precision.itemsize


def test_both_master_weights_implement_the_protocol():
    from hpcpar.autograd import Parameter

    named = [("w", Parameter(np.ones(3, dtype=np.float16)))]
    for masters in (FullPrecision(named), MixedPrecision(named)):
        assert all(callable(getattr(masters, name)) for name in dir(MasterWeights)
                   if not name.startswith("_") and name != "scaler")
        assert hasattr(masters, "scaler")
    assert isinstance(precision_named("fp16").masters(named), MixedPrecision)
    assert isinstance(precision_named("fp32").masters(named), FullPrecision)


def test_a_shards_master_is_the_same_shard():
    from hpcpar.autograd import Parameter

    shard = Parameter(np.ones((2, 3), dtype=np.float16))
    shard.global_shape, shard.global_start = (4, 3), (2, 0)
    (_, master), = MixedPrecision([("w", shard)]).named_master_parameters()
    assert (master.global_shape, master.global_start) == ((4, 3), (2, 0))


def test_each_mode_answers_for_itself():
    ps = load_job(None, ["parallel.mode=ps", "parallel.servers=2"])
    assert strategy_class(ps).own_context and strategy_class(ps).grid_ranks(ps, 5) == 3
    assert "leave no worker" in strategy_class(ps).check_job(ps, 2)[0][1]
    plain = load_job(None, [])
    assert not strategy_class(plain).own_context and strategy_class(plain).grid_ranks(plain, 5) == 5
    assert all(cls.check_job(plain, 4) == [] for cls in (STRATEGIES["allreduce"], STRATEGIES["pipeline"]))
