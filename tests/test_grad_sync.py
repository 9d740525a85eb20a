"""The gradient sync of a synchronous step: one rule picks it, both engines are handed it."""
import numpy as np
import pytest

import hpcpar
from hpcpar.nn.gpt import GPT, GPTConfig
from hpcpar.parallel.compression import TopKCompression
from hpcpar.parallel.grad_sync import BucketedAllReduce, LocalGradients, OptimizerReduces, make_gradient_sync
from hpcpar.parallel.pipeline import PipelineParallel, Stages

CONFIG = GPTConfig(vocab_size=16, block_size=8, n_layer=2, n_head=2, n_embd=8, seed=5)


def batch():
    ids = np.random.default_rng(0).integers(0, CONFIG.vocab_size, (4, CONFIG.block_size + 1))
    return ids[:, :-1], ids[:, 1:]


@pytest.fixture
def ctx():
    from mpi4py import MPI
    if MPI.COMM_WORLD.Get_size() != 1:
        pytest.skip("one process")
    return hpcpar.init(device="cpu")


def test_the_rule_picks_one_sync_per_case(ctx):
    model = GPT(CONFIG, dtype=np.float64)
    options = dict(bucket_mb=25, overlap=True)
    assert isinstance(make_gradient_sync(model, ctx, sharded=True, **options), OptimizerReduces)
    assert isinstance(make_gradient_sync(model, ctx, sharded=False, **options), LocalGradients)
    compressed = make_gradient_sync(model, ctx, sharded=False, compression=TopKCompression(ratio=0.5), **options)
    assert isinstance(compressed, BucketedAllReduce) and compressed.ddp is not None


def test_the_pipeline_engine_keeps_no_step_on_itself(ctx):
    """The engine runs on the sync and backward it is handed; a step leaves only its StepState
    (what ``stats`` and ``trace`` read) behind, and the next step makes a new one."""
    model = GPT(CONFIG, dtype=np.float64)
    stages = Stages(model, ctx, chunks=1)
    sync = make_gradient_sync(stages, ctx, sharded=False, bucket_mb=25, overlap=False)
    calls = []

    def backward(loss):
        calls.append(loss)
        loss.backward()
    pipe = PipelineParallel(stages, ctx, micro_batches=2, loss_fn=model.loss_from_logits, grad_sync=sync,
                            backward_loss=backward)
    assert pipe.ddp is None and pipe.grad_sync is sync
    before = set(vars(pipe))
    pipe.train_step(*batch())
    first = pipe._last_step
    assert set(vars(pipe)) == before and len(calls) == 2 and pipe.stats["step_s"] > 0
    pipe.train_step(*batch())
    assert pipe._last_step is not first
