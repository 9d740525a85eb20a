"""Gradient compression: training still works, bytes fall as promised, error feedback matters."""
import numpy as np
import pytest

import hpcpar
from hpcpar.data.corpus import batch_windows, stdlib_corpus
from hpcpar.nn.gpt import GPT, GPTConfig
from hpcpar.optim import AdamW
from hpcpar.parallel import DistributedDataParallel, make_compressor

pytestmark = pytest.mark.mpi(min_size=2)
CONFIG = GPTConfig(vocab_size=256, block_size=32, n_layer=2, n_head=2, n_embd=32, seed=1)
STEPS, BATCH = 60, 8


def train(ctx, compressor, tokens):
    model = GPT(CONFIG, dtype=np.float32)
    ddp = DistributedDataParallel(model, ctx, bucket_mb=0.05, compression=compressor)
    optimizer = AdamW(model.named_parameters(), lr=1e-2)
    rng = np.random.default_rng([7, ctx.dp_rank])
    losses = []
    for _ in range(STEPS):
        ids, targets = batch_windows(tokens, rng.integers(0, len(tokens) - CONFIG.block_size - 1, BATCH),
                                     CONFIG.block_size)
        loss = model.loss(ids, targets)
        loss.backward()
        ddp.finish_grad_sync()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(ctx.dp.allreduce(np.array([loss.item()]), "mean")[0])
    return float(np.mean(losses[-10:])), ddp


@pytest.fixture(scope="module")
def runs():
    ctx = hpcpar.init(device="cpu")
    tokens = stdlib_corpus(200_000)
    results = {}
    for label, name, options in [("none", "none", {}), ("fp16", "fp16", {}),
                                 ("topk", "topk", dict(ratio=0.02)),
                                 ("topk-no-feedback", "topk", dict(ratio=0.02, error_feedback=False)),
                                 ("powersgd", "powersgd", dict(rank=2))]:
        compressor = make_compressor(name, **options)
        loss, _ = train(ctx, compressor, tokens)
        results[label] = (loss, compressor)
    return results


def test_fp16_tracks_the_uncompressed_loss_at_half_the_bytes(runs):
    baseline, (loss, compressor) = runs["none"][0], runs["fp16"]
    assert abs(loss - baseline) < 0.05, (loss, baseline)
    assert compressor.ratio == 0.5


def test_topk_with_error_feedback_stays_close_and_sends_few_bytes(runs):
    baseline, (loss, compressor) = runs["none"][0], runs["topk"]
    assert loss < runs["none"][0] + 0.35, (loss, baseline)
    assert compressor.ratio == pytest.approx(2 * 0.02, rel=0.2)  # a 4-byte index beside each value


def test_error_feedback_matters(runs):
    with_feedback, without = runs["topk"][0], runs["topk-no-feedback"][0]
    assert without > with_feedback + 0.1, (with_feedback, without)


def test_powersgd_trains_and_compresses(runs):
    baseline, (loss, compressor) = runs["none"][0], runs["powersgd"]
    assert loss < baseline + 0.5 and compressor.ratio < 0.5, (loss, baseline, compressor.ratio)
