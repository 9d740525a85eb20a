"""A GPT-2 style decoder (pre-norm blocks), split into layers a pipeline can cut.

``GPT.layers()`` is ``[embedding stage, block 0, ..., block n-1, head]``; applying them in
turn is ``forward``. Parameter names (``embed.wte.weight``, ``blocks.3.attn.qkv.weight``,
``head.ln_f.weight`` ...) are the keys of the state dict and of the initialisation streams.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy as np

from ..autograd import Tensor, no_grad
from ..autograd import ops
from ..autograd.recompute import recompute
from ..autograd.ops import mappings
from ..autograd.ops.ring_attention import ring_attention
from ..autograd.ops.sequence_chunks import ChunkLayout, SequencePlace
from ..backend import array_module, resolve_device, to_device, to_host
from . import init, tensor_parallel
from .dropout_keys import DropoutKey, active_dropout_key, dropout_key, replay_dropout_key
from .layers import Dropout, Embedding, HeadDropout, LayerNorm, Linear
from .module import Module, ModuleList
from .moe import MoE, MoEConfig

RECOMPUTE = ("none", "selective", "full")  # activation recomputation (GPT.recompute)


@dataclass
class GPTConfig:
    vocab_size: int = 256
    block_size: int = 128  # the longest context
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 256
    dropout: float = 0.0  # embeddings and residual branches
    attn_dropout: float | None = None  # attention probabilities; None: the same as dropout (as in GPT-2)
    bias: bool = True  # biases in Linear and LayerNorm
    tie_weights: bool = True  # the lm head reuses the token embedding
    seed: int = 0  # parameter initialisation and the dropout masks
    moe: MoEConfig | None = None  # Mixture-of-Experts MLPs in some blocks (``nn.moe``); None: dense

    def __post_init__(self):
        if isinstance(self.moe, dict):  # as a checkpoint's model_config keeps it
            self.moe = MoEConfig(**self.moe)
        for field in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd"):
            value = getattr(self, field)
            if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 1:
                raise ValueError(f"GPTConfig.{field} must be a positive integer, got {value!r}")
        if self.n_embd % self.n_head:
            raise ValueError(f"GPTConfig.n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head}); "
                             f"the head size would be {self.n_embd / self.n_head:g}")
        if self.attn_dropout is None:
            self.attn_dropout = self.dropout
        for field in ("dropout", "attn_dropout"):
            if not 0.0 <= getattr(self, field) < 1.0:
                raise ValueError(f"GPTConfig.{field} must be in [0, 1), got {getattr(self, field)}")

    def to_dict(self) -> dict:
        return asdict(self)


class GPTEmbedding(Module):
    """ids (B, T) -> token + position embeddings (B, T, C), then dropout."""

    def __init__(self, config: GPTConfig, dtype, xp, tp=None):
        super().__init__()
        self.block_size = config.block_size
        self.wte = tensor_parallel.VocabParallelEmbedding(config.vocab_size, config.n_embd, tp, dtype, xp)
        self.wpe = Embedding(config.block_size, config.n_embd, dtype, xp)
        self.drop = Dropout(config.dropout)
        self.chunks = ChunkLayout()  # context parallelism: which chunks of each sequence this rank takes

    def forward(self, ids):
        """ids (B, T), whole sequences on every rank: this rank's cp chunks are taken here."""
        ids = ids.data if isinstance(ids, Tensor) else ids
        T = ids.shape[1]
        if T > self.block_size:
            raise ValueError(f"sequence length {T} exceeds the context block_size {self.block_size}")
        tokens = self.wte(self.chunks.take(ids))  # (B, T/cp, C), or (B, T/cp/tp, C) with sequence parallelism
        xp = self.wpe.weight.xp  # the positions of the residual stream here, which its dropout draws by too
        positions = xp.concatenate([xp.arange(run.start, run.stop) for run in self.drop.place.ranges(tokens.shape[1])])
        return self.drop(tokens + self.wpe(positions))  # (B, T', C) + (T', C): global positions


class CausalSelfAttention(Module):
    """Heads split across the tp group: qkv is column-parallel, the output projection row-parallel.

    qkv's columns are laid out head by head, ``[q_0 k_0 v_0 | q_1 k_1 v_1 | ...]`` (as Megatron
    does), so a contiguous block of columns is a set of whole heads and tensor parallelism is
    just a column split of the same weight. Attention dropout is this sharded region's dropout:
    each head draws its own mask (``HeadDropout``).
    """

    def __init__(self, config: GPTConfig, dtype, xp, tp=None):
        super().__init__()
        start, stop = mappings.shard_range(config.n_head, tp, "n_head")
        self.local_heads = stop - start
        self.attn_drop = HeadDropout(config.attn_dropout, range(start, stop))
        self.head_size = config.n_embd // config.n_head
        self.qkv = tensor_parallel.ColumnParallelLinear(config.n_embd, 3 * config.n_embd, tp, config.bias, dtype=dtype, xp=xp)
        self.proj = tensor_parallel.RowParallelLinear(config.n_embd, config.n_embd, tp, config.bias, dtype=dtype, xp=xp)
        self.drop = Dropout(config.dropout)
        self.recompute_core = False  # selective recomputation (GPT.recompute)
        object.__setattr__(self, "cp", None)  # the cp communicator when context parallelism is on

    def forward(self, x):
        nh, hs = self.local_heads, self.head_size
        qkv = self.qkv(x)  # (B, T, 3 nh hs): the whole sequence, gathered under sequence parallelism
        B, T = qkv.shape[:2]
        qkv = ops.reshape(qkv, (B, T, nh, 3, hs))  # (B, T, 3 nh hs) -> (B, T, nh, 3, hs)
        qkv = ops.transpose(qkv, (3, 0, 2, 1, 4))  # -> (3, B, nh, T, hs)
        q, k, v = (ops.reshape(t, (B, nh, T, hs)) for t in ops.split(qkv, 3, axis=0))  # each (B, nh, T, hs)
        if self.recompute_core:  # keep q, k, v only: probabilities and dropout masks are redone in backward
            y = recompute(self.core, q, k, v, context=replay_dropout_key())
        else:
            y = self.core(q, k, v)  # (B, nh, T, hs)
        y = ops.reshape(ops.transpose(y, (0, 2, 1, 3)), (B, T, nh * hs))  # -> (B, T, nh, hs) -> (B, T, nh hs)
        return self.drop(self.proj(y))

    def core(self, q, k, v):
        """Attention's dropout masks, softmax and products: what selective recomputation reruns. It
        has no communication (the heads are local) but context parallelism's ring, and its
        (B, nh, T, T) arrays are most of a block's activation memory at long sequences
        (Korthikanti et al. 2022); the ring keeps none of them."""
        B, _, T, _ = q.shape
        keep = self.attn_drop.drawer(B, T, q.dtype, q.xp)  # None unless training with attn_dropout > 0
        if self.cp is not None:  # this rank's chunks against the whole sequence, around the cp ring (which keeps them)
            return ring_attention(q, k, v, self.cp, self.attn_drop.chunks, keep=None if keep is None else keep())
        return ops.attention(q, k, v, causal=True, draw_keep=keep)  # drawn in forward and again in backward


class MLP(Module):
    """Hidden units split across the tp group: fc column-parallel, proj row-parallel."""

    def __init__(self, config: GPTConfig, dtype, xp, tp=None):
        super().__init__()
        self.fc = tensor_parallel.ColumnParallelLinear(config.n_embd, 4 * config.n_embd, tp, config.bias, dtype=dtype, xp=xp)
        self.proj = tensor_parallel.RowParallelLinear(4 * config.n_embd, config.n_embd, tp, config.bias, dtype=dtype, xp=xp)
        self.drop = Dropout(config.dropout)

    def forward(self, x):
        return self.drop(self.proj(ops.gelu(self.fc(x))))


class Block(Module):
    """Pre-norm transformer block: x + attn(ln_1(x)), then + mlp(ln_2(x)); block ``index``'s MLP is
    a Mixture of Experts where the config says (``MoEConfig.is_moe_block``)."""

    def __init__(self, config: GPTConfig, dtype, xp, tp=None, ep=None, index: int = 0):
        super().__init__()
        self.ln_1 = LayerNorm(config.n_embd, bias=config.bias, dtype=dtype, xp=xp)
        self.attn = CausalSelfAttention(config, dtype, xp, tp)
        self.ln_2 = LayerNorm(config.n_embd, bias=config.bias, dtype=dtype, xp=xp)
        if config.moe is not None and config.moe.is_moe_block(index):
            self.mlp = MoE(config, config.moe, dtype, xp, tp, ep)
        else:
            self.mlp = MLP(config, dtype, xp, tp)
        self.recompute_block = False  # full recomputation (GPT.recompute)

    def forward(self, x):
        if self.recompute_block:  # keep the block's input only; the whole block reruns in backward
            return recompute(self.residual, x, params=self.parameters(), context=replay_dropout_key())
        return self.residual(x)

    def residual(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPTHead(Module):
    """(B, T, C) -> final LayerNorm -> logits (B, T, V/tp); tied: logits = x @ wte.T.

    With tensor parallelism each rank computes the logits of its rows of the vocabulary only;
    the loss (``tensor_parallel.vocab_parallel_cross_entropy``) never gathers them.
    """

    def __init__(self, config: GPTConfig, dtype, xp, tied_embedding=None, tp=None):
        super().__init__()
        object.__setattr__(self, "tp", tp)
        self.sequence_parallel = False
        self.ln_f = LayerNorm(config.n_embd, bias=config.bias, dtype=dtype, xp=xp)
        self.tied = tied_embedding is not None
        if self.tied:
            self.wte = tied_embedding  # the same module: its weight is named embed.wte.weight in the GPT
        else:
            self.lm_head = tensor_parallel.ColumnParallelLinear(config.n_embd, config.vocab_size, tp, bias=False, dtype=dtype, xp=xp)

    def forward(self, x):
        x = self.ln_f(x)
        if self.tied:  # (B, T, C) @ (C, V/tp), the sequence gathered first under sequence parallelism
            x = mappings.enter_tp(x, self.tp, self.sequence_parallel)
            return ops.linear(x, ops.transpose(self.wte.weight))
        return self.lm_head(x)


class GPT(Module):
    """GPT-2: embeddings, ``n_layer`` pre-norm blocks, final LayerNorm and lm head.

    Parameters are created in ``dtype`` on ``device`` ("cpu", "cuda" or "auto") and
    initialised as GPT-2 does: N(0, 0.02), residual projections N(0, 0.02 / sqrt(2 n_layer)),
    zero biases, unit LayerNorm weights, each from its own named stream (``hpcpar.nn.init``).
    """

    def __init__(self, config: GPTConfig, dtype=np.float32, device: str = "cpu", tp=None, cp=None, ep=None):
        """``tp``, ``cp``: the tensor- and context-parallel communicators (``ctx.tp``, ``ctx.cp``);
        ``ep``: the group the MoE blocks' experts are split over (``ctx.expert_groups``); None or
        one rank each is the plain GPT."""
        super().__init__()
        self.config = config
        object.__setattr__(self, "tp", tp)
        object.__setattr__(self, "cp", cp)
        xp = array_module(resolve_device(device))
        self.embed = GPTEmbedding(config, dtype, xp, tp)
        self.blocks = ModuleList(Block(config, dtype, xp, tp, ep, index) for index in range(config.n_layer))
        self.head = GPTHead(config, dtype, xp, tied_embedding=self.embed.wte if config.tie_weights else None, tp=tp)

        linears = (Linear, tensor_parallel.ColumnParallelLinear, tensor_parallel.RowParallelLinear)
        for _, module in self.named_modules():
            if isinstance(module, linears + (Embedding, tensor_parallel.VocabParallelEmbedding)):
                module.weight.init = init.normal(0.02)
            if isinstance(module, linears) and module.bias is not None:
                module.bias.init = init.zeros
        residual_std = 0.02 / math.sqrt(2 * config.n_layer)
        for block in self.blocks:
            block.attn.proj.weight.init = init.normal(residual_std)
            block.mlp.proj.weight.init = init.normal(residual_std)
        init.initialize(self, config.seed)
        dropouts = [m for _, m in self.named_modules() if isinstance(m, (Dropout, HeadDropout))]
        for site, module in enumerate(dropouts):  # numbered in module order: the same in every layout
            module.seed, module.site = config.seed, site
        self.has_dropout = any(m.p > 0 for m in dropouts)
        self.unkeyed_forwards = 0  # training forwards run without a dropout key (each drew its own step's masks)
        object.__setattr__(self, "_context_parallel", cp is not None and cp.size > 1)
        self.sequence_parallel = False
        self.recompute = "none"

    @property
    def context_parallel(self) -> bool:
        """Whether each sequence is split over the cp ranks (on when ``cp`` has several).

        Rank i of the cp group takes chunks i and 2C-1-i of every sequence (``sequence_chunks``)
        at the embedding, with their global positions; attention is ``ring_attention`` over the
        group; dropout masks are drawn by global position; the loss is the mean over this rank's
        tokens, so the mean over cp (and dp) of the ranks' losses and gradients is one process's.
        Sequences must divide by 2C. ``generate`` switches it off (contexts of any length)."""
        return self._context_parallel

    @context_parallel.setter
    def context_parallel(self, on: bool) -> None:
        object.__setattr__(self, "_context_parallel", bool(on) and self.cp is not None and self.cp.size > 1)
        self._place_sequence()

    @property
    def chunks(self) -> ChunkLayout:
        """The chunks of each sequence this rank holds (all of it without context parallelism)."""
        return ChunkLayout.of(self.cp if self.context_parallel else None)

    def _place_sequence(self) -> None:
        """Tell the layers which positions their activations hold: cp chunks, then tp slices."""
        chunks, on = self.chunks, self.sequence_parallel
        residual = SequencePlace(chunks, self.tp.size, self.tp.rank) if on else SequencePlace(chunks)
        self.embed.chunks = chunks
        for _, module in self.named_modules():
            if isinstance(module, Dropout):  # every Dropout of the GPT acts on residual-stream activations
                module.place = residual
            if isinstance(module, HeadDropout):
                module.chunks = chunks
            if isinstance(module, CausalSelfAttention):
                object.__setattr__(module, "cp", self.cp if self.context_parallel else None)

    @property
    def sequence_parallel(self) -> bool:
        """Whether activations outside the sharded regions are split along the sequence over tp.

        Only the communication changes (reduce-scatter / all-gather instead of all-reduce), not
        the weights, so it can be switched at any time; with one tp rank it stays off. The
        replicated parameters that then see slices of the sequence are marked
        ``sequence_parallel``: engines sum their gradients over tp after backward
        (``hpcpar.parallel.sequence.sync_sequence_parallel_grads``). Sequences must divide by tp.
        """
        return self._sequence_parallel

    @sequence_parallel.setter
    def sequence_parallel(self, on: bool) -> None:
        on = bool(on) and mappings.tp_size(self.tp) > 1
        object.__setattr__(self, "_sequence_parallel", on)
        split_layers = (tensor_parallel.ColumnParallelLinear, tensor_parallel.RowParallelLinear,
                        tensor_parallel.VocabParallelEmbedding, GPTHead, MoE)  # the layers that switch communication
        for _, module in self.named_modules():
            if isinstance(module, split_layers):
                module.sequence_parallel = on
            on_slices = (list(module.parameters()) if isinstance(module, LayerNorm) else
                         [module.bias] if isinstance(module, tensor_parallel.RowParallelLinear) else
                         [module.wpe.weight] if isinstance(module, GPTEmbedding) else
                         [module.router.weight] if isinstance(module, MoE) else [])
            for param in on_slices:
                if param is not None:
                    param.sequence_parallel = on
        self._place_sequence()

    @property
    def recompute(self) -> str:
        """Activation recomputation: ``"none"``; ``"selective"``: attention's probabilities and dropout
        masks are not kept but recomputed from q and k in backward; ``"full"``: of each block only its
        input is kept and the whole block reruns in backward (re-issuing its tensor-parallel
        communication). Gradients are the same numbers in every mode (``hpcpar.autograd.recompute``);
        it can be switched at any time."""
        return self._recompute

    @recompute.setter
    def recompute(self, mode: str) -> None:
        if mode not in RECOMPUTE:
            raise ValueError(f"GPT.recompute must be one of {', '.join(RECOMPUTE)}, got {mode!r}")
        object.__setattr__(self, "_recompute", mode)
        for block in self.blocks:
            block.recompute_block = mode == "full"
            block.attn.recompute_core = mode == "selective"

    def moe_blocks(self) -> list[tuple[int, MoE]]:
        """(block index, its MoE MLP) of the blocks with experts (none in a dense GPT)."""
        return [(i, block.mlp) for i, block in enumerate(self.blocks) if isinstance(block.mlp, MoE)]

    def layers(self) -> list:
        """[embedding stage, block 0, ..., block n-1, head]: applied in turn they are ``forward``.

        With ``tie_weights`` the first and the last share ``embed.wte.weight``: a pipeline that
        puts them on different ranks must sum that parameter's gradient over the two.
        """
        return [self.embed, *self.blocks, self.head]

    def forward(self, ids) -> Tensor:
        """ids (B, T) integer array -> logits (B, T, vocab_size); (B, T/cp, V/tp): this rank's
        chunks (``context_parallel``) and vocabulary rows (tensor parallelism).

        Dropout draws the masks of the active key (``dropout_keys``: the training loop sets one
        per step). A training forward with dropout and no key takes ``DropoutKey(n)`` for its
        n-th such call, so plain loops get fresh masks per forward, reproducibly."""
        key = active_dropout_key()
        if key is None and self.training and self.has_dropout:
            key = DropoutKey(self.unkeyed_forwards)
            self.unkeyed_forwards += 1
        with dropout_key(key):
            x = ids
            for layer in self.layers():
                x = layer(x)
        return x

    def loss(self, ids, targets, ignore_index: int = -100) -> Tensor:
        """Mean next-token cross entropy of ``forward(ids)`` against ``targets`` (B, T)."""
        return self.loss_from_logits(self.forward(ids), targets, ignore_index)

    def loss_from_logits(self, logits: Tensor, targets, ignore_index: int = -100) -> Tensor:
        """The loss a pipeline's last stage applies to the head's output (B, T/cp, V/tp); ``targets``
        (B, T): whole sequences, of which this rank's cp chunks are taken."""
        targets = self.chunks.take(targets.data if isinstance(targets, Tensor) else targets)
        if mappings.tp_size(self.tp) == 1:
            return ops.cross_entropy(logits, targets, ignore_index=ignore_index)
        B, T, V = logits.shape
        # (B, T, V/tp) -> (B*T, V/tp): the vocabulary stays split, the loss is completed by all-reduce
        return tensor_parallel.vocab_parallel_cross_entropy(ops.reshape(logits, (B * T, V)), targets.reshape(B * T), self.tp,
                                            ignore_index)

    def generate(self, ids, max_new_tokens: int, temperature: float = 1.0, top_k: int | None = None, rng=None):
        """Append ``max_new_tokens`` sampled tokens to ``ids`` (B, T); returns the longer id array.

        Sampling runs on the host with ``rng`` (a NumPy Generator; default seeded from the
        config), so a seed gives the same text on CPU and GPU. ``temperature=0`` is greedy; ``top_k`` (None: every token) keeps the k likeliest.
        """
        if max_new_tokens < 0 or temperature < 0 or (top_k is not None and top_k < 1):
            raise ValueError(f"GPT.generate needs max_new_tokens >= 0, temperature >= 0 and top_k >= 1 (None: every "
                             f"token), got {max_new_tokens}, {temperature}, {top_k}")
        rng = np.random.default_rng(self.config.seed) if rng is None else rng
        xp = self.embed.wte.weight.xp
        ids = xp.asarray(ids.data if isinstance(ids, Tensor) else ids)
        was_training, was_sequence_parallel, was_context_parallel = self.training, self.sequence_parallel, \
            self.context_parallel
        self.eval()
        self.sequence_parallel = self.context_parallel = False  # contexts of any length: the whole sequence on every rank
        try:
            with no_grad():
                for _ in range(max_new_tokens):
                    context = ids[:, -self.config.block_size:]
                    logits = mappings.gather_from_tp(self.forward(context), self.tp)  # (B, T, V/tp) -> (B, T, V)
                    logits = to_host(logits.data[:, -1, :]).astype(np.float64)  # (B, V)
                    if temperature == 0:
                        next_ids = logits.argmax(axis=-1)
                    else:
                        logits /= temperature
                        if top_k is not None and top_k < logits.shape[-1]:
                            kth_largest = np.partition(logits, -top_k, axis=-1)[:, -top_k, None]
                            logits[logits < kth_largest] = -np.inf
                        cdf = np.exp(logits - logits.max(axis=-1, keepdims=True)).cumsum(axis=-1)  # unnormalised
                        next_ids = (cdf < rng.random((len(cdf), 1)) * cdf[:, -1:]).sum(axis=-1)
                    next_ids = to_device(next_ids.astype(ids.dtype)[:, None], xp)
                    ids = xp.concatenate([ids, next_ids], axis=1)
        finally:
            self.train(was_training)
            self.sequence_parallel, self.context_parallel = was_sequence_parallel, was_context_parallel
        return ids
