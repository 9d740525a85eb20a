"""Gradient compression: training still works, bytes fall as promised, error feedback matters.

Plain SGD (no momentum, lr 1, gradients clipped to norm 1) makes the effect of error feedback visible: without it, top-k never
applies the many small but consistent gradient entries. (Adam's per-coordinate scaling and
momentum both blur it; DGC-style momentum correction is another issue.) The loss compared is
the mean over a fixed held-out set of windows after training.
"""
import numpy as np
import pytest

import hpcpar
from hpcpar.data.corpus import batch_windows, stdlib_corpus
from hpcpar.nn.gpt import GPT, GPTConfig
from hpcpar.autograd import no_grad
from hpcpar.optim import SGD, clip_grad_norm
from hpcpar.parallel import DistributedDataParallel, make_compressor
from hpcpar.parallel.compression import FP16Compression, _Finish

pytestmark = pytest.mark.mpi(min_size=2)
CONFIG = GPTConfig(vocab_size=256, block_size=32, n_layer=2, n_head=2, n_embd=32, seed=1)
STEPS, BATCH, RATIO = 200, 8, 0.01
# Seed-to-seed spread of the uncompressed run: its held-out loss after STEPS steps, trained with
# data seeds 7..16 and model seeds 1..10 (ten runs at 2 ranks: `mpiexec -n 2 python tests/test_compression.py`),
# was 2.780 on average with a standard deviation of SEED_STD = 0.084 nats (range 2.663..2.932).
# A compressed run may end at most TOLERANCE = 3 x SEED_STD above the uncompressed run of the same
# seeds: a gap larger than seed noise is the compression's. (Measured: fp16 +0.037, top-k -0.12,
# PowerSGD -0.12; top-k without error feedback +0.15, 0.27 above top-k with it.)
SEED_STD = 0.084
TOLERANCE = 3 * SEED_STD
INDEX_AND_VALUE = 8  # top-k sends a 4-byte index beside each 4-byte value


def train(ctx, compressor, tokens, data_seed=7, model_seed=1, steps=STEPS):
    """(held-out loss, bytes this rank sent on the wire for gradients: the communicator's own count)."""
    model = GPT(GPTConfig(**{**CONFIG.to_dict(), "seed": model_seed}), dtype=np.float32)
    ddp = DistributedDataParallel(model, ctx, bucket_mb=0.05, compression=compressor)
    optimizer = SGD(model.named_parameters(), lr=1.0)
    rng = np.random.default_rng([data_seed, ctx.dp_rank])
    wire_before = ctx.dp.stats.total_wire_bytes
    for _ in range(steps):
        ids, targets = batch_windows(tokens, rng.integers(0, len(tokens) - CONFIG.block_size - 1, BATCH),
                                     CONFIG.block_size)
        loss = model.loss(ids, targets)
        loss.backward()
        ddp.finish_grad_sync()
        clip_grad_norm(model.parameters(), 1.0)  # plain SGD at lr 1 diverges now and then without it
        optimizer.step()
        optimizer.zero_grad()
    wire = ctx.dp.stats.total_wire_bytes - wire_before
    held_out = np.random.default_rng(99).integers(0, len(tokens) - CONFIG.block_size - 1, 64)
    with no_grad():
        return model.loss(*batch_windows(tokens, held_out, CONFIG.block_size)).item(), wire, ddp


class HalfBucketFP16(FP16Compression):
    """A planted regression: float16 for the first half of each bucket, the second half dropped
    (no gradient for it), while counting itself as the whole bucket in float16."""

    def start(self, comm, bucket):
        flat = bucket.flat
        half = flat[: flat.size // 2].astype(np.float16)
        self._count(flat.astype(np.float16).nbytes, flat)

        def finish(summed):
            flat[: flat.size // 2] = summed
            flat[flat.size // 2:] = 0
            return flat

        return _Finish(comm.iallreduce(half, "sum", out=half), finish)


@pytest.fixture(scope="module")
def runs():
    ctx = hpcpar.init(device="cpu")
    if ctx.world_size != 2:  # the 4-rank suite would train six more runs against a tolerance not measured there
        pytest.skip("the loss tolerance (SEED_STD) was measured at 2 ranks")
    tokens = stdlib_corpus(200_000)
    results = {}  # label -> (held-out loss, wire bytes, ddp)
    for label, compressor in [("none", make_compressor("none")), ("fp16", make_compressor("fp16")),
                              ("topk", make_compressor("topk", ratio=RATIO)),
                              ("topk-no-feedback", make_compressor("topk", ratio=RATIO, error_feedback=False)),
                              ("powersgd", make_compressor("powersgd", rank=2)),
                              ("half-bucket", HalfBucketFP16())]:
        results[label] = train(ctx, compressor, tokens)
    return results


def check_loss(loss: float, baseline: float, label: str) -> None:
    """Within the seed-to-seed tolerance of the uncompressed loss (or better)."""
    assert loss < baseline + TOLERANCE, f"{label}: held-out loss {loss:.4f} vs {baseline:.4f} uncompressed " \
                                        f"(tolerance {TOLERANCE:.3f})"


def check_wire(wire: int, expected: float, label: str) -> None:
    """The bytes the communicator counted on the wire are what the compression promises (1 %)."""
    assert wire == pytest.approx(expected, rel=0.01), f"{label}: {wire} bytes on the wire, expected {expected:.0f}"


def expected_topk_wire(ddp, ranks: int) -> float:
    """Per step and bucket, an all-gather of k (index, value) pairs: (ranks - 1) x its piece on the wire."""
    per_step = sum(max(1, int(RATIO * bucket.flat.size)) for bucket in ddp.buckets) * INDEX_AND_VALUE
    return STEPS * (ranks - 1) * per_step


def test_fp16_tracks_the_uncompressed_loss_at_half_the_bytes_on_the_wire(runs):
    baseline, plain_wire, _ = runs["none"]
    loss, wire, _ = runs["fp16"]
    check_loss(loss, baseline, "fp16")
    check_wire(wire, 0.5 * plain_wire, "fp16")


def test_topk_with_error_feedback_stays_close_and_sends_few_bytes(runs):
    baseline = runs["none"][0]
    loss, wire, ddp = runs["topk"]
    check_loss(loss, baseline, "topk")
    check_wire(wire, expected_topk_wire(ddp, ddp.ctx.dp_size), "topk")
    assert wire < 0.1 * runs["none"][1]


def test_error_feedback_matters(runs):
    with_feedback, without = runs["topk"][0], runs["topk-no-feedback"][0]
    assert without > with_feedback + 2 * SEED_STD, (with_feedback, without)  # more than seed noise


def test_powersgd_trains_and_compresses(runs):
    baseline, plain_wire, _ = runs["none"]
    loss, wire, _ = runs["powersgd"]
    check_loss(loss, baseline, "powersgd")
    assert wire < 0.5 * plain_wire, (wire, plain_wire)


def test_the_checks_fail_for_a_compressor_that_drops_half_the_bucket(runs):
    """The planted regression passes its own byte counter (it reports float16's 0.5) but not the
    communicator's count, nor the loss tolerance."""
    baseline, plain_wire, _ = runs["none"]
    loss, wire, ddp = runs["half-bucket"]
    assert ddp.compression.ratio == 0.5  # what checking the compressor against itself saw
    with pytest.raises(AssertionError, match="on the wire"):
        check_wire(wire, 0.5 * plain_wire, "half-bucket")
    with pytest.raises(AssertionError, match="held-out loss"):
        check_loss(loss, baseline, "half-bucket")


def measure_spread(seeds: int = 10) -> None:
    """The uncompressed run's held-out loss for ``seeds`` (data, model) seed pairs: mean, standard deviation, range."""
    ctx = hpcpar.init(device="cpu")
    tokens = stdlib_corpus(200_000)
    losses = np.array([train(ctx, make_compressor("none"), tokens, 7 + k, 1 + k)[0] for k in range(seeds)])
    if ctx.rank == 0:
        print(" ".join(f"{loss:.4f}" for loss in losses), f"\nmean {losses.mean():.4f}, standard deviation "
              f"{losses.std(ddof=1):.4f}, range {losses.min():.4f}..{losses.max():.4f}")


if __name__ == "__main__":
    measure_spread()


@pytest.mark.mpi(min_size=4)
@pytest.mark.parametrize("sequence_parallel", ["false", "true"])
def test_topk_keeps_the_parameters_every_tp_rank_holds_equal(sequence_parallel):
    """dp 2 x tp 2 with top-k: a bucket mixed the parameters every tp rank holds whole (LayerNorms,
    row-parallel biases) with the shards, which differ from rank to rank, so each tp rank sent other
    entries of them and its copies drifted apart (1e-5 after 4 steps without sequence parallelism;
    a resume, which loads one copy, was then not the run it continued). Now they bucket apart."""
    from conftest import world_token_file

    from hpcpar.train.build import build
    from hpcpar.train.config_load import load_job
    from hpcpar.train.loop import step_masks
    from hpcpar.train.validate import validate

    overrides = ["model.n_layer=2", "model.n_embd=32", "model.n_head=4", "model.block_size=16", "data.batch_size=8",
                 f'data.path="{world_token_file("topk-tp-")}"', "parallel.dp=2", "parallel.tp=2",
                 'parallel.compression="topk"', f"parallel.sequence_parallel={sequence_parallel}", 'train.device="cpu"']
    job = validate(load_job(None, overrides), 4)
    ctx = hpcpar.init(dp=2, tp=2, device="cpu")
    run = build(job, ctx)
    for step in range(4):
        with step_masks(run, step):
            loss = run.strategy.train_step(*run.train_data.batch_at(step))
            run.strategy.finish_step(0.0, loss)
    whole = [(name, p.data) for name, p in run.strategy.named_parameters() if getattr(p, "global_shape", None) is None]
    assert any("ln_" in name for name, _ in whole) and any("proj.bias" in name for name, _ in whole)
    for name, values in whole:
        copies = ctx.tp.mpi.allgather(np.ascontiguousarray(values))
        assert all(np.array_equal(c, copies[0]) for c in copies), name
