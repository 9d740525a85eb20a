"""This rank's share of a model cut into pipeline stages, and the weights it shares with other ranks.

    stages = Stages(GPT(config), ctx, chunks=1, partition="uniform")
    stages.named_parameters()   # what precision, the gradient sync and the optimizer work on
    stages.tied.sum_gradients() # after the schedule: weights held by several stages agree

Every rank builds the whole model (same seed, same values) and keeps the layers of its virtual
stages ``r, r + p, ...``; ``Stages`` is what is known before any engine exists, so the
strategy builds precision and the gradient sync over it, then the engine.
"""
from __future__ import annotations

from ...state import ParameterHolder
from .partition import partition as partition_layers


class Stages(ParameterHolder):
    def __init__(self, model, ctx, chunks: int, partition="uniform", sample_input=None):
        layers = list(model.layers()) if hasattr(model, "layers") else list(model)
        names = ({id(p): n for n, p in model.named_parameters()} if hasattr(model, "named_parameters")
                 else {id(p): f"layers.{i}.{n}" for i, layer in enumerate(layers) for n, p in named_of(layer)})
        self.ctx, self.p = ctx, ctx.pp_size
        self.num_virtual = self.p * chunks
        self.bounds = partition_layers(layers, self.num_virtual, partition, sample_input,
                                       agree=lambda costs: ctx.world.bcast_object(costs, root=0))
        self.layers = {s: layers[self.bounds[s]: self.bounds[s + 1]]
                       for s in range(self.num_virtual) if s % self.p == ctx.pp_rank}
        self._named = []
        seen = set()
        for s in sorted(self.layers):
            for layer in self.layers[s]:
                for _, param in named_of(layer):
                    if id(param) not in seen:
                        seen.add(id(param))
                        self._named.append((names[id(param)], param))
        self.tied = TiedWeights(ctx, self._holders(layers), {id(p): p for _, p in self._named}, names)

    def _holders(self, layers) -> dict:
        """id(parameter) -> the pipeline ranks whose stages hold it."""
        holders: dict[int, set] = {}
        for s in range(self.num_virtual):
            for layer in layers[self.bounds[s]: self.bounds[s + 1]]:
                for _, param in named_of(layer):
                    holders.setdefault(id(param), set()).add(s % self.p)
        return holders

    def named_parameters(self):
        """This rank's parameters under their names in the whole model (tied ones on each holder)."""
        return list(self._named)

    def local_layers(self) -> list:
        """This rank's layers, its virtual stages in order (ZeRO-3's units)."""
        return [layer for s in sorted(self.layers) for layer in self.layers[s]]

    def rank_of(self, stage: int) -> int:
        return stage % self.p

    def is_mine(self, stage: int) -> bool:
        return self.rank_of(stage) == self.ctx.pp_rank


class TiedWeights:
    """Weights held by several pipeline ranks (the GPT's tied input/output embedding): one
    communicator per set of holders, over which their gradients are summed."""

    def __init__(self, ctx, holders: dict, mine: dict, names: dict):
        self.pp_rank = ctx.pp_rank
        groups: dict[tuple, list] = {}
        for param_id, ranks in holders.items():
            if len(ranks) > 1:
                groups.setdefault(tuple(sorted(ranks)), []).append(param_id)
        self.groups = []  # [(communicator over the holders, their ranks, [params])]
        for ranks in sorted(groups):  # the same order on every rank: Split is collective over pp
            member = ctx.pp_rank in ranks
            # The pp communicator's kind (MPI or NCCL); the context frees it when it is closed.
            comm = ctx.adopt(ctx.pp.split(0 if member else None, ctx.pp_rank, "pp-tied"))
            if member:
                params = sorted((mine[i] for i in groups[ranks]), key=lambda p: names[id(p)])
                self.groups.append((comm, ranks, params))
        self.saved_by_another = [names[id(p)] for _, ranks, params in self.groups for p in params
                                 if ranks[0] != self.pp_rank]  # the lowest holder saves them (checkpoints)

    def params(self) -> list:
        return [p for _, _, params in self.groups for p in params]

    def owns_for_norm(self, param) -> bool:
        """Whether this rank counts ``param`` in a global norm (tied weights: the lowest holder)."""
        return all(param not in params or self.pp_rank == ranks[0] for _, ranks, params in self.groups)

    def sum_gradients(self) -> None:
        for comm, _, params in self.groups:
            for p in params:
                p.grad = p.xp.zeros_like(p.data) if p.grad is None else p.xp.ascontiguousarray(p.grad)
                comm.allreduce(p.grad, "sum", out=p.grad)


def named_of(layer):
    return layer.named_parameters() if hasattr(layer, "named_parameters") else []
