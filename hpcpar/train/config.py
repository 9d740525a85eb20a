"""Job files: the TOML schema of a training run, its sections and keys with their defaults, and
the ``Job`` they make (reading a file and ``--set`` overrides: config_load.py; the value types
and checks of a key: config_types.py; validation: validate.py).

A job file has the sections [model] [data] [parallel] [optimizer] [lr_schedule] [train]
[checkpoint] ([schedule], the old name of [lr_schedule], is read for one more release with a
notice); every key has a default, so an absent key or section means its defaults
(``schema_table()`` lists them all). A job that cannot run is a ``JobError`` (a ValueError)
naming the file, the key (``parallel.tp``), the numbers and the fix.

Paths (``data.path``, ``train.metrics``, ``train.trace``, ``train.tensorboard``,
``checkpoint.dir``) are relative to the current folder — where ``hpcpar train``, ``mpiexec``
or ``sbatch`` is started, as for ``hpcpar data prepare --out`` — not to the job file's folder;
``{job}`` in them becomes the job file's name without ``.toml`` (``runs/{job}/metrics.jsonl``).
"""
from __future__ import annotations

from dataclasses import dataclass, fields, make_dataclass
from typing import Any

from .. import defaults
from ..backend import DEVICES
from ..nn.gpt import RECOMPUTE
from ..optim import PRECISIONS, Precision
from ..parallel.compression import COMPRESSORS
from ..parallel.pipeline.schedules import SCHEDULES
from ..runtime.grid import GRID, Axis
from . import tensorboard
from .config_types import (BOOLEAN, INTEGER, INTEGER_PAIR, NUMBER, NUMBER_PAIR, PARTITION, RESUME, STAGE_COUNTS, STRING,
                           STRING_LIST, ZERO_STAGE, POSITIVE, Check, _key, above, applies_text, at_least, each, in_range, toml_key,
                           toml_value)

BYTE_VOCAB = 256  # token files made by ``hpcpar data prepare`` hold bytes


class JobError(ValueError):
    """A job that cannot run: ``problems`` is a list of (key, message); str() names the file."""

    def __init__(self, source: str, problems: list[tuple[str, str]]):
        self.source = source
        self.problems = list(problems)
        if len(self.problems) == 1:
            key, text = self.problems[0]
            message = f"{source}: {key}: {text}" if key else f"{source}: {text}"
        else:
            listed = "\n".join(f"  {key}: {text}" if key else f"  {text}" for key, text in self.problems)
            message = f"{source}: {len(self.problems)} problems:\n{listed}"
        super().__init__(message)


NO_DECAY = ("*.bias", "*ln_*", "embed.*")  # as GPT-2 / minGPT: no decay of shifts, norm scales, embeddings
GPT_ONLY = ("model.kind", ("gpt",))
REWIND_ONLY = ("train.on_nonfinite", ("rewind",))
NONFINITE_POLICIES = ("stop", "skip", "rewind")
TEXT_ONLY = ("data.kind", ("text",))


# --- the schema ---------------------------------------------------------------------------------------

@dataclass(frozen=True)
class ModelSection:
    kind: str = _key("gpt", STRING, "gpt (byte-level language model) or cnn (digits classifier)",
                     choices=("gpt", "cnn"))
    vocab_size: int = _key(256, INTEGER, "token ids 0..vocab_size-1", check=at_least(1), applies=GPT_ONLY)
    block_size: int = _key(128, INTEGER, "context length in tokens", check=at_least(1), applies=GPT_ONLY)
    n_layer: int = _key(4, INTEGER, "transformer blocks", check=at_least(1), applies=GPT_ONLY)
    n_head: int = _key(4, INTEGER, "attention heads", check=at_least(1), applies=GPT_ONLY)
    n_embd: int = _key(256, INTEGER, "embedding width", check=at_least(1), applies=GPT_ONLY)
    dropout: float = _key(0.0, NUMBER, "dropout probability (embeddings, residual branches, attention)",
                          check=in_range(0.0, 1.0), applies=GPT_ONLY)
    bias: bool = _key(True, BOOLEAN, "biases in Linear and LayerNorm", applies=GPT_ONLY)
    tie_weights: bool = _key(True, BOOLEAN, "the lm head reuses the token embedding", applies=GPT_ONLY)
    recompute: str = _key("none", STRING, "activation recomputation: none; selective (attention's probabilities "
                          "and dropout masks redone in backward); full (a block keeps only its input and reruns "
                          "in backward, its tp communication too)", choices=RECOMPUTE, applies=GPT_ONLY)
    channels: tuple = _key((16, 32), INTEGER_PAIR, "channels of the two convolutions", check=each(at_least(1)),
                           applies=("model.kind", ("cnn",)))
    seed: int = _key(0, INTEGER, "parameter initialisation (and the dropout masks)", check=at_least(0))


MOE_ONLY = ("moe.experts", POSITIVE)


@dataclass(frozen=True)
class MoESection:
    """``[model.moe]``: Mixture-of-Experts MLPs in the GPT (``nn.moe``); experts = 0 is the dense GPT."""
    experts: int = _key(0, INTEGER, "experts per MoE block (0: dense MLPs, no MoE)", check=at_least(0), applies=GPT_ONLY)
    top_k: int = _key(2, INTEGER, "experts each token goes to: 1 (Switch: its gate is the router probability) or 2 "
                                  "(GShard: the two gates renormalised to sum to 1)", check=in_range(1, 3), applies=MOE_ONLY)
    capacity_factor: float | None = _key(None, NUMBER, "tokens an expert takes per sequence: ceil(block_size x top_k "
                                                        "x capacity_factor / experts); the rest are dropped (first "
                                                        "choices before second, then by position); unset: dropless",
                                         check=above(0), applies=MOE_ONLY)
    every: int = _key(1, INTEGER, "an MoE MLP in every k-th block (blocks k-1, 2k-1, ...), dense MLPs in the others",
                      check=at_least(1), applies=MOE_ONLY)
    aux_loss_coef: float = _key(0.01, NUMBER, "load-balancing loss E x sum_i f_i P_i per sequence, averaged over "
                                              "the global batch's sequences, times this", check=at_least(0),
                                 applies=MOE_ONLY)
    z_loss_coef: float = _key(0.001, NUMBER, "router z-loss mean(logsumexp(logits)^2) over the tokens, times this "
                                             "(ST-MoE)", check=at_least(0), applies=MOE_ONLY)
    load_warning: float = _key(2.0, NUMBER, "warn when one expert takes more than this multiple of its even share "
                                            "(1/experts of the routed tokens) in every logged step for 50 steps or "
                                            "more", check=above(0), applies=MOE_ONLY)


@dataclass(frozen=True)
class DataSection:
    kind: str = _key("text", STRING, "text (HDF5 byte tokens, for gpt) or digits (sklearn 8x8, for cnn)",
                     choices=("text", "digits"))
    path: str = _key(defaults.TEXT_CORPUS, STRING, "HDF5 token file from `hpcpar data prepare`", applies=TEXT_ONLY)
    prepare_if_missing: bool = _key(True, BOOLEAN, f"prepare the built-in corpus (the Python standard library) when "
                                                   f"data.path is its default {defaults.TEXT_CORPUS} and absent; any "
                                                   f"other missing data.path is an error", applies=TEXT_ONLY)
    batch_size: int = _key(32, INTEGER, "global batch: samples per optimizer step, over all dp replicas",
                           check=at_least(1))
    eval_batches: int = _key(8, INTEGER, "validation batches (of batch_size windows) per evaluation",
                             check=at_least(1), applies=TEXT_ONLY)


def _size_key(axis: Axis):
    """The job key of a grid axis's size (``parallel.tp``): the fill axis's is unset by default."""
    if axis.name == GRID.fill:
        others = " x ".join(name for name in GRID.spelt if name != GRID.fill)
        return _key(None, INTEGER, f"{axis.help}; unset: world size / ({others})", check=at_least(1))
    return _key(1, INTEGER, axis.help, check=at_least(1) if axis.limit is None else in_range(1, axis.limit + 1))


# parallel.dp, parallel.pp, parallel.tp: a key per axis of the grid that can vary, first in the section
GridSizes = make_dataclass("GridSizes", [(axis.name, int | None, _size_key(axis)) for axis in GRID.axes if axis.varies],
                           frozen=True)


@dataclass(frozen=True)
class ParallelSection(GridSizes):
    schedule: str = _key(defaults.PIPELINE_SCHEDULE, STRING,
                         "pipeline schedule, with pp > 1 (zb1: ZB-H1, weight gradients deferred)",
                         choices=tuple(SCHEDULES))
    micro_batches: int = _key(defaults.MICRO_BATCHES, INTEGER,
                              "micro-batches per step of each dp replica (pipeline or accumulation)",
                              check=at_least(1))
    chunks: int = _key(defaults.CHUNKS, INTEGER, "model chunks per pipeline rank", check=at_least(1),
                       applies=("parallel.schedule", ("interleaved",)))
    partition: Any = _key("uniform", PARTITION, "how layers are cut into pp x chunks stages (pp > 1)",
                          check=STAGE_COUNTS)
    bucket_mb: float = _key(defaults.BUCKET_MB, NUMBER, "gradient all-reduce bucket size in MiB (DDP; ZeRO-1 "
                            "reduce-scatters one flat buffer, the parameter server and local SGD move whole arrays)",
                            check=above(0))
    overlap: bool = _key(True, BOOLEAN, "all-reduce buckets while backward runs (pp = 1; a pipeline reduces them "
                              "after its schedule, ZeRO-1 in its step; the parameter server and local SGD have no "
                              "buckets)")
    compression: str = _key("none", STRING, "gradient compression", choices=tuple(COMPRESSORS))
    compression_ratio: float = _key(0.01, NUMBER, "share of entries top-k sends",
                                    check=Check("in (0, 1]", lambda v: 0 < v <= 1),
                                    applies=("parallel.compression", ("topk",)))
    powersgd_rank: int = _key(4, INTEGER, "rank of PowerSGD's factors", check=at_least(1),
                              applies=("parallel.compression", ("powersgd",)))
    sequence_parallel: bool = _key(False, BOOLEAN, "split norms, dropout and residual activations along the "
                                                   "sequence over tp (reduce-scatter / all-gather instead of all-reduce)")
    zero: int = _key(0, ZERO_STAGE, "ZeRO stage over dp (x cp): 0 none; 1 optimizer state sharded (gradients "
                               "reduce-scattered in the step); 2 also gradients (each bucket reduce-scattered "
                               "during backward, overlapped as DDP's all-reduce, only the shard kept); 3 also "
                               "parameters (each unit, a layer, all-gathered before it runs, the next one prefetched)",
                     check=Check("0, 1, 2 or 3", lambda v: v in (0, 1, 2, 3)))
    shard_size: int | None = _key(None, INTEGER, "ZeRO shards within groups of this many consecutive dp ranks (dp "
                                                 "x cp ranks with cp > 1) and averages the shard gradients across the "
                                                 "groups (hybrid sharding, HSDP); unset: all of them when they are on "
                                                 "one node, else a node's", check=at_least(1),
                                  applies=("parallel.zero", (1, 2, 3)))
    reshard_after_forward: bool | None = _key(None, BOOLEAN, "ZeRO-3: free a unit's gathered parameters after its "
                                                             "forward and gather them again for its backward (on CPUs "
                                                             "their pages are dropped; device arrays rerun the unit "
                                                             "as a recomputed region) instead of keeping them to the "
                                                             "step's end; unset: true with pp = 1, false with a "
                                                             "pipeline (kept across its micro-batches)",
                                              applies=("parallel.zero", (3,)))
    shm: bool | None = _key(None, BOOLEAN, "shared-memory collectives among a node's ranks (DDP buckets and ZeRO's "
                                            "buffers in an MPI shared window; CPUs); unset: HPCPAR_SHM, else on")
    node_size: int | None = _key(None, INTEGER, "pretend nodes of this many ranks for the shared-memory collectives "
                                                "(their inter-node step on one machine; nothing else sees them, so "
                                                "with shm off the key does nothing); unset: HPCPAR_NODE_SIZE, else "
                                                "the real nodes", check=at_least(1))
    backend: str = _key("auto", STRING, "what moves GPU buffers: nccl (NVIDIA's NCCL through CuPy, on its own "
                                        "stream), mpi (CUDA-aware MPI, else staged through pinned host memory); auto: "
                                        "nccl on GPUs when CuPy has it, else mpi; CPUs always use mpi",
                        choices=("auto", "mpi", "nccl"))
    device_nonblocking: bool | None = _key(None, BOOLEAN, "a CUDA-aware MPI takes device buffers in non-blocking "
                                                          "collectives (else they run blocking); unset: "
                                                          "HPCPAR_DEVICE_NONBLOCKING, else the table of MPI "
                                                          "libraries in hpcpar/runtime/device_transport.py (docs/gpu.md)")
    ep: int = _key(1, INTEGER, "expert parallelism: the experts of each MoE block split over groups of ep "
                               "consecutive dp ranks (ep divides dp; tokens reach their experts by all-to-all); "
                               "expert gradients are averaged over the dp ranks that hold the same experts",
                   check=at_least(1))
    mode: str = _key("allreduce", STRING, "how dp replicas agree", choices=("allreduce", "ps", "local_sgd"))
    layout: str = _key("manual", STRING, "auto: the planner (hpcpar plan, with hpcpar train's --machine or "
                                         "runs/plan/machine.toml) picks dp, pp, tp, cp, ep, the schedule, "
                                         "micro-batches, chunks, partition, sequence parallelism, the ZeRO stage "
                                         "and model.recompute for the world and the memory per rank, keeping those "
                                         "the job gives; it prints its choice and the runner-up, and the run's "
                                         "job.toml records the choice; manual: the job's own",
                       choices=("manual", "auto"))
    staleness: int = _key(0, INTEGER, "steps a worker may run ahead of the servers", check=at_least(0),
                          applies=("parallel.mode", ("ps",)))
    local_steps: int = _key(4, INTEGER, "local SGD: steps between parameter averages (H)", check=at_least(1),
                            applies=("parallel.mode", ("local_sgd",)))
    average_optimizer_state: bool = _key(False, BOOLEAN, "local SGD: average the optimizer state with the "
                                                         "parameters (either way a resume is exact: checkpoints "
                                                         "keep each replica's own state as its row)",
                                         applies=("parallel.mode", ("local_sgd",)))
    servers: int = _key(1, INTEGER, "parameter-server ranks (taken from the world; dp = world - servers)",
                        check=at_least(1), applies=("parallel.mode", ("ps",)))

    def grid_sizes(self) -> dict:
        """{axis: size} for the grid's axes, in table order (the fill axis None until validated)."""
        return {name: getattr(self, name) for name in GRID.spelt}

    def grid_ranks(self) -> int | None:
        """The ranks the grid holds (the product of its sizes); None while the fill axis is unset."""
        sizes = self.grid_sizes()
        return None if None in sizes.values() else GRID.mesh(**sizes).world_size


@dataclass(frozen=True)
class OptimizerSection:
    name: str = _key("adamw", STRING, "optimizer", choices=("adamw", "adam", "sgd"))
    lr: float = _key(1e-3, NUMBER, "peak learning rate", check=above(0))
    weight_decay: float = _key(0.0, NUMBER, "decoupled for adamw, L2 for adam and sgd", check=at_least(0))
    no_decay: tuple = _key(NO_DECAY, STRING_LIST, "parameter-name patterns (fnmatch) exempt from weight decay: "
                                                  "biases, LayerNorms, embeddings; [] decays every parameter")
    betas: tuple = _key((0.9, 0.999), NUMBER_PAIR, "Adam's moment decay rates", check=each(in_range(0.0, 1.0)),
                        applies=("optimizer.name", ("adamw", "adam")))
    momentum: float = _key(0.0, NUMBER, "SGD momentum", check=in_range(0.0, 1.0),
                           applies=("optimizer.name", ("sgd",)))
    grad_clip: float = _key(0.0, NUMBER, "clip the global gradient norm to this; 0 = off", check=at_least(0))


@dataclass(frozen=True)
class LRScheduleSection:
    warmup_steps: int = _key(0, INTEGER, "linear warm-up steps, then cosine decay to min_lr at train.steps",
                             check=at_least(0))
    min_lr: float = _key(0.0, NUMBER, "learning rate at the last step", check=at_least(0))


@dataclass(frozen=True)
class TrainSection:
    steps: int = _key(100, INTEGER, "optimizer steps", check=at_least(1))
    log_interval: int = _key(10, INTEGER, "steps between log lines and metrics records", check=at_least(1))
    eval_interval: int = _key(0, INTEGER, "steps between evaluations; 0 = only after the last step",
                              check=at_least(0))
    seed: int = _key(0, INTEGER, "data order (and the digits train/test split)", check=at_least(0))
    precision: str = _key("fp32", STRING, "compute dtype (fp16/bf16 keep fp32 master weights)",
                          choices=tuple(PRECISIONS))
    device: str = _key("auto", STRING, "auto = HPCPAR_DEVICE if set, else cuda when a GPU is usable, else cpu; "
                       "guard = the CuPy path on CPUs under the transfer guard", choices=DEVICES)
    metrics: str = _key("runs/{job}/metrics.jsonl", STRING, "JSONL metrics file (written by rank 0)")
    trace: str | None = _key(None, STRING, "one Chrome/Perfetto trace-event JSON of every rank's steps "
                             "(spans of forward, backward, optimizer, communication; clocks aligned); unset = none")
    trace_steps: int = _key(5, INTEGER, "steps kept in the trace: the first N and the last N", check=at_least(1))
    tensorboard: str | None = _key(None, STRING, "folder for TensorBoard event files of the metrics; unset = none",
                                   check=Check("set only where tensorboardX is installed "
                                               "(pip install 'hpcpar[tensorboard]')", lambda v: tensorboard.available()))
    sample_tokens: int = _key(0, INTEGER, "tokens sampled from the model after training", check=at_least(0),
                              applies=GPT_ONLY)
    max_seconds: float | None = _key(None, NUMBER, "stop (and checkpoint) after this long; unset = no limit",
                                     check=above(0))
    on_nonfinite: str = _key("stop", STRING, "after a step whose loss or gradient norm is not finite (the step is "
                             "skipped on every rank): stop = end the run (exit 3) naming the step, saving nothing "
                             "after it; skip = train on (train.max_skipped in a row, then stop); rewind = reload the "
                             "newest checkpoint and skip the data of the failed steps (train.max_rewinds times, "
                             "then stop)", choices=NONFINITE_POLICIES)
    max_skipped: int = _key(20, INTEGER, "non-finite steps skipped in a row before the run stops (an fp16 loss "
                            "scaler's overflows count too, under every policy: a scale that collapses)",
                            check=at_least(0))
    max_rewinds: int = _key(3, INTEGER, "rewinds a run makes before it stops", check=at_least(1),
                            applies=REWIND_ONLY)
    spike_zscore: float | None = _key(None, NUMBER, "rewind also when the loss (the mean over dp) is more than this "
                                      "many standard deviations above the mean of the last train.spike_window "
                                      "losses; unset = only non-finite steps rewind", check=above(0),
                                      applies=REWIND_ONLY)
    spike_window: int = _key(50, INTEGER, "losses the spike trigger compares with (it waits for that many)",
                             check=at_least(2), applies=REWIND_ONLY)


@dataclass(frozen=True)
class CheckpointSection:
    dir: str = _key("runs/{job}/checkpoints", STRING, "checkpoint root folder",
                    check=Check("a folder name", lambda v: bool(v.strip())))
    interval: int = _key(0, INTEGER, "steps between checkpoints; 0 = none during training", check=at_least(0))
    keep: int = _key(2, INTEGER, "checkpoints kept (older ones are removed)", check=at_least(1))
    async_: bool = _key(False, BOOLEAN, "write the periodic checkpoints (checkpoint.interval) in a background "
                          "thread; the last one, at the end or a stop, is written before the run ends. It calls MPI: "
                          "needs MPI.THREAD_MULTIPLE, else they are written synchronously with one warning; a "
                          "parameter server's are synchronous: its servers pause serving to write", name="async",
                        applies=("parallel.mode", ("allreduce", "local_sgd")))
    resume: str = _key("auto", RESUME, "auto: continue this run from dir's latest checkpoint (fresh when dir has "
                                       "none; refuses another run's checkpoints); never: a new run, dir must hold no "
                                       "checkpoint (--overwrite moves them aside); must: fail unless a checkpoint "
                                       "loads; a step folder: continue from it (--load-weights-only: its weights)",
                       check=Check("auto, never, must or a step folder", lambda v: bool(v.strip())))
    compression_state: bool = _key(True, BOOLEAN, "save the gradient compressor's error feedback (top-k's residuals, "
                                   "PowerSGD's errors and Q factors: each dp replica's own, about one float32 copy of "
                                   "the gradients per replica) so that a resume continues exactly; false: checkpoints "
                                   "leave it out and a resume starts it afresh (and says so)",
                                   applies=("parallel.compression", ("topk", "powersgd")))
    on_error: str = _key("stop", STRING, "when a checkpoint cannot be written (disk full, a write error): stop "
                         "the run with the error, or warn and train on (the previous checkpoint stays the latest)",
                         choices=("stop", "warn"))


SECTIONS = {"model": ModelSection, "moe": MoESection, "data": DataSection, "parallel": ParallelSection,
            "optimizer": OptimizerSection, "lr_schedule": LRScheduleSection, "train": TrainSection,
            "checkpoint": CheckpointSection}
PATH_KEYS = ("data.path", "train.metrics", "train.trace", "train.tensorboard", "checkpoint.dir", "checkpoint.resume")
DEPRECATED_SECTIONS = {"schedule": "lr_schedule"}  # old name -> new name, read with a notice for one release
NESTED_SECTIONS = {"moe": "model"}  # a section written as a table inside another: [model.moe]


def section_title(name: str) -> str:
    """How a section (or a dotted key) is written in a job file: ``moe.experts`` is ``model.moe.experts``."""
    head, dot, rest = name.partition(".")
    return (f"{NESTED_SECTIONS[head]}.{head}" if head in NESTED_SECTIONS else head) + dot + rest



@dataclass(frozen=True)
class Job:
    model: ModelSection = ModelSection()
    moe: MoESection = MoESection()
    data: DataSection = DataSection()
    parallel: ParallelSection = ParallelSection()
    optimizer: OptimizerSection = OptimizerSection()
    lr_schedule: LRScheduleSection = LRScheduleSection()
    train: TrainSection = TrainSection()
    checkpoint: CheckpointSection = CheckpointSection()
    source: str = "<job>"  # the job file, for messages
    given: frozenset = frozenset()  # dotted keys set by the file or --set
    world_size: int | None = None  # set by validate(), which also fills parallel.dp
    notices: tuple = ()  # deprecations met while reading the job, for rank 0 to print

    def sections(self) -> list[tuple[str, Any]]:
        return [(name, getattr(self, name)) for name in SECTIONS]

    def get(self, dotted: str):
        section, key = dotted.split(".")
        f = _fields_by_key(SECTIONS[section])[key]
        return getattr(getattr(self, section), f.name)

    def applies(self, dotted: str) -> bool:
        """Whether a key has an effect given the others (``model.vocab_size`` only for gpt)."""
        section, key = dotted.split(".")
        rule = _fields_by_key(SECTIONS[section])[key].metadata["applies"]
        return rule is None or self.get(rule[0]) in rule[1]

    def to_dict(self) -> dict:
        """{section: {toml key: value}} with lists for tuples and None for unset keys."""
        return {name: {toml_key(f): list(v) if isinstance(v := getattr(section, f.name), tuple) else v
                       for f in fields(section)} for name, section in self.sections()}

    @property
    def precision(self) -> Precision:
        """``train.precision`` decoded (compute dtype, masters, loss scaler): the one place a run reads it."""
        return PRECISIONS[self.train.precision]

    @property
    def num_layers(self) -> int:
        """Layers a pipeline can cut: embedding + blocks + head for gpt, DigitsCNN.layers() for cnn."""
        if self.model.kind == "gpt":
            return self.model.n_layer + 2
        from ..nn.cnn import DigitsCNN

        return len(DigitsCNN(channels=self.model.channels).layers())

    def gpt_config(self):
        from ..nn.gpt import GPTConfig

        m = self.model
        return GPTConfig(vocab_size=m.vocab_size, block_size=m.block_size, n_layer=m.n_layer, n_head=m.n_head,
                         n_embd=m.n_embd, dropout=m.dropout, bias=m.bias, tie_weights=m.tie_weights, seed=m.seed,
                         moe=self.moe_config())

    def model_config(self) -> dict:
        """The model's keys as a checkpoint keeps them (``hpcpar generate`` rebuilds the GPT from them)."""
        config = self.to_dict()["model"]
        if self.moe_config() is not None:
            config["moe"] = {k: v for k, v in self.to_dict()["moe"].items() if k != "load_warning"}
        return config

    def moe_config(self):
        """The GPT's ``nn.moe.MoEConfig`` (None: a dense GPT)."""
        from ..nn.moe import MoEConfig

        e = self.moe
        if self.model.kind != "gpt" or e.experts == 0:
            return None
        return MoEConfig(experts=e.experts, top_k=e.top_k, capacity_factor=e.capacity_factor, every=e.every,
                         aux_loss_coef=e.aux_loss_coef, z_loss_coef=e.z_loss_coef)

    def describe(self) -> str:
        """The resolved job as TOML (keys without effect left out), for rank 0 to print and to re-run."""
        p = self.parallel
        head = f"# job {self.source}"
        if self.world_size is not None:
            head += f", {self.world_size} ranks as {GRID.mesh(**p.grid_sizes()).words()}"
            if p.mode == "ps":
                head += f" + {p.servers} server(s)"
        lines = [head]
        for name, section in self.sections():
            lines += ["", f"[{section_title(name)}]"]
            for f in fields(section):
                key = toml_key(f)
                if not self.applies(f"{name}.{key}"):
                    continue
                value = getattr(section, f.name)
                if value is None:
                    lines.append(f"# {key}: unset ({f.metadata['doc']})")
                else:
                    lines.append(f"{key} = {toml_value(value)}")
        return "\n".join(lines) + "\n"


def _fields_by_key(cls) -> dict:
    return {toml_key(f): f for f in fields(cls)}


def schema_table() -> str:
    """Every key with its type, default, allowed values and meaning, as a Markdown table."""
    rows = ["| key | type | default | allowed | meaning |", "|---|---|---|---|---|"]
    for name, cls in SECTIONS.items():
        for f in fields(cls):
            meta = f.metadata
            limits = [" \\| ".join(meta["choices"]) if meta["choices"] else meta["check"].text if meta["check"] else ""]
            if meta["applies"]:
                selector, allowed = meta["applies"]
                limits.append(f"only with {applies_text(section_title(selector), allowed)}")
            allowed = "; ".join(filter(None, limits))
            default = "unset" if f.default is None else toml_value(f.default)
            rows.append(f"| {section_title(name)}.{toml_key(f)} | {meta['type'].name} | `{default}` | {allowed} | {meta['doc']} |")
    return "\n".join(rows)
