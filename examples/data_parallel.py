"""Data parallelism on a byte-level GPT: every rank a replica, gradients all-reduced behind backward.

    mpiexec -n 4 python examples/data_parallel.py
    mpiexec -n 2 hpcpar run examples/data_parallel.py --steps 5    # under fail-fast

The lines between the README markers are shown in README.md (a test keeps the two equal).
"""
# --- README: data_parallel ---
import argparse

import numpy as np

import hpcpar
from hpcpar.data.corpus import batch_windows, stdlib_corpus
from hpcpar.nn import GPT, GPTConfig
from hpcpar.optim import AdamW
from hpcpar.parallel import DistributedDataParallel

parser = argparse.ArgumentParser(description="data-parallel training of a small GPT")
parser.add_argument("--steps", type=int, default=20, help="training steps (default: %(default)s)")
args = parser.parse_args()

ctx = hpcpar.init()                            # every rank a data-parallel replica (dp = world size)
config = GPTConfig(n_layer=2, n_embd=64, block_size=64)
model = GPT(config, device=ctx.device)
ddp = DistributedDataParallel(model, ctx, bucket_mb=1, overlap=True)   # compression="fp16"|"topk"|"powersgd"
optimizer = AdamW(model.named_parameters(), lr=1e-3)

tokens = stdlib_corpus(1 << 20)
rng = np.random.default_rng(0)                 # the same seed on every rank: the same global batch
batch = 16
rows = slice(ctx.dp_rank * batch // ctx.dp_size, (ctx.dp_rank + 1) * batch // ctx.dp_size)
for step in range(args.steps):
    ids, targets = batch_windows(tokens, rng.integers(0, len(tokens) - config.block_size - 1, batch),
                                 config.block_size)
    loss = model.loss(ids[rows], targets[rows])
    loss.backward()                            # full buckets are all-reduced while backward goes on
    ddp.finish_grad_sync()                     # the last ones: every grad now holds the mean over replicas
    optimizer.step()
    optimizer.zero_grad()
    if ctx.rank == 0:
        print(f"step {step + 1}: loss {loss.item():.3f}")

stats = ctx.dp.stats                           # every communicator counts its calls, bytes and seconds
if ctx.rank == 0:
    print(f"{stats.calls('allreduce')} all-reduces, {stats.bytes('allreduce') / 2**20:.1f} MiB given, "
          f"{stats.wire_bytes('allreduce') / 2**20:.1f} MiB sent by this rank (ring)")
# --- README end ---
