"""Mixture-of-Experts MLPs (GShard, Switch): a router sends each token to top_k of E expert MLPs.

    moe = MoE(gpt_config, MoEConfig(experts=8, top_k=2), dtype, xp, tp=ctx.tp, ep=ep_group)
    y = moe(x)    # (B, T, C) -> (B, T, C); its load-balancing and z losses join backward

Routing is the same in every layout: each rank routes whole sequences (with sequence
parallelism the router's scores are gathered over tp first), ties go to the lower expert, and
capacity counts per sequence (``route``). Experts are split over the ``ep`` group; tokens reach
them and come back by all-to-all (``autograd.ops.experts``). The auxiliary losses are means over
sequences, so a micro-batch's share is exact at any dp, ep, tp, pp and micro-batch count; they
are seeded with the engine's loss scale (``auxiliary_loss_scale``), not added to the returned loss.
"""
from __future__ import annotations

import contextlib
import math
from dataclasses import asdict, dataclass

import numpy as np

from ..autograd import is_grad_enabled, ops
from ..autograd.ops import experts as moe_ops
from ..autograd.ops import mappings
from ..backend import to_device, to_host
from . import init
from .layers import Dropout, new_parameter
from .module import Module


@dataclass
class MoEConfig:
    experts: int
    top_k: int = 2
    capacity_factor: float | None = None  # None: dropless
    every: int = 1  # an MoE MLP in blocks every-1, 2*every-1, ...
    aux_loss_coef: float = 0.01
    z_loss_coef: float = 0.001

    def __post_init__(self):
        if self.experts < 1 or self.top_k not in (1, 2) or self.top_k > self.experts or self.every < 1:
            raise ValueError(f"MoEConfig needs experts >= 1, top_k 1 or 2 and at most experts, every >= 1; got "
                             f"experts {self.experts}, top_k {self.top_k}, every {self.every}")
        if self.capacity_factor is not None and self.capacity_factor <= 0:
            raise ValueError(f"MoEConfig.capacity_factor must be above 0 (None: dropless), got {self.capacity_factor}")

    def is_moe_block(self, index: int) -> bool:
        return (index + 1) % self.every == 0

    def capacity(self, tokens: int) -> int | None:
        """Assignments an expert takes from a sequence of ``tokens`` (None: all of them)."""
        if self.capacity_factor is None:
            return None
        return math.ceil(tokens * self.top_k * self.capacity_factor / self.experts)

    def to_dict(self) -> dict:
        return asdict(self)


def is_router(key: str) -> bool:
    """Whether a checkpoint key is an MoE router's weight (what a dense model has no counterpart of)."""
    return key.endswith(".router.weight")


_loss_scale = [1.0]


@contextlib.contextmanager
def auxiliary_loss_scale(scale: float):
    """The seed an MoE block gives its auxiliary losses inside this block: what the engine seeds
    its loss with (1/micro-batches times the loss scale). Outside any, 1: ``loss.backward()``."""
    previous, _loss_scale[0] = _loss_scale[0], float(scale)
    try:
        yield
    finally:
        _loss_scale[0] = previous


@dataclass
class Routing:
    """One forward's decisions, on the host: ``experts`` (N, k) chosen per token; ``kept`` (N, k) those
    under capacity; ``order``: the kept (token, choice) slots n*k+j sorted by expert (then slot);
    ``counts`` (E,) kept rows per expert, in that order; ``routed`` (E,) before dropping."""

    experts: np.ndarray
    kept: np.ndarray
    order: np.ndarray
    counts: np.ndarray
    routed: np.ndarray


def route(probs: np.ndarray, top_k: int, capacity: int | None) -> Routing:
    """Top-k experts of each token of ``probs`` (B, T, E) and who stays under ``capacity``.

    Ties go to the lower expert (a stable sort). Over capacity, an expert keeps a sequence's first
    choices before its second choices, each in position order (GShard's priority), so what drops
    depends on the sequence alone, never on the layout or the micro-batch."""
    B, T, E = probs.shape
    chosen = np.argsort(-probs, axis=-1, kind="stable")[..., :top_k]  # (B, T, k)
    kept = np.ones(chosen.shape, dtype=bool)
    if capacity is not None:
        priority = chosen.transpose(0, 2, 1).reshape(B, top_k * T)  # choice-major, then position
        onehot = priority[..., None] == np.arange(E)
        place = np.cumsum(onehot, axis=1) - 1  # the assignment's rank among its expert's, per sequence
        under = np.take_along_axis(place, priority[..., None], axis=2)[..., 0] < capacity
        kept = under.reshape(B, top_k, T).transpose(0, 2, 1)
    chosen, kept = chosen.reshape(B * T, top_k), kept.reshape(B * T, top_k)
    slots = np.flatnonzero(kept)
    order = slots[np.argsort(chosen.reshape(-1)[slots], kind="stable")]
    return Routing(chosen, kept, order, np.bincount(chosen.reshape(-1)[slots], minlength=E),
                   np.bincount(chosen.reshape(-1), minlength=E))


class ExpertLinear(Module):
    """E experts' ``x @ weight[e] + bias[e]``: weight (experts, in, out) and bias (experts, out) are
    global tensors. This rank holds experts [first, first + local) and, split over tp like the dense
    MLP, its block of the outputs (``split="out"``, the first layer) or inputs (``"in"``, the second:
    partial sums, and the bias, which is replicated, added after their all-reduce)."""

    def __init__(self, experts: tuple[int, int, int], features: tuple[int, int], tp, split: str, bias: bool,
                 dtype, xp):
        super().__init__()
        total, first, local = experts
        axis = 2 if split == "out" else 1
        start, stop = mappings.shard_range(features[axis - 1], tp, "MLP hidden units")
        shape, begin = [total, *features], [first, 0, 0]
        begin[axis] = start
        self.weight = slab_parameter(tuple(shape), tuple(begin), (local, *[stop - start if a == axis else shape[a]
                                                                          for a in (1, 2)]), init.normal(0.02), dtype, xp)
        self.bias = None
        if bias:
            width = (stop - start) if split == "out" else features[1]
            self.bias = slab_parameter((total, features[1]), (first, start if split == "out" else 0), (local, width),
                                       init.zeros, dtype, xp)


def slab_parameter(global_shape: tuple, start: tuple, shape: tuple, rule, dtype, xp):
    """A parameter holding the block of ``global_shape`` that begins at ``start`` (all of it: a plain one)."""
    param = new_parameter(shape, rule, dtype, xp)
    if tuple(shape) != tuple(global_shape):
        param.global_shape, param.global_start = tuple(global_shape), tuple(start)
    return param


class Router(Module):
    """Scores (..., E) of each token for each expert, in float32 at least (``ops.experts.router_logits``)."""

    def __init__(self, width: int, experts: int, dtype, xp):
        super().__init__()
        self.weight = new_parameter((width, experts), init.normal(0.02), dtype, xp)

    def forward(self, x):
        return moe_ops.router_logits(x, self.weight)


@dataclass
class ExpertLoad:
    """What this rank's forwards routed since ``reset``: assignments per expert before dropping,
    those dropped, and the sums of the auxiliary losses over the sequences (the metrics'
    ``moe`` entry adds them over the ranks)."""

    routed: np.ndarray
    dropped: int = 0
    aux: float = 0.0
    z: float = 0.0
    sequences: int = 0

    def add(self, routing: Routing, aux: float, z: float, sequences: int) -> None:
        self.routed += routing.routed
        self.dropped += int(routing.kept.size - routing.kept.sum())
        self.aux += aux * sequences
        self.z += z * sequences
        self.sequences += sequences

    def row(self) -> np.ndarray:
        """[routed per expert..., dropped, aux sum, z sum, sequences] as float64."""
        return np.concatenate([self.routed, [self.dropped, self.aux, self.z, self.sequences]]).astype(np.float64)

    def reset(self) -> None:
        self.routed[...] = 0
        self.dropped, self.aux, self.z, self.sequences = 0, 0.0, 0.0, 0


class MoE(Module):
    """A block's MLP as ``experts`` MLPs of the dense one's shape, top_k of them per token.

    ``tp``: each expert is split over tp as the dense MLP (hidden units), the tokens replicated on
    the tp ranks, which route alike; their partial outputs are all-reduced on the experts' side.
    With ``sequence_parallel`` the router scores this rank's slice and the scores are gathered;
    the tokens are gathered as the dense MLP's are, and each rank keeps its slice of the output.
    ``ep``: the group the experts are split over (None: all here)."""

    def __init__(self, config, moe: MoEConfig, dtype, xp, tp=None, ep=None):
        super().__init__()
        ranks, rank = (1, 0) if ep is None else (ep.size, ep.rank)
        if moe.experts % ranks:
            raise ValueError(f"MoE: {moe.experts} experts do not split over ep = {ranks} ranks")
        self.moe, self.local = moe, moe.experts // ranks
        object.__setattr__(self, "tp", tp)
        object.__setattr__(self, "ep", ep if ranks > 1 else None)
        width, experts = config.n_embd, (moe.experts, rank * self.local, self.local)
        self.router = Router(width, moe.experts, dtype, xp)
        self.fc = ExpertLinear(experts, (width, 4 * width), tp, "out", config.bias, dtype, xp)
        self.proj = ExpertLinear(experts, (4 * width, width), tp, "in", config.bias, dtype, xp)
        self.drop = Dropout(config.dropout)
        self.sequence_parallel = False
        self.load = ExpertLoad(np.zeros(moe.experts, dtype=np.int64))
        self.routing = None  # the last forward's decisions (tests, benches)
        for param in [*self.fc.parameters(), *self.proj.parameters()]:
            param.expert_parallel = self.ep is not None

    def _expert_weights(self):
        """fc and proj weights and biases as the experts use them: under expert parallelism each
        gradient is divided by ep, since a rank's experts serve the ep group's tokens and are then
        averaged over the dp / ep ranks that hold them (the mean over dp of every rank's loss)."""
        factor = 1.0 if self.ep is None else 1.0 / self.ep.size
        return [None if p is None else moe_ops.scale_gradient(p, factor)
                for p in (self.fc.weight, self.fc.bias, self.proj.weight, self.proj.bias)]

    def forward(self, x):
        tp, sp = self.tp, self.sequence_parallel
        logits = self.router(x)  # (B, T', E): outside the tp region, so its gradient is not summed over tp
        if sp:
            logits = mappings.sequence_to_replicated(logits, tp)
        whole = mappings.enter_tp(x, tp, sp)  # (B, T, C) on every tp rank
        B, T, C = whole.shape
        probs = ops.softmax(logits, axis=-1)
        self.routing = routing = route(to_host(probs.data), self.moe.top_k, self.moe.capacity(T))
        slots = self._experts(ops.reshape(whole, (B * T, C)), routing)  # (B T k, C), zeros where dropped
        out = ops.reshape(self._combine(slots, probs, routing, B * T), (B, T, C))
        if sp:
            out = mappings.replicated_to_sequence(out, tp)
        return self.drop(self._with_losses(out, logits, probs, routing))

    def _experts(self, tokens, routing: Routing):
        """The expert MLPs on the kept (token, choice) slots, returned into those slots."""
        xp, k = tokens.xp, self.moe.top_k
        rows = moe_ops.permute_rows(tokens, to_device(routing.order // k, xp))  # (A, C), by expert
        rows, counts, back = self._dispatch(rows, routing.counts)
        fc_weight, fc_bias, proj_weight, proj_bias = self._expert_weights()
        h = ops.gelu(moe_ops.grouped_linear(rows, fc_weight, fc_bias, counts))
        y = mappings.reduce_from_tp(moe_ops.grouped_linear(h, proj_weight, None, counts), self.tp)
        if proj_bias is not None:
            y = y + moe_ops.permute_rows(proj_bias, to_device(np.repeat(np.arange(self.local), counts), xp))
        return moe_ops.unpermute_rows(back(y), to_device(routing.order, xp), tokens.shape[0] * k)

    def _dispatch(self, rows, counts):
        """(rows at this rank's experts grouped by expert, their counts, the way back): the counts
        are exchanged first, then the rows by all-to-all over ep."""
        if self.ep is None:
            return rows, counts, lambda y: y
        ep, xp = self.ep, rows.xp
        sent_by_expert = counts.reshape(ep.size, self.local).astype(np.int64)
        received = to_host(ep.alltoall(sent_by_expert))  # (ranks, local experts): from rank q for expert e
        sent, got = sent_by_expert.sum(axis=1), received.sum(axis=1)
        rows = moe_ops.all_to_all_rows(rows, ep, sent, got)  # by source rank, then expert
        starts = np.concatenate([[0], np.cumsum(received.reshape(-1))[:-1]]).reshape(received.shape)
        by_expert = np.concatenate([np.arange(starts[q, e], starts[q, e] + received[q, e])
                                    for e in range(self.local) for q in range(ep.size)]).astype(np.int64)
        rows = moe_ops.permute_rows(rows, to_device(by_expert, xp))
        back = to_device(np.argsort(by_expert), xp)
        return rows, received.sum(axis=0), lambda y: moe_ops.all_to_all_rows(moe_ops.permute_rows(y, back), ep, got, sent)

    def _combine(self, slots, probs, routing: Routing, n: int):
        """Each token's output: its experts' outputs weighted by their gates (top-2: renormalised)."""
        k, experts = self.moe.top_k, self.moe.experts
        xp = slots.xp
        chosen = (np.arange(n)[:, None] * experts + routing.experts).reshape(-1)  # flat: rows, whose backward is portable
        gates = ops.reshape(ops.getitem(ops.reshape(probs, (n * experts,)), to_device(chosen, xp)), (n, k))
        if k > 1:
            gates = gates / ops.sum(gates, axis=-1, keepdims=True)
        slots = ops.reshape(slots, (n, k, slots.shape[-1]))
        out = ops.getitem(slots, (slice(None), 0)) * ops.getitem(gates, (slice(None), slice(0, 1)))
        for j in range(1, k):
            out = out + ops.getitem(slots, (slice(None), j)) * ops.getitem(gates, (slice(None), slice(j, j + 1)))
        return out

    def _with_losses(self, out, logits, probs, routing: Routing):
        """``out`` carrying the load-balancing loss E sum_i f_i P_i and the z-loss, each a mean over
        the micro-batch's sequences (f_i: the share of a sequence's assignments routed to expert i,
        P_i: its mean probability there), and recorded in ``load`` by a training forward."""
        B, T, E = probs.shape
        xp = probs.xp
        chosen = routing.experts.reshape(B, T * self.moe.top_k)
        share = (chosen[..., None] == np.arange(E)).sum(axis=1) / (T * self.moe.top_k)  # (B, E) f_i
        mean_probs = ops.mean(probs, axis=1)  # (B, E) P_i
        aux = ops.mean(ops.sum(mean_probs * to_device(share.astype(probs.dtype), xp), axis=-1)) * float(E)
        lse = logits - ops.log_softmax(logits, axis=-1)  # every entry of the last axis is logsumexp
        z = ops.mean(ops.getitem(lse, (Ellipsis, 0)) ** 2)
        if not (is_grad_enabled() and self.training):
            return out
        if mappings.tp_rank(self.tp) == 0:  # the tp ranks route alike: one of them counts
            self.load.add(routing, float(to_host(aux.data)), float(to_host(z.data)), B)
        terms = [term * coef for term, coef in ((aux, self.moe.aux_loss_coef), (z, self.moe.z_loss_coef)) if coef > 0]
        if not terms:
            return out
        loss = terms[0] if len(terms) == 1 else terms[0] + terms[1]
        return moe_ops.attach_loss(out, loss, _loss_scale[0])
