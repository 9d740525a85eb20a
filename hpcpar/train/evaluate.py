"""Evaluation on the validation split (every ``train.eval_interval`` steps and after the last) and text
sampled from the model at the end of training."""
from __future__ import annotations

import numpy as np

from .. import checkpoint
from ..autograd import no_grad


def evaluate(run) -> dict:
    """Mean loss over the fixed evaluation batches (and accuracy for the cnn), over all dp replicas."""
    ctx, model = run.ctx, run.model
    cnn = run.job.model.kind == "cnn"
    was_training = model.training
    model.eval()
    total, count, correct = 0.0, 0, 0
    with no_grad():
        for inputs, targets in run.eval_data:
            if cnn:  # through the strategy: a pipeline rank holds only its own stages' trained layers
                logits = run.strategy.evaluate_outputs(inputs)
                correct += int((logits.numpy().argmax(axis=1) == targets).sum())
                total += model.loss_from_logits(logits, targets).item() * len(targets)
            else:
                total += run.strategy.evaluate_loss(inputs, targets) * len(targets)
            count += len(targets)
    model.train(was_training)
    summed = ctx.dp_cp.allreduce(np.array([total, count, correct], dtype=np.float64), "sum")
    return {"val_loss": summed[0] / summed[1], **({"val_accuracy": summed[2] / summed[1]} if cnn else {})}


def sample_text(run, tokens: int) -> str:
    """Sample from the trained model; with pipeline stages the last checkpoint is read whole on rank 0."""
    from ..data.corpus import stdlib_corpus

    ctx = run.ctx
    prompt = stdlib_corpus(4096)[:16][None, :].astype(np.int64)  # the first bytes of the stdlib's first file
    rng = np.random.default_rng(run.job.train.seed)
    if ctx.pp_size == 1:
        ids = run.model.generate(prompt, tokens, temperature=0.8, top_k=40, rng=rng)
    else:
        ids = None
        if ctx.rank == 0:
            from ..runtime.context import single_process
            from ..nn.gpt import GPT

            whole = GPT(run.job.gpt_config(), dtype=np.float32)
            checkpoint.load(run.job.checkpoint.dir, whole, None, single_process(), strict=True)
            ids = whole.generate(prompt, tokens, temperature=0.8, top_k=40, rng=rng)
    if ctx.rank != 0:
        return ""
    return bytes(np.asarray(ids[0]).astype(np.uint8).tolist()).decode("utf-8", errors="replace")
