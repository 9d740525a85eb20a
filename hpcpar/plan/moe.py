"""An MoE block's costs (``nn.moe``): the dense block with its MLP as E experts and a router.

Per micro-batch and rank (N = b s tokens, E experts, k = top_k, ep ranks splitting them, L = E / ep
held here), under uniform routing A = ``Experts.assignments`` (token, expert) rows are kept, and as
many reach this rank's experts at any ep. The block is ``model.gpt_block`` with its MLP's work and
activations taken at A rows instead of N (the MLP's part is linear in its rows, so the difference
is the MLP at A - N rows), plus the router's product (float32 at least: family ``router``), its
softmaxes and the moves of rows; the all-to-alls run on ``ep``. docs/planner.md has the equations.
"""
from __future__ import annotations

from dataclasses import replace

import numpy as np

from ..autograd import precision
from .model import Layer, Shape, Work, gelu_workspace, gpt_block, passes, tp_entering, tp_leaving

INDEX_BYTES = 8  # the int64 rows a permutation keeps
# Autograd ops per micro-batch beyond a dense block's, counted in nn.moe's forward: 22 + 6 per choice,
# 4 more for the all-to-alls (the rows by rank, then by expert, and back), 2 for sp's brackets
OPS_BASE, OPS_PER_CHOICE, OPS_EP, OPS_SP = 22, 6, 4, 2


def moe_block(shape: Shape, index: int) -> Layer:
    """Block ``index`` with an MoE MLP, costed for one micro-batch of ``shape`` (``shape.moe``)."""
    dense = gpt_block(shape, index)
    moe, N = shape.moe, shape.tokens
    rows = moe.assignments(shape.rows, shape.block_size)
    mlp = mlp_work(shape, rows - N)  # the MLP at A rows, not N (negative units where A < N: the sums stay positive)
    routing = routing_work(shape, rows)
    forward, backward_input, backward_weight = (d + m + r for d, m, r in zip(
        (dense.forward, dense.backward_input, dense.backward_weight), mlp, routing))
    tp_f, tp_b = tp_calls(shape, rows)
    ep_f, ep_b = ep_calls(shape, rows)
    params = moe_params(shape, index, dense.params)
    gelu_now, gelu_dense = gelu_workspace(shape, rows), gelu_workspace(shape, N)
    h, t, d = shape.n_embd, shape.tp, shape.dtype_bytes
    # beside GELU's temporaries: the gradients of the gated slots and of the expert rows
    grads = (N * moe.top_k + rows) * h * d
    workspace = dense.workspace_bytes - gelu_dense + gelu_now + grads
    steps = [(4 * rows * h / t * d, gelu_now + 2 * N * h * d + grads), (8 * rows * h / t * d, workspace)]
    kept = {mode: kept_bytes + (0.0 if mode == "full" else kept_difference(shape, rows))
            for mode, kept_bytes in dense.kept_by_recompute.items()}
    return replace(dense, params=params, forward=forward, backward_input=backward_input, backward_weight=backward_weight,
                   saved_bytes=kept["none"], kept_by_recompute=kept, workspace_bytes=workspace, backward_steps=steps,
                   tp_forward=tp_f, tp_backward=tp_b, ep_forward=ep_f, ep_backward=ep_b,
                   expert_params=frozenset(name for name, _, _ in params if _is_expert(name)))


def mlp_work(shape: Shape, rows: float) -> tuple[Work, Work, Work]:
    """(F, B, W) of the dense MLP's part of a block over ``rows`` rows: fc and proj (16 rows h^2 / t
    FLOPs each way), GELU's passes over 4 rows h / t, and the copies taken as the MLP's share of the
    block's sharded ones (fc's bias add and GELU's, 8 rows h / t; its bias gradients 5 rows h / t)."""
    h, t, d = shape.n_embd, shape.tp, shape.dtype_bytes
    gemm, hidden, copy = 2 * rows * h * 8 * h / t, 4 * rows * h / t, 8 * rows * h / t * d
    return (Work().add("gemm", gemm).add("gelu", passes("gelu", hidden, d)).add("copy", copy),
            Work().add("gemm", gemm).add("gelu", passes("gelu", hidden, d, True)).add("copy", 1.5 * copy),
            Work().add("gemm", gemm).add("copy", rows * 5 * h / t * d))


def routing_work(shape: Shape, rows: float) -> tuple[Work, Work, Work]:
    """(F, B, W) of routing: the router's product (x W of its tokens, N h E, or N h E / t of a
    slice under sp; B and W the same again), the softmax and the z-loss's log-softmax over (N, E),
    the rows permuted to the experts and back (twice more under ep: by rank, then by expert) and
    the gated sum of the k outputs; one product per local expert in each grouped GEMM."""
    moe, N, h, d = shape.moe, shape.tokens, shape.n_embd, shape.dtype_bytes
    c = max(d, 4)
    r = N / shape.tp if shape.sequence_parallel else N
    router, scores = 2 * r * h * moe.experts, N * moe.experts
    moved = (2 + (2 if moe.ep > 1 else 0)) * rows * h * d + 3 * N * moe.top_k * h * d
    ops = (OPS_BASE + OPS_PER_CHOICE * moe.top_k + (OPS_EP if moe.ep > 1 else 0)
           + (OPS_SP if shape.sequence_parallel else 0) + 2 * (moe.local - 1))
    forward = Work(ops=ops).add("router", router).add("softmax", 2 * passes("softmax", scores, c)).add("copy", moved)
    backward = (Work(ops=ops).add("router", router).add("softmax", 2 * passes("softmax", scores, c, True))
                .add("copy", 1.5 * moved))
    return forward, backward, Work(ops=2 * moe.local + 1).add("router", router)


def moe_params(shape: Shape, index: int, dense: list) -> list:
    """The block's parameters with the MoE MLP's in place of the dense one's (``nn.moe.MoE``'s order):
    the router (h E, replicated over tp, on slices under sp), then this rank's L experts' fc and
    proj, split over tp as the dense MLP's (proj's bias replicated: it is added to whole rows).
    ``dense``: the dense block's parameters."""
    h, t, L = shape.n_embd, shape.tp, shape.moe.local
    names = [("mlp.router.weight", h * shape.moe.experts, True), ("mlp.fc.weight", L * h * 4 * h // t, False),
             ("mlp.fc.bias", L * 4 * h // t, False), ("mlp.proj.weight", L * 4 * h // t * h, False),
             ("mlp.proj.bias", L * h, False)]
    if not shape.bias:
        names = [n for n in names if not n[0].endswith("bias")]
    prefix = f"blocks.{index}."
    attention = [p for p in dense if not p[0].startswith(prefix + "mlp.")]
    return attention + [(prefix + n, e, sp) for n, e, sp in names]


def _is_expert(name: str) -> bool:
    return ".mlp.fc." in name or ".mlp.proj." in name


def tp_calls(shape: Shape, rows: float) -> tuple[list, list]:
    """[(op, bytes)] on tp, forward and backward: attention's as a dense block's; then the tokens
    entering the experts as the dense fc's input (all-reduced in backward; under sp all-gathered,
    reduce-scattered in backward), under sp the router's (N / t, E) scores all-gathered first (float32
    at least) and the output's slice all-gathered in backward, and the experts' partial sums of their
    ``rows`` all-reduced forward (nothing leaves as the dense proj does)."""
    N, h, t, d = shape.tokens, shape.n_embd, shape.tp, shape.dtype_bytes
    (f1, b1), (f2, b2) = tp_entering(shape, N * h), tp_leaving(shape, N * h)
    if t == 1:
        return f1 + f2, b1 + b2
    experts = [("allreduce", rows * h * d)]
    if shape.sequence_parallel:
        scores = ("allgather", N / t * shape.moe.experts * max(d, 4))
        return (f1 + f2 + [scores, ("allgather", N / t * h * d)] + experts,
                b1 + b2 + [("reduce_scatter", N * h * d), ("allgather", N / t * h * d)])
    return f1 + f2 + experts, b1 + b2 + [("allreduce", N * h * d)]


def ep_calls(shape: Shape, rows: float) -> tuple[list, list]:
    """[(op, bytes given)] on ep, forward and backward: the E int64 counts, then the ``rows`` rows to
    the experts and back (dispatch, combine); backward the combine's and the dispatch's reverse."""
    moe = shape.moe
    if moe.ep == 1:
        return [], []
    moved = rows * shape.n_embd * shape.dtype_bytes
    return ([("alltoall", INDEX_BYTES * moe.experts), ("alltoallv", moved), ("alltoallv", moved)],
            [("alltoallv", moved), ("alltoallv", moved)])


def kept_difference(shape: Shape, rows: float) -> float:
    """What an MoE block keeps beyond the dense block (recompute none or selective; under full both
    keep their input), exact for NumPy against ``autograd.memory`` under dropless routing: the MLP's
    fc output and GELU's output over A rows, not N; for fc's input, the
    router's (its slice under sp; a float32 copy under 16 bits) and the A expert rows; the gated
    slots (N k h); the softmax, log-softmax and log-sum-exp of the (N, E) scores, the gates (and
    their sum for k = 2), the auxiliary loss's (b, E) products and six scalars (float32 at
    least); the permutations' int64 rows (2 more under ep); under 16 bits the router's weight cast."""
    moe, N, h, t = shape.moe, shape.tokens, shape.n_embd, shape.tp
    dtype = np.dtype(shape.dtype)
    e, f = dtype.itemsize, precision.accumulation_dtype(dtype).itemsize
    low, k, E = precision.is_low(dtype), moe.top_k, moe.experts
    sigma = 1 / t if shape.sequence_parallel else 1
    kept = (rows - N) * 8 * h * e / t
    kept += sigma * N * h * f - N * h * e + rows * h * e
    kept += N * k * h * e
    kept += (3 * N * E + N * (k + (1 if k > 1 else 0)) + 2 * shape.rows * E + 6) * f
    kept += INDEX_BYTES * ((3 + (2 if moe.ep > 1 else 0)) * rows + N * k)
    return kept + (h * E * f if low else 0)

