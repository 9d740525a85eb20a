"""A model's layers in ``layers()`` order, each costed for one micro-batch (``model``, ``moe``).

The GPT's embedding, its blocks (dense, or MoE where ``[model.moe]`` puts experts) and its head;
the digits CNN's layers. Built once per ``Shape`` and shared between the plans of one shape.
"""
from __future__ import annotations

import functools
from dataclasses import replace

from .model import Layer, Shape, cnn_layers, gpt_block, gpt_embedding, gpt_head
from .moe import moe_block


def layers(shape: Shape) -> list[Layer]:
    """The model's layers in ``layers()`` order, each costed for one micro-batch of ``shape.rows`` rows
    (shared between the plans of one shape: read, never changed)."""
    return list(_layers(shape))


@functools.lru_cache(maxsize=256)  # a layout search plans the same shape for many layouts
def _layers(shape: Shape) -> tuple[Layer, ...]:
    if shape.kind == "cnn":
        return tuple(cnn_layers(shape))
    # every dense block costs the same, and every MoE block: copies of the first of each under their own names
    kinds = {False: gpt_block(shape, 0)}
    if shape.moe is not None:
        kinds[True] = moe_block(shape, 0)
    blocks = [_renamed(kinds[shape.moe is not None and shape.moe.is_moe_block(i)], i) for i in range(shape.n_layer)]
    return tuple([gpt_embedding(shape)] + blocks + [gpt_head(shape)])


def _renamed(block: Layer, index: int) -> Layer:
    """Block 0's costs as block ``index``'s."""
    def name(n: str) -> str:
        return n.replace("blocks.0.", f"blocks.{index}.", 1)

    return replace(block, name=f"blocks.{index}", params=[(name(n), e, sp) for n, e, sp in block.params],
                   expert_params=frozenset(map(name, block.expert_params)))
