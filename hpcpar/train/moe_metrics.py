"""The metrics file's ``moe`` entry: expert load and auxiliary losses over the whole job.

Each MoE block counts what this rank's training forwards routed (``nn.moe.ExpertLoad``: one tp
rank of each group, the stage that holds the block); at a logged step one all-reduce over the
world adds them up, and the counts start again. ``train.expert_load`` turns the entry into the
progress line's summary and the imbalance warning; ``hpcpar plot`` draws it.
"""
from __future__ import annotations

import numpy as np


def moe_record(gpt, world, batch_size: int) -> dict:
    """``{"blocks", "experts", "tokens", "dropped", "aux_loss", "z_loss", "steps"}`` of the GPT's MoE
    blocks since the previous record; collective over ``world``."""
    blocks = gpt.moe_blocks()
    rows = np.stack([moe.load.row() for _, moe in blocks])  # (blocks, experts + 4)
    total = world.allreduce(rows, "sum")
    for _, moe in blocks:
        moe.load.reset()
    experts = blocks[0][1].moe.experts
    routed, dropped, aux, z, sequences = (total[:, :experts], total[:, experts], total[:, experts + 1],
                                          total[:, experts + 2], total[:, experts + 3])
    seen = np.maximum(sequences, 1)
    return {"blocks": [index for index, _ in blocks], "experts": experts,
            "tokens": routed.astype(np.int64).tolist(),
            "dropped": (dropped / np.maximum(routed.sum(axis=1), 1)).tolist(),
            "aux_loss": float((aux / seen).sum()), "z_loss": float((z / seen).sum()),
            "steps": int(round(float(sequences.max()) / batch_size))}
