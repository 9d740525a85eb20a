"""Weight-decay parameter groups: which parameters decay and by how much, by group or by name pattern.

    AdamW(model.named_parameters(), lr=3e-4, weight_decay=0.1, no_decay=["*.bias", "*ln_*", "embed.*"])
    AdamW([{"params": matrices, "weight_decay": 0.1}, {"params": others, "weight_decay": 0.0}], lr=3e-4)

GPT-2, nanoGPT and Megatron exempt biases and LayerNorm weights (minGPT the embeddings too): a
decay pulls them toward 0, which is no sensible prior for a shift or a scale. ``no_decay`` takes
shell-style patterns (``fnmatch``) matched against parameter names; a group dict may set
``weight_decay`` for its parameters (PyTorch's format; other keys are refused: one learning-rate
schedule drives every parameter).

Membership is by parameter name, so it survives any layout: tensor shards and pipeline stages
keep their parameters' names, and ZeRO-1 and the parameter server, which hold one flat array
per rank, give it a ``DecayRuns``: the weight decay of each run of elements along it.
"""
from __future__ import annotations

import fnmatch

GROUP_KEYS = ("params", "weight_decay")


def flatten_groups(params) -> tuple[list, dict]:
    """(the parameters as a list of items, {position: weight decay their group sets}).

    ``params``: named pairs or bare parameters (one group), or PyTorch-style dicts
    ``{"params": [...], "weight_decay": x}``; items keep their order, group after group.
    """
    items = list(params)
    if not items or not all(isinstance(item, dict) for item in items):
        if any(isinstance(item, dict) for item in items):
            raise TypeError("optimizer parameters: give either parameter groups (dicts) or parameters, not both")
        return items, {}
    flat, given = [], {}
    for number, group in enumerate(items):
        unknown = sorted(set(group) - set(GROUP_KEYS))
        if unknown or "params" not in group:
            raise ValueError(f"parameter group {number}: keys are {', '.join(GROUP_KEYS)} ('params' required), "
                             f"got {sorted(group)}; one learning rate (the schedule's) drives all groups")
        members = list(group["params"])
        if "weight_decay" in group:
            if float(group["weight_decay"]) < 0:
                raise ValueError(f"parameter group {number}: weight_decay must be >= 0, got {group['weight_decay']}")
            given.update({len(flat) + i: float(group["weight_decay"]) for i in range(len(members))})
        flat += members
    return flat, given


def decay_overrides(names, given: dict, no_decay=()) -> dict:
    """{name: weight decay} of the parameters whose decay is not the optimizer's default: 0 for names
    matching a ``no_decay`` pattern, else the value their group sets (``given``, by position)."""
    patterns = [no_decay] if isinstance(no_decay, str) else list(no_decay)
    overrides = {}
    for i, name in enumerate(names):
        if any(fnmatch.fnmatchcase(name, p) for p in patterns):
            overrides[name] = 0.0
        elif i in given:
            overrides[name] = given[i]
    return overrides


def flat_range_decays(names, optimizer, given: dict, no_decay=()) -> dict:
    """{name: weight decay} for an optimizer stepping a flat range of parameters (ZeRO-1, the parameter
    server): the group's or pattern's value, else ``optimizer.weight_decay``."""
    if (given or no_decay) and not hasattr(optimizer, "weight_decay"):
        raise ValueError(f"{type(optimizer).__name__} has no weight decay for groups or no_decay to set")
    default = getattr(optimizer, "weight_decay", 0.0)
    overrides = decay_overrides(names, given, no_decay)
    return {name: overrides.get(name, default) for name in names}


def set_flat_range_decay(optimizer, names, sizes, decays: dict, begin: int, end: int) -> None:
    """Give ``optimizer``'s one flat parameter ("shard": elements [begin, end) of the parameters laid
    end to end) the weight decay of each parameter it covers, as ``DecayRuns``."""
    if hasattr(optimizer, "weight_decay"):
        optimizer.set_weight_decay("shard", DecayRuns.over_range(names, sizes, decays, begin, end))


def unmatched_patterns(names, no_decay) -> list[str]:
    """The ``no_decay`` patterns that match none of ``names`` (a typo, most likely)."""
    return [p for p in no_decay if not any(fnmatch.fnmatchcase(name, p) for name in names)]


class DecayRuns:
    """Weight decay that changes along a flat array (a ZeRO-1 shard, a parameter server's range).

    ``runs``: [(start, stop, weight_decay)] over the array; adjacent runs of one value merge, so a
    step costs one in-place pass per run of decayed parameters (a few dozen for a GPT).
    """

    def __init__(self, runs):
        merged = []
        for start, stop, value in runs:
            if stop <= start:
                continue
            if merged and merged[-1][1] == start and merged[-1][2] == value:
                merged[-1] = (merged[-1][0], stop, value)
            else:
                merged.append((start, stop, float(value)))
        self.runs = merged

    @classmethod
    def over_range(cls, names, sizes, decays: dict, begin: int, end: int) -> "DecayRuns":
        """The runs of [begin, end) of parameters laid end to end (``sizes`` in order); outside any
        parameter (padding) the decay is 0."""
        runs, offset = [], 0
        for name, size in zip(names, sizes):
            lo, hi = max(begin, offset), min(end, offset + size)
            if lo < hi:
                runs.append((lo - begin, hi - begin, decays[name]))
            offset += size
        return cls(runs)

    def __bool__(self) -> bool:
        return any(value for _, _, value in self.runs)

    def __eq__(self, other) -> bool:
        return isinstance(other, DecayRuns) and self.runs == other.runs

    def __repr__(self) -> str:
        return f"DecayRuns({self.runs})"


def decay_decoupled(param, weight_decay, lr: float) -> None:
    """AdamW's ``param *= 1 - lr * weight_decay``, in place; ``weight_decay`` a float or ``DecayRuns``."""
    if isinstance(weight_decay, DecayRuns):
        for start, stop, value in weight_decay.runs:
            if value:
                param[start:stop] *= 1.0 - lr * value
    elif weight_decay:
        param *= 1.0 - lr * weight_decay


def with_l2(grad, param, weight_decay):
    """``grad + weight_decay * param`` (L2 decay for Adam and SGD); ``grad`` itself when there is none."""
    if isinstance(weight_decay, DecayRuns):
        if not weight_decay:
            return grad
        grad = grad.copy()
        for start, stop, value in weight_decay.runs:
            if value:
                grad[start:stop] += value * param[start:stop]
        return grad
    return grad + weight_decay * param if weight_decay else grad
