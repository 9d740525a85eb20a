"""The single-process answer for data-parallel tests: a tiny float64 GPT trained on the full batch."""
import numpy as np

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
