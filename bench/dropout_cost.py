"""What keyed dropout costs: forward + backward of the GPT with dropout 0.1, one process, one BLAS thread.

    python bench/dropout_cost.py [--repeats 15] [--batch 8]

Three ways in the same run, interleaved step by step, medians: dropout off; the masks drawn
from one generator stream per model (what hpcpar did before masks were keyed: each Dropout
called ``rng.random`` on the model's PCG64, attention drew one key from it and seeded one
generator per head); and keyed masks (``hpcpar.nn.dropout_keys``: one stream per (seed, step,
layer[, head]), the samples addressed in it). The stream baseline lives here only, as the
yardstick.
"""
import argparse
import os
import sys
import time

for variable in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(variable, "1")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

from hpcpar.autograd import ops  # noqa: E402
from hpcpar.autograd.ops.nn_functional import dropout_scale  # noqa: E402
from hpcpar.bench.step import BENCH_CONFIG  # noqa: E402
from hpcpar.nn import GPT, DropoutKey, GPTConfig, dropout_key  # noqa: E402
from hpcpar.nn.layers import Dropout, HeadDropout  # noqa: E402

KEYED = {Dropout: Dropout.forward, HeadDropout: HeadDropout.forward}


def stream_dropout(self, x):
    """The former Dropout.forward: the next draws of the model's one generator."""
    if not self.training or self.p == 0.0:
        return x
    return ops.dropout(x, self.p, self.stream)


def stream_head_dropout(self, batch, steps, dtype, xp):
    """The former HeadDropout.forward: a key from the model's stream, one generator per head."""
    if not self.training or self.p == 0.0:
        return None
    key = int(self.stream.integers(2**63))
    keep = xp.empty((batch, len(self.heads), steps, steps), dtype=np.float32 if dtype != np.float64 else dtype)
    for local, head in enumerate(self.heads):
        seed = int(np.random.SeedSequence([key, head]).generate_state(1, np.uint64)[0])
        keep[:, local] = dropout_scale(xp.random.default_rng(seed), self.p, (batch, steps, steps), dtype, xp)
    return keep


STREAM = {Dropout: stream_dropout, HeadDropout: stream_head_dropout}


def use(forwards: dict) -> None:
    for cls, forward in forwards.items():
        cls.forward = forward


def fwd_bwd(model, ids, targets, step: int) -> tuple[float, float]:
    """(wall, CPU) seconds of one forward and backward; CPU time is what a shared machine disturbs least."""
    wall, cpu = time.perf_counter(), time.process_time()
    with dropout_key(DropoutKey(step)):
        model.loss(ids, targets).backward()
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    for p in model.parameters():
        p.grad = None
    return wall, cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--batch", type=int, default=8)
    args = parser.parse_args()
    config = GPTConfig(**{**BENCH_CONFIG.to_dict(), "dropout": 0.1})
    models = {"off": GPT(BENCH_CONFIG), "stream (before)": GPT(config), "keyed (now)": GPT(config)}
    stream = np.random.default_rng(config.seed)
    for _, module in models["stream (before)"].named_modules():
        if isinstance(module, (Dropout, HeadDropout)):
            module.stream = stream
    ids = np.random.default_rng(0).integers(0, config.vocab_size, (args.batch, config.block_size + 1))
    ids, targets = ids[:, :-1], ids[:, 1:]
    times = {name: [] for name in models}
    for step in range(args.repeats + 2):  # two warm-up rounds
        for name, model in models.items():
            use(STREAM if name.startswith("stream") else KEYED)
            elapsed = fwd_bwd(model, ids, targets, step)
            if step >= 2:
                times[name].append(elapsed)
    use(KEYED)
    print(f"GPT {config.n_layer} layers, n_embd {config.n_embd}, block {config.block_size}, batch {args.batch}, "
          f"float32, 1 BLAS thread; forward + backward, median of {args.repeats}")
    print(f"  {'dropout':24s} {'wall ms':>9s} {'/ stream':>9s} {'CPU ms':>9s} {'/ stream':>9s}")
    medians = {name: np.median(np.array(t), axis=0) for name, t in times.items()}
    base = medians["stream (before)"]
    for name, (wall, cpu) in medians.items():
        print(f"  {name:24s} {wall * 1e3:9.1f} {wall / base[0]:9.3f} {cpu * 1e3:9.1f} {cpu / base[1]:9.3f}")


if __name__ == "__main__":
    main()
