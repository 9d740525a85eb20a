"""Data, pipeline and tensor parallelism at once on a byte-level GPT, in plain Python.

    mpiexec -n 8 python examples/three_d.py               # dp 2 x pp 2 x tp 2
    mpiexec -n 4 python examples/three_d.py --steps 5     # dp 1 x pp 2 x tp 2

The lines between the README markers are shown in README.md (a test keeps the two equal).
"""
# --- README: three_d ---
import argparse

import numpy as np

import hpcpar
from hpcpar.data.corpus import batch_windows, stdlib_corpus
from hpcpar.nn import GPT, GPTConfig
from hpcpar.optim import AdamW
from hpcpar.parallel.pipeline import PipelineParallel

parser = argparse.ArgumentParser(description="3D-parallel training of a small GPT")
parser.add_argument("--steps", type=int, default=20, help="training steps (default: %(default)s)")
args = parser.parse_args()

ctx = hpcpar.init(pp=2, tp=2)                  # dp fills the rest: 8 ranks -> dp 2 x pp 2 x tp 2
config = GPTConfig(n_layer=4, n_embd=64, block_size=64)
model = GPT(config, device=ctx.device, tp=ctx.tp)   # tensor parallel inside the layers
model.sequence_parallel = True                 # optional: norms and residuals split along the sequence too
model.recompute = "selective"                  # optional: attention's (T, T) arrays redone in backward ("full": whole blocks)
pipe = PipelineParallel(model, ctx, schedule="1f1b", micro_batches=4)   # or "gpipe", "interleaved", "zb1"
optimizer = AdamW(pipe.named_parameters(), lr=1e-3)

tokens = stdlib_corpus(1 << 20)                # real text: the standard library's source, one byte a token
rng = np.random.default_rng(0)                 # the same seed on every rank: the same global batch
batch = 16
rows = slice(ctx.dp_rank * batch // ctx.dp_size, (ctx.dp_rank + 1) * batch // ctx.dp_size)  # this replica's
for step in range(args.steps):
    ids, targets = batch_windows(tokens, rng.integers(0, len(tokens) - config.block_size - 1, batch),
                                 config.block_size)
    loss = pipe.train_step(ids[rows], targets[rows])   # micro-batches through the stages; grads averaged over dp
    optimizer.step()
    optimizer.zero_grad()
    if ctx.rank == 0:
        print(f"step {step + 1}: loss {loss:.3f}")
# --- README end ---
