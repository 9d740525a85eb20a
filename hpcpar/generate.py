"""``hpcpar generate CKPT``: sample text from a GPT checkpoint, whatever layout wrote it.

    hpcpar generate runs/demo/checkpoints --tokens 300 --prompt "def "

Serial: the checkpoint's global view is read into one whole GPT (its config is stored in the
checkpoint by ``hpcpar train``).
"""
from __future__ import annotations

import argparse

import numpy as np

from . import checkpoint
from .checkpoint.manifest import CheckpointError, read_manifest, resolve_step_dir
from .dist.context import single_process
from .nn.gpt import GPT, GPTConfig


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="hpcpar generate")
    parser.add_argument("checkpoint", help="a checkpoint root (its latest step) or a step folder")
    parser.add_argument("--tokens", type=int, default=200)
    parser.add_argument("--prompt", default="import ")
    parser.add_argument("--temperature", type=float, default=0.8)
    parser.add_argument("--top-k", type=int, default=40)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    try:
        step_dir = resolve_step_dir(args.checkpoint)
        saved = read_manifest(step_dir)["extra"].get("model_config")
        if saved is None:
            raise CheckpointError(f"{step_dir}: no model_config in the checkpoint (was it written by hpcpar train?)")
        keys = GPTConfig.__dataclass_fields__
        model = GPT(GPTConfig(**{k: v for k, v in saved["value"].items() if k in keys}), dtype=np.float32)
        checkpoint.load(step_dir, model, None, single_process())
    except CheckpointError as error:
        print(f"hpcpar generate: error: {error}")
        return 2
    prompt = np.frombuffer(args.prompt.encode(), dtype=np.uint8).astype(np.int64)[None, :]
    ids = model.generate(prompt, args.tokens, temperature=args.temperature, top_k=args.top_k,
                         rng=np.random.default_rng(args.seed))
    print(bytes(ids[0].astype(np.uint8).tolist()).decode("utf-8", errors="replace"))
    return 0
