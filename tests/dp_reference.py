"""The single-process answer for data-parallel tests: a tiny float64 GPT trained on the full batch."""
import numpy as np

from hpcpar.nn import DropoutKey, dropout_key
from hpcpar.nn.gpt import GPT, GPTConfig
from hpcpar.optim import AdamW

CONFIG = GPTConfig(vocab_size=16, block_size=8, n_layer=2, n_head=2, n_embd=8, seed=3)
GLOBAL_BATCH = 8
LR = 1e-2


def global_batch(step: int):
    rng = np.random.default_rng(1000 + step)
    ids = rng.integers(0, CONFIG.vocab_size, (GLOBAL_BATCH, CONFIG.block_size + 1))
    return ids[:, :-1], ids[:, 1:]


def make_model():
    return GPT(CONFIG, dtype=np.float64)


def make_optimizer(params):
    return AdamW(params, lr=LR, weight_decay=0.1)


def train_single_process(steps: int):
    """(parameters by name, losses) after ``steps`` AdamW steps on the full global batch."""
    model = make_model()
    optimizer = make_optimizer(model.named_parameters())
    losses = []
    for step in range(steps):
        ids, targets = global_batch(step)
        loss = model.loss(ids, targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return {name: p.data.copy() for name, p in model.named_parameters()}, losses


def max_difference(params_a: dict, params_b: dict) -> float:
    assert params_a.keys() == params_b.keys()
    return max(float(np.max(np.abs(params_a[k] - params_b[k]))) for k in params_a)


class DataParallelRun:
    """A resumable float64 data-parallel run of the reference model (DDP + AdamW, or ZeRO-1).

    Uses dropout (masks keyed by step and sample, as the training loop keys them) and a
    warm-up/cosine schedule, so that an exact resume has to restore the step and the schedule.
    """

    def __init__(self, ctx, zero=False, dropout=0.1):
        from hpcpar.optim import WarmupCosine
        from hpcpar.parallel import DistributedDataParallel
        from hpcpar.parallel.zero import ZeroRedundancyOptimizer

        self.ctx = ctx
        config = GPTConfig(**{**CONFIG.to_dict(), "dropout": dropout})
        self.model = GPT(config, dtype=np.float64)
        if zero:
            self.ddp = None
            self.optimizer = ZeroRedundancyOptimizer(self.model.named_parameters(), ctx.dp, AdamW, lr=LR,
                                                     weight_decay=0.1)
        else:
            self.ddp = DistributedDataParallel(self.model, ctx)
            self.optimizer = make_optimizer(self.model.named_parameters())
        self.schedule = WarmupCosine(self.optimizer, warmup_steps=2, total_steps=10)

    def extra(self) -> dict:
        return {"schedule": self.schedule}

    def train(self, steps) -> list:
        per_rank = GLOBAL_BATCH // self.ctx.dp_size
        rows = slice(self.ctx.dp_rank * per_rank, (self.ctx.dp_rank + 1) * per_rank)
        losses = []
        for step in steps:
            ids, targets = global_batch(step)
            with dropout_key(DropoutKey(step, rows.start)):
                loss = self.model.loss(ids[rows], targets[rows])
            loss.backward()
            if self.ddp is not None:
                self.ddp.finish_grad_sync()
            self.optimizer.step()
            self.optimizer.zero_grad()
            self.schedule.step()
            losses.append(self.ctx.dp.allreduce(np.array([loss.item()]), "mean")[0])
        return losses

    def parameters(self) -> dict:
        return {name: p.data.copy() for name, p in self.model.named_parameters()}


def accumulate_share(model, sync, ctx, step: int, accumulate: int) -> None:
    """Backward of this dp rank's share of ``step``'s global batch in ``accumulate`` micro-batches,
    all but the last under ``sync.no_sync()`` (the loss of each scaled by 1 / accumulate)."""
    ids, targets = global_batch(step)
    per_rank = GLOBAL_BATCH // ctx.dp_size
    micro = per_rank // accumulate
    for i in range(accumulate):
        rows = slice(ctx.dp_rank * per_rank + i * micro, ctx.dp_rank * per_rank + (i + 1) * micro)
        loss = model.loss(ids[rows], targets[rows]) * (1.0 / accumulate)
        if i < accumulate - 1:
            with sync.no_sync():
                loss.backward()
        else:
            loss.backward()
