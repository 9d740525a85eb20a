"""``hpcpar generate CKPT``: sample text from a GPT checkpoint, whatever layout wrote it.

    hpcpar generate runs/demo/checkpoints --tokens 300 --prompt "def "

Serial: the checkpoint's global view is read into one whole GPT (its config is stored in the
checkpoint by ``hpcpar train``). Started by ``mpiexec -n N``, rank 0 does the work and prints
the text once; the other ranks have nothing to do.
"""
from __future__ import annotations

import numpy as np

from . import checkpoint, log
from .checkpoint.manifest import CheckpointError, read_manifest, resolve_step_dir
from .runtime.context import single_process
from .runtime.failfast import UsageError
from .nn.gpt import GPT, GPTConfig


def add_arguments(parser) -> None:
    parser.add_argument("checkpoint", help="a checkpoint root (its latest step) or a step folder")
    parser.add_argument("--tokens", type=int, default=200, help="tokens (bytes) to sample after the prompt")
    parser.add_argument("--prompt", default="import ", help="the text the sample continues")
    parser.add_argument("--temperature", type=float, default=0.8, help="softmax temperature; lower is more likely text")
    parser.add_argument("--top-k", type=int, default=40, help="sample among this many likeliest tokens")
    parser.add_argument("--seed", type=int, default=0, help="seed of the sampling")
    parser.set_defaults(func=run)


def run(args) -> int:
    if log.world_rank() != 0:
        return 0
    if args.tokens < 0 or args.top_k < 1 or not 0 <= args.temperature < float("inf"):  # before the checkpoint is read
        raise UsageError(f"hpcpar generate: error: --tokens must be >= 0, --top-k >= 1 and --temperature a number >= 0, "
                         f"got --tokens {args.tokens} --top-k {args.top_k} --temperature {args.temperature}")
    if not args.prompt:  # the model needs a token to continue from (without one, an IndexError)
        raise UsageError("hpcpar generate: error: --prompt is empty; give the text the sample continues (at least "
                         "one character)")
    try:
        step_dir = resolve_step_dir(args.checkpoint)
        saved = read_manifest(step_dir)["extra"].get("model_config")
        if saved is None:
            raise CheckpointError(f"{step_dir}: no model_config in the checkpoint (was it written by hpcpar train?)")
        keys = GPTConfig.__dataclass_fields__
        model = GPT(GPTConfig(**{k: v for k, v in saved["value"].items() if k in keys}), dtype=np.float32)
        checkpoint.load(step_dir, model, None, single_process())
    except CheckpointError as error:
        raise UsageError(f"hpcpar generate: error: {error}") from None
    prompt = np.frombuffer(args.prompt.encode(), dtype=np.uint8).astype(np.int64)[None, :]
    ids = model.generate(prompt, args.tokens, temperature=args.temperature, top_k=args.top_k,
                         rng=np.random.default_rng(args.seed))
    print(bytes(ids[0].astype(np.uint8).tolist()).decode("utf-8", errors="replace"))
    return 0
