"""What one layer of a model costs, per micro-batch: work by op family, activations kept, messages.

The planner's inventory of hpcpar's GPT (``nn/gpt.py``) and digits CNN (``nn/cnn.py``), counted
from their code, not measured: so it extends to models one cannot build here (a 70 B GPT).

Work is per op family: ``gemm`` and ``attention`` in FLOPs, the elementwise families
(``machine.FAMILIES``) in bytes moved (``strided_runs``, ``pool_rows``: in runs walked), ``ops`` the
number of autograd ops (each pays the machine's fixed ``op_overhead_s``). Backward is split into ``B`` (gradients of the inputs) and
``W`` (gradients of the weights: the part a zero-bubble schedule defers).

Notation, per micro-batch: b rows of s tokens (N = b s tokens; b s / C on a rank of C
context-parallel ones), width h, a heads, vocabulary V, t tensor-parallel ranks, r = N / t
tokens outside the sharded regions under sequence parallelism (else N), d bytes per element of
the compute dtype. Ring attention's transfers are a block's ``Ring``. (An MoE block: ``moe``; the
model's layers in order: ``inventory``.)
"""
from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field

from ..nn.activation_memory import block_kept_bytes, embedding_kept_bytes, head_kept_bytes, keeps_input, local_length
from ..nn.gpt import RECOMPUTE
from ..optim import PRECISIONS

# Element accesses (reads + writes) per element of each elementwise family, forward and
# backward, counted from the ops' code (autograd/ops): what a pass over memory costs.
# ``hpcpar plan calibrate`` times the same ops and divides by these, so on a calibrated
# machine they only need to scale right with size; on a hand-written one they meet the bandwidth.
PASSES = {"layernorm": (6, 8), "gelu": (8, 14), "softmax": (8, 6), "cross_entropy": (10, 4),
          "copy": (3, 2), "embedding": (2, 3), "optimizer": (14, 0), "pool": (3, 3),
          "im2col": (2, 3)}  # over a convolution's columns: copied in forward; written and folded back in backward


def passes(family: str, elements: float, dtype_bytes: int, backward: bool = False) -> float:
    """Bytes an elementwise family moves over ``elements`` elements in one direction."""
    return PASSES[family][1 if backward else 0] * elements * dtype_bytes


@dataclass
class Work:
    """Work of one pass: units per family (FLOPs for gemm/attention, bytes otherwise) and op count."""

    units: Counter = field(default_factory=Counter)
    ops: int = 0

    def add(self, family: str, units: float) -> "Work":
        self.units[family] += units
        return self

    def __add__(self, other: "Work") -> "Work":
        return Work(self.units + other.units, self.ops + other.ops)

    def scaled(self, k: float) -> "Work":
        return Work(Counter({f: u * k for f, u in self.units.items()}), round(self.ops * k))


@dataclass(frozen=True)
class Ring:
    """Ring attention in one block (``autograd.ops.ring_attention``), per micro-batch and cp rank.

    Forward sends this rank's K/V block (k and v stacked, the compute dtype) C - 1 times around
    the ring; backward sends the blocks C - 1 times again and a dK/dV accumulator (float32,
    float64 for fp64) C times; each send has its receive. Ring step 0 computes 3 chunk pairs (the
    rank's own block: two diagonals and one whole pair), the others 2: 2C + 1 in all."""

    ranks: int  # C
    kv_bytes: float  # one K/V block
    grad_bytes: float  # one dK/dV accumulator
    pair_forward: Work  # one c x c chunk pair's attention work (c = s / 2C)
    pair_backward: Work

    @staticmethod
    def pairs(step: int) -> int:
        return 3 if step == 0 else 2

    def calls(self, backward: bool = False) -> list:
        """[(op, bytes)] of one attention call's forward (or backward) on the cp communicator."""
        sends = [self.kv_bytes] * (self.ranks - 1) + ([self.grad_bytes] * self.ranks if backward else [])
        return [(op, n) for n in sends for op in ("isend", "irecv")]


@dataclass
class Layer:
    """One entry of the model's ``layers()`` (what a pipeline cuts), for one micro-batch."""

    name: str
    params: list  # [(parameter name, elements on this tp rank, on sequence slices under sp)]
    forward: Work
    backward_input: Work  # B
    backward_weight: Work  # W
    saved_bytes: float  # activations kept from forward to backward (per tp rank)
    workspace_bytes: float  # the largest temporary of its backward, on top of what is kept
    output_elements: float  # what the next stage receives (per tp rank)
    tp_forward: list = field(default_factory=list)  # [(op, bytes given)] on the tp communicator
    tp_backward: list = field(default_factory=list)
    kept_by_recompute: dict = field(default_factory=dict)  # recomputation mode -> saved bytes (blocks)
    keeps_input: dict = field(default_factory=dict)  # recomputation mode -> whether those bytes count its input (unlisted: yes)
    # [(its kept bytes freed by then, temporaries)] as its backward goes; none listed: [(0, workspace_bytes)]
    backward_steps: list = field(default_factory=list)
    forward_temporaries: float = 0.0  # the largest of its forward beyond what it keeps
    keeps_output: bool = True  # whether its kept bytes (or a view of them) hold its output
    ring: Ring | None = None  # a block's ring attention under context parallelism
    ep_forward: list = field(default_factory=list)  # [(op, bytes given)] on the ep communicator (an MoE block's)
    ep_backward: list = field(default_factory=list)
    expert_params: frozenset = frozenset()  # names of its expert-parallel parameters (an MoE block's experts)


@dataclass(frozen=True)
class Experts:
    """A GPT's Mixture of Experts (``[model.moe]``, ``nn.moe``) and its expert parallelism."""

    experts: int  # E, per MoE block
    top_k: int = 2
    capacity_factor: float | None = None  # None: dropless
    every: int = 1  # blocks every - 1, 2 every - 1, ... have experts
    ep: int = 1  # ranks each block's experts are split over

    @property
    def local(self) -> int:
        """The experts a rank holds."""
        return self.experts // self.ep

    def is_moe_block(self, index: int) -> bool:
        return (index + 1) % self.every == 0

    def assignments(self, rows: int, seq: int) -> int:
        """A: the (token, expert) rows a rank keeps per micro-batch of ``rows`` sequences of ``seq`` tokens
        under uniform routing, each expert taking seq k / E of a sequence but at most its capacity
        ceil(seq k cf / E) (``MoEConfig.capacity``): rows min(seq k, E capacity); dropless rows seq k."""
        wanted = seq * self.top_k
        if self.capacity_factor is None:
            return rows * wanted
        return rows * min(wanted, self.experts * math.ceil(wanted * self.capacity_factor / self.experts))


@dataclass(frozen=True)
class Shape:
    """The model and micro-batch a layer inventory is for."""

    kind: str  # gpt | cnn
    rows: int  # b: rows per micro-batch on one dp replica
    precision: str  # fp32 | bf16 | fp16 | fp64
    tp: int = 1
    sequence_parallel: bool = False
    block_size: int = 0  # s: the whole sequence (a cp rank holds ``tokens`` of it)
    n_layer: int = 0
    n_head: int = 0
    n_embd: int = 0
    vocab_size: int = 0
    bias: bool = True
    tie_weights: bool = True
    channels: tuple = (16, 32)
    attn_dropout: float = 0.0
    cp: int = 1  # context-parallel ranks splitting each sequence
    moe: Experts | None = None  # Mixture of Experts in some blocks (None: a dense GPT)

    @property
    def tokens(self) -> int:
        """N: the tokens of a micro-batch on one rank (its cp chunks of each sequence)."""
        return self.rows * local_length(self.block_size, self.cp)

    @property
    def dtype_bytes(self) -> int:
        return PRECISIONS[self.precision].itemsize

    @property
    def dtype(self):
        """The compute dtype (NumPy's, ml_dtypes' bfloat16): the activation formulas are per dtype."""
        return PRECISIONS[self.precision].compute_dtype


def shape_of(job, rows: int, tp: int | None = None, ep: int | None = None) -> Shape:
    m, p, e = job.model, job.parallel, job.moe
    t = p.tp if tp is None else tp
    moe = None
    if m.kind == "gpt" and e.experts:
        moe = Experts(e.experts, e.top_k, e.capacity_factor, e.every, p.ep if ep is None else ep)
    return Shape(kind=m.kind, rows=rows, precision=job.precision.name, tp=t,
                 sequence_parallel=bool(p.sequence_parallel and t > 1), block_size=m.block_size, n_layer=m.n_layer,
                 n_head=m.n_head, n_embd=m.n_embd, vocab_size=m.vocab_size, bias=m.bias, tie_weights=m.tie_weights,
                 channels=tuple(m.channels), attn_dropout=m.dropout, cp=p.cp, moe=moe)


# ---------------------------------------------------------------------------------------------
# GPT
def tp_entering(shape: Shape, elements: float) -> tuple[list, list]:
    """Communication entering a column-parallel layer with ``elements`` = N h (forward, backward)."""
    t, d = shape.tp, shape.dtype_bytes
    if t == 1:
        return [], []
    if shape.sequence_parallel:  # all-gather the slices forward, reduce-scatter the gradient backward
        return [("allgather", elements / t * d)], [("reduce_scatter", elements * d)]
    return [], [("allreduce", elements * d)]


def tp_leaving(shape: Shape, elements: float) -> tuple[list, list]:
    """Communication leaving a row-parallel layer (partial sums of N h): forward, backward."""
    t, d = shape.tp, shape.dtype_bytes
    if t == 1:
        return [], []
    if shape.sequence_parallel:
        return [("reduce_scatter", elements * d)], [("allgather", elements / t * d)]
    return [("allreduce", elements * d)], []


def gpt_embedding(shape: Shape) -> Layer:
    N, h, V, t, d = shape.tokens, shape.n_embd, shape.vocab_size, shape.tp, shape.dtype_bytes
    r = N / t if shape.sequence_parallel else N
    fwd = Work(ops=4).add("embedding", 2 * N * h * d).add("copy", 3 * r * h * d)
    bwd = Work(ops=4).add("embedding", (2 * V / t * h + 3 * N * h) * d).add("copy", 2 * r * h * d)
    tp_f, tp_b = tp_leaving(shape, N * h)
    return Layer("embed", [("embed.wte.weight", V // t * h, False), ("embed.wpe.weight", shape.block_size * h, True)],
                 fwd, bwd, Work(), saved_bytes=embedding_kept_bytes(shape.rows, shape.block_size, h, dtype=shape.dtype, tp=t,
                                                            sequence_parallel=shape.sequence_parallel, cp=shape.cp),
                 workspace_bytes=(V / t * h + 2 * N * h) * d,  # the table's gradient, the rows' gradients
                 output_elements=r * h,
                 tp_forward=tp_f, tp_backward=tp_b)


def gpt_block(shape: Shape, index: int) -> Layer:
    b, s, h, a, t, d = shape.rows, shape.block_size, shape.n_embd, shape.n_head, shape.tp, shape.dtype_bytes
    N = shape.tokens
    r = N / t if shape.sequence_parallel else N
    c = max(d, 4)  # scores and softmax are float32 at least (the accumulation dtype: float64 for fp64)
    scores = score_elements(shape)
    gemm = 2 * N * h * 12 * h / t  # qkv 3h, proj h, fc 4h, proj 4h
    attention = 4 * scores * h / a  # q k^T and p v over the scores computed
    ring = shape.cp > 1  # its backward recomputes each pair's q k^T and softmax: 5 products, not 4
    fwd = (Work(ops=21).add("gemm", gemm).add("attention", attention).add("softmax", passes("softmax", scores, c))
           .add("layernorm", passes("layernorm", 2 * r * h, d)).add("gelu", passes("gelu", 4 * N * h / t, d))
           .add("copy", (18 * N * h / t + 4 * N * h + 6 * r * h) * d))
    bwd_input = (Work(ops=21).add("gemm", gemm).add("attention", (2.5 if ring else 2) * attention)
                 .add("softmax", passes("softmax", scores, c, True) + (passes("softmax", scores, c) if ring else 0))
                 .add("layernorm", passes("layernorm", 2 * r * h, d, True)).add("gelu", passes("gelu", 4 * N * h / t, d, True))
                 .add("copy", 1.5 * (18 * N * h / t + 4 * N * h + 6 * r * h) * d))
    bwd_weight = Work(ops=4).add("gemm", gemm).add("copy", N * 9 * h / t * d)  # bias gradients: sums over tokens
    # Kept for backward: the exact count of what the graph holds (nn.activation_memory), per mode
    kept = {mode: block_kept_bytes(b, s, h, a, dtype=shape.dtype, tp=t, sequence_parallel=shape.sequence_parallel,
                                   recompute=mode, dropout=shape.attn_dropout, cp=shape.cp) for mode in RECOMPUTE}
    # backward temporaries on top of what is kept: attention's two (T, T) arrays (the ring's, below),
    # GELU's, the gradient in flight (2 N h)
    gelu = gelu_workspace(shape, N)
    workspace = (_ring_workspace(shape) if ring else 2 * scores * c) + gelu + 2 * N * h * d
    # Backward frees as it goes: GELU's temporaries come after the MLP projection has released its
    # input (the GELU output, 4 N h / t); attention's after GELU has released the fc output
    # (4 N h / t). The projection's own temporaries, before either, are smaller than GELU's.
    steps = [(4 * N * h / t * d, gelu + 2 * N * h * d), (8 * N * h / t * d, workspace)]
    tp_f, tp_b = [], []
    for entering in (tp_entering, tp_leaving, tp_entering, tp_leaving):  # attention in and out, MLP in and out
        f, bk = entering(shape, N * h)
        tp_f += f
        tp_b += bk
    names = [("ln_1.weight", h, True), ("ln_1.bias", h, True), ("attn.qkv.weight", h * 3 * h // t, False),
             ("attn.qkv.bias", 3 * h // t, False), ("attn.proj.weight", h // t * h, False), ("attn.proj.bias", h, True),
             ("ln_2.weight", h, True), ("ln_2.bias", h, True), ("mlp.fc.weight", h * 4 * h // t, False),
             ("mlp.fc.bias", 4 * h // t, False), ("mlp.proj.weight", 4 * h // t * h, False), ("mlp.proj.bias", h, True)]
    if not shape.bias:
        names = [n for n in names if not n[0].endswith("bias")]
    return Layer(f"blocks.{index}", [(f"blocks.{index}.{n}", e, sp) for n, e, sp in names], fwd, bwd_input, bwd_weight,
                 saved_bytes=kept["none"], workspace_bytes=workspace, output_elements=r * h, tp_forward=tp_f,
                 tp_backward=tp_b, kept_by_recompute=kept,
                 keeps_input={mode: keeps_input(shape.dtype, mode) for mode in RECOMPUTE}, backward_steps=steps,
                 ring=gpt_ring(shape, fwd, bwd_input) if ring else None)


def gelu_workspace(shape: Shape, rows: float) -> float:
    """GELU's backward temporaries over ``rows`` rows of 4 h / t: its incoming gradient, g and 1 - t^2
    in float32, and under 16 bits the input's float32 copy and the tanh it recomputes."""
    h, t, d = shape.n_embd, shape.tp, shape.dtype_bytes
    c = max(d, 4)
    return 4 * rows * h / t * (d + (4 if c > d else 2) * c)


def score_elements(shape: Shape) -> float:
    """Elements of the attention scores a rank computes per micro-batch: b (a/t) s^2 for the whole
    causal matrix (masked, not skipped); under cp > 1 ring attention's 2C + 1 chunk pairs of
    c x c (c = s / 2C) per row and head, of the 4C^2 the rank's rows meet."""
    b, s, heads, C = shape.rows, shape.block_size, shape.n_head / shape.tp, shape.cp
    if C == 1:
        return b * heads * s * s
    c = local_length(s, C) / 2
    return b * heads * (2 * C + 1) * c * c


def gpt_ring(shape: Shape, forward: Work, backward: Work) -> Ring:
    """A block's ring: its transfers, and the attention work of one chunk pair (1 / (2C + 1) of the block's)."""
    pairs = 2 * shape.cp + 1
    attention = ("attention", "softmax")
    share = [Work(Counter({f: u / pairs for f, u in work.units.items() if f in attention})) for work in (forward, backward)]
    kv = 2 * shape.tokens * shape.n_embd / shape.tp  # k and v of this rank's heads and positions
    return Ring(shape.cp, kv * shape.dtype_bytes, kv * max(shape.dtype_bytes, 4), *share)


def _ring_workspace(shape: Shape) -> float:
    """Ring attention's backward temporaries: one chunk pair's probabilities and score gradient (c x
    c, in the accumulation dtype), the K/V block held and the one arriving, and in that dtype the
    dK/dV accumulator filling, the one being sent and the one arriving, and q's gradient."""
    acc, kv = max(shape.dtype_bytes, 4), 2 * shape.tokens * shape.n_embd / shape.tp
    c = local_length(shape.block_size, shape.cp) / 2
    return 2 * shape.rows * shape.n_head / shape.tp * c * c * acc + 2 * kv * shape.dtype_bytes + (3 * kv + kv / 2) * acc


def gpt_head(shape: Shape) -> Layer:
    """Final LayerNorm, the lm head (tied: x @ wte^T) and the loss (vocab-parallel under tp)."""
    b, s, h, V, t, d = shape.rows, shape.block_size, shape.n_embd, shape.vocab_size, shape.tp, shape.dtype_bytes
    N = shape.tokens
    r = N / t if shape.sequence_parallel else N
    c = max(d, 4)  # the loss is computed in float32 at least
    gemm = 2 * N * h * V / t
    fwd = (Work(ops=6).add("gemm", gemm).add("layernorm", passes("layernorm", r * h, d))
           .add("cross_entropy", passes("cross_entropy", N * V / t, c)))
    bwd_input = (Work(ops=6).add("gemm", gemm).add("layernorm", passes("layernorm", r * h, d, True))
                 .add("cross_entropy", passes("cross_entropy", N * V / t, c, True)))
    bwd_weight = Work(ops=1).add("gemm", gemm)
    saved = head_kept_bytes(b, s, h, V, dtype=shape.dtype, tp=t, sequence_parallel=shape.sequence_parallel, cp=shape.cp)
    tp_f, tp_b = tp_entering(shape, N * h)
    if t > 1:  # vocab-parallel cross entropy: all-reduce of the row maxima, then of (sum of exp, target logit)
        tp_f = tp_f + [("allreduce", N * c), ("allreduce", 2 * N * c)]
    params = [("head.ln_f.weight", h, True)] + ([("head.ln_f.bias", h, True)] if shape.bias else [])
    params += [("embed.wte.weight", V // t * h, False)] if shape.tie_weights else [("head.lm_head.weight", h * V // t, False)]
    return Layer("head", params, fwd, bwd_input, bwd_weight, saved_bytes=saved,
                 workspace_bytes=N * V / t * c + N * h * d, output_elements=0, tp_forward=tp_f, tp_backward=tp_b,
                 keeps_input=dict.fromkeys(RECOMPUTE, keeps_input(shape.dtype)),  # the head is never recomputed
                 # the loss's forward: the logits, their float32 copy under 16 bits, shifted and exponentiated
                 forward_temporaries=N * V / t * (d + (c if c > d else 0) + 2 * c))


def conv_runs(rows: int, channels: int, side: int) -> int:
    """Contiguous runs im2col copies for a padded 3 x 3 convolution of (rows, channels, side, side)
    images (and its fold adds back): one run of ``side`` elements per image, channel, tap and
    output row. Short runs cost more than their bytes (the ``strided_runs`` family)."""
    return 9 * channels * rows * side


def pool_rows(rows: int, channels: int, side: int) -> int:
    """Strided rows 2 x 2 max pooling of (rows, channels, side, side) images walks, each way: one
    per image, channel, tap of the window and output row (the ``pool_rows`` family)."""
    return 4 * channels * rows * (side // 2)


def ufunc_buffers(elements: float, itemsize: int) -> float:
    """Bytes a NumPy ufunc over strided views (an in-place add into a tap) allocates for its buffered
    loop: up to 8192 elements (NumPy's buffer size) for each of its three operands."""
    return 3 * min(elements, 8192) * itemsize


# ---------------------------------------------------------------------------------------------
# The digits CNN: (N, 1, 8, 8) -> conv 3x3 -> relu -> pool 2 -> conv 3x3 -> relu -> pool 2 -> linear
def cnn_layers(shape: Shape) -> list[Layer]:
    n, d = shape.rows, shape.dtype_bytes
    c1, c2 = shape.channels
    out = []
    for i, (cin, cout, side) in enumerate([(1, c1, 8), (c1, c2, 4)]):  # (in, out, side)
        out += cnn_conv_stage(shape, i, cin, cout, side)
    features = 4 * c2
    out.append(Layer("net.6", [], Work(ops=1), Work(ops=1), Work(), 0.0, 0.0, n * features))
    out.append(Layer("net.7", [("net.7.weight", features * 10, False), ("net.7.bias", 10, False)],
                     Work(ops=3).add("gemm", 2 * n * features * 10).add("cross_entropy", passes("cross_entropy", n * 10, max(d, 4))),
                     Work(ops=3).add("gemm", 2 * n * features * 10).add("cross_entropy", passes("cross_entropy", n * 10, max(d, 4), True)),
                     Work(ops=1).add("gemm", 2 * n * features * 10), saved_bytes=(n * features + n * 10) * d,
                     workspace_bytes=n * 10 * d, output_elements=0))
    return out


def cnn_conv_stage(shape: Shape, i: int, cin: int, cout: int, side: int) -> list[Layer]:
    """The CNN's ``i``-th convolution (``cin`` -> ``cout`` channels on ``side`` x ``side`` images),
    its ReLU and its 2 x 2 max pooling: layers ``net.3i`` to ``net.3i+2``."""
    n, d = shape.rows, shape.dtype_bytes
    c = max(d, 4)  # float32 at least: conv's input-gradient columns, max pooling's fold
    wide = 4 if d < 4 else 0  # under 16 bits NumPy's matmul multiplies float32 copies of its operands
    not_input = dict.fromkeys(RECOMPUTE, False)  # these keep no input of theirs: a stage's received input counts
    out = []
    pixels = n * side * side
    flops = 2 * pixels * cin * 9 * cout  # one product each way
    cols = pixels * cin * 9  # im2col
    padded = n * cin * (side + 2) ** 2
    runs = conv_runs(n, cin, side)
    forward = (Work(ops=1).add("conv", flops).add("im2col", passes("im2col", cols, d)).add("strided_runs", runs)
               .add("copy", 2 * pixels * cout * d))
    # the images need no gradient: the first convolution computes only its weights'
    backward = Work(ops=1).add("copy", 2 * pixels * cout * d)
    if i > 0:
        (backward.add("conv", flops).add("im2col", passes("im2col", cols, d, True)).add("strided_runs", runs)
         .add("copy", 2 * pixels * cin * d))
    # Alive in backward beside the kept columns: the incoming gradient and its (Cout, N Ho Wo)
    # copy; the columns' gradient (float32) to the end, with the padded fold (its strided adds
    # buffered) and then the input gradient; last the weight gradient's product of float32
    # copies (under 16 bits; the transposed columns are cast through NumPy's buffers as well).
    grads = 2 * pixels * cout * d
    weight_gemm = (pixels * cout + cols) * wide + (min(cols, 8192) * (d + wide) if wide else 0)
    fold = padded * c + max(ufunc_buffers(pixels * cin, c), pixels * cin * c)
    input_grad = cols * c + max(fold, pixels * cout * wide) if i > 0 else 0
    last = grads + (cols + pixels * cin) * c * (i > 0) + weight_gemm
    out.append(Layer(f"net.{3 * i}", [(f"net.{3 * i}.weight", cout * cin * 9, False), (f"net.{3 * i}.bias", cout, False)],
                     forward, backward, Work().add("conv", flops),
                     # the columns; its input is the pooling's output (the images for the first, which
                     # are float32: in another precision the first op casts them, and keeps that copy)
                     saved_bytes=cols * d + (n * 64 * d if i == 0 and d != 4 else 0),
                     output_elements=pixels * cout, keeps_input=not_input, keeps_output=False,
                     workspace_bytes=max(grads + input_grad, last),
                     # the padded input to the end; the product (of float32 copies under 16 bits,
                     # rounded to a copy) and then the output's transposed copy
                     forward_temporaries=padded * d + (cols * wide + pixels * cout * (wide + d) if wide
                                                       else 2 * pixels * cout * d)))
    out.append(Layer(f"net.{3 * i + 1}", [], Work(ops=1).add("copy", 3 * pixels * cout * d),
                     Work(ops=1).add("copy", 4 * pixels * cout * d), Work(), saved_bytes=pixels * cout * d,
                     # the incoming gradient, the mask, the product
                     workspace_bytes=pixels * cout * (2 * d + 1), output_elements=pixels * cout, keeps_input=not_input))
    pooled = pool_rows(n, cout, side)
    out.append(Layer(f"net.{3 * i + 2}", [],
                     Work(ops=1).add("pool", passes("pool", pixels * cout, d)).add("pool_rows", pooled),
                     Work(ops=1).add("pool", passes("pool", pixels * cout, d, True)).add("pool_rows", pooled), Work(),
                     # its output; its input is the ReLU's output, kept there
                     saved_bytes=pixels * cout / 4 * d, keeps_input=not_input, output_elements=pixels * cout / 4,
                     # the fold (float32 at least) rounded to a copy; the incoming gradient, a tap's
                     # masks and gradient beside it, its strided add buffered
                     workspace_bytes=pixels * cout * (c + (d if d < c else 0)) + pixels * cout / 4 * (2 * d + 2)
                     + ufunc_buffers(pixels * cout / 4, c),
                     forward_temporaries=ufunc_buffers(pixels * cout / 4, d)))  # each tap's strided maximum
    return out


def korthikanti_bytes(shape: Shape) -> float:
    """Activation bytes per transformer layer by Korthikanti et al. (2022), 16-bit values and 1-byte
    dropout masks: s b h (34 + 5 a s / h) without tensor parallelism; (10 + 24 / t + 5 a s / (h t))
    with it; everything / t with sequence parallelism as well."""
    s, b, h, a, t = shape.block_size, shape.rows, shape.n_embd, shape.n_head, shape.tp
    if t == 1:
        return s * b * h * (34 + 5 * a * s / h)
    if shape.sequence_parallel:
        return s * b * h * (34 + 5 * a * s / h) / t
    return s * b * h * (10 + 24 / t + 5 * a * s / (h * t))


def activation_ratio(shape: Shape) -> float:
    """hpcpar's kept bytes per block over Korthikanti's formula (docs/planner.md states it)."""
    return gpt_block(shape, 0).saved_bytes / korthikanti_bytes(shape)
