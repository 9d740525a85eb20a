"""Cutting a flat list of layers into consecutive pipeline stages.

Every method returns stage boundaries ``[0, b1, ..., n]``: stage ``s`` holds layers
``bounds[s]:bounds[s+1]``, every layer exactly once, no stage empty.

- ``uniform``: layer counts as equal as possible (earlier stages get the extra layer);
- ``blocks``: Megatron-LM's cut: the middle layers (a GPT's blocks) as ``uniform``, the first
  (the embedding) with the first stage, the last (the head) with the last;
- ``parameters``: balance parameter counts;
- ``balanced``: balance measured forward+backward time per layer (``measure_layer_costs``;
  in a job of several ranks, world rank 0's measurement, which every rank cuts by);
- an explicit list of per-stage layer counts.
The balancing methods solve the linear partition problem exactly (``min_max_bounds``).
"""
from __future__ import annotations

import time

import numpy as np

from ...nn.dropout_keys import DropoutKey, dropout_key

PARTITION_METHODS = ("uniform", "blocks", "parameters", "balanced")


class PartitionError(ValueError):
    """An impossible partition request."""


def uniform_bounds(num_layers: int, num_stages: int) -> list[int]:
    _check(num_layers, num_stages)
    base, extra = divmod(num_layers, num_stages)
    counts = [base + (1 if s < extra else 0) for s in range(num_stages)]
    return counts_to_bounds(counts, num_layers)


def blocks_bounds(num_layers: int, num_stages: int) -> list[int]:
    """``blocks``: the ``num_layers - 2`` middle layers cut as ``uniform`` cuts, the first layer added
    to the first stage and the last to the last."""
    if num_layers - 2 < num_stages:
        raise PartitionError(f"partition 'blocks' needs a block per stage: {num_layers - 2} blocks (the layers "
                             f"between the first and the last) for {num_stages} stages")
    middle = uniform_bounds(num_layers - 2, num_stages)
    counts = [b - a for a, b in zip(middle, middle[1:])]
    counts[0] += 1
    counts[-1] += 1
    return counts_to_bounds(counts, num_layers)


def counts_to_bounds(counts, num_layers: int) -> list[int]:
    counts = list(counts)
    if any(not isinstance(c, (int, np.integer)) or c < 1 for c in counts):
        raise PartitionError(f"every stage needs at least one layer; got per-stage counts {counts}")
    if sum(counts) != num_layers:
        raise PartitionError(f"per-stage layer counts {counts} add up to {sum(counts)}, but there are {num_layers} layers")
    return [0, *np.cumsum(counts).tolist()]


def min_max_bounds(costs, num_stages: int) -> list[int]:
    """Contiguous split of ``costs`` into ``num_stages`` parts minimising the largest part's sum: dynamic
    programming over prefix sums, exact, O(k n^2), instant for the few hundred layers of any real model."""
    n = len(costs)
    _check(n, num_stages)
    prefix = np.concatenate([[0.0], np.cumsum(np.asarray(costs, dtype=np.float64))])
    inf = float("inf")
    # best[k][i]: the smallest possible largest part when the first i layers form k stages.
    best = [[inf] * (n + 1) for _ in range(num_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(num_stages + 1)]
    best[0][0] = 0.0
    for k in range(1, num_stages + 1):
        for i in range(k, n - (num_stages - k) + 1):
            for j in range(k - 1, i):  # the last stage is layers j..i-1
                value = max(best[k - 1][j], prefix[i] - prefix[j])
                if value < best[k][i]:
                    best[k][i], cut[k][i] = value, j
    bounds = [n]
    for k in range(num_stages, 0, -1):
        bounds.append(cut[k][bounds[-1]])
    return bounds[::-1]


def parameter_counts(layers) -> list[int]:
    return [sum(p.size for _, p in layer.named_parameters()) if hasattr(layer, "named_parameters") else 0
            for layer in layers]


def measure_layer_costs(layers, sample_input, repeats: int = 3) -> list[float]:
    """Median forward+backward seconds of each layer, feeding each the previous one's output."""
    from ...autograd import Tensor

    costs, x = [], sample_input
    for layer in layers:
        times = []
        for _ in range(repeats):
            inp = Tensor(x.data, requires_grad=True) if isinstance(x, Tensor) else x
            start = time.perf_counter()
            with dropout_key(DropoutKey(0)):  # dropout counted: any key's masks cost the same
                out = layer(inp)
            out.backward(out.xp.ones_like(out.data))
            times.append(time.perf_counter() - start)
        for _, p in (layer.named_parameters() if hasattr(layer, "named_parameters") else []):
            p.grad = None
        costs.append(float(np.median(times)))
        x = out.detach()
    return costs


def partition(layers, num_stages: int, method="uniform", sample_input=None, agree=None) -> list[int]:
    """Stage boundaries for ``layers`` by ``method`` (a name or a list of per-stage counts).

    ``agree(costs)``, for ``balanced`` in a job of several ranks, turns this rank's measured
    costs into the ones every rank cuts by (the engine: world rank 0's). Measured times differ
    from rank to rank, and ranks that cut differently hold different layers: some trained by
    no rank, missing from checkpoints."""
    n = len(layers)
    if not isinstance(method, str):
        _check(n, num_stages)
        if len(method) != num_stages:
            raise PartitionError(f"{len(method)} per-stage layer counts given for {num_stages} stages")
        return counts_to_bounds(method, n)
    if method == "uniform":
        return uniform_bounds(n, num_stages)
    if method == "blocks":
        return blocks_bounds(n, num_stages)
    if method == "parameters":
        return min_max_bounds(parameter_counts(layers), num_stages)
    if method == "balanced":
        if sample_input is None:
            raise PartitionError("partition 'balanced' measures each layer: pass sample_input (one micro-batch)")
        costs = measure_layer_costs(layers, sample_input)
        return min_max_bounds(agree(costs) if agree is not None else costs, num_stages)
    raise PartitionError(f"partition method must be one of {PARTITION_METHODS} or a list of per-stage counts, "
                         f"got {method!r}")


def _check(num_layers: int, num_stages: int) -> None:
    if num_stages < 1:
        raise PartitionError(f"need at least one stage, got {num_stages}")
    if num_layers < num_stages:
        raise PartitionError(f"cannot cut {num_layers} layers into {num_stages} stages: "
                             f"more stages than layers")
