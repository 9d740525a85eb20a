"""Validating a job against the world: the checks that need several keys together and the world size.

``load_job`` (config_load.py) has already checked each key on its own; ``validate`` checks the
dp x pp x tp layout, heads and vocabulary divisible by tp, batch divisible by dp and
micro-batches, pipeline stages versus layers, modes that exclude each other, ``no_decay``
patterns against the model's parameter names, and the data file, and reports every problem in
one ``JobError``. A pure function of the job, the world size and the files it reads: every rank
reaches the same verdict before any rank waits on another, and before anything is written.
``check_machine`` adds what only matters where the job runs (the paths the run writes, the
environment, the memory): plans and dry runs are for other machines.
"""
from __future__ import annotations

import importlib.util
import os
from dataclasses import replace

import numpy as np

from .. import defaults
from ..checkpoint.manifest import MANIFEST, checkpoint_name_of
from ..paths import input_problem, output_problem
from ..parallel.pipeline.schedules import interleaved_fit
from ..runtime.grid import GRID, LayoutError
from .config import BYTE_VOCAB, Job, JobError
from .config_types import toml_value
from .strategies import strategy_class


def _divisors(n: int) -> str:
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)


def validate(job: Job, world_size: int) -> Job:
    """Check the keys together and against ``world_size``; return the job with ``parallel.dp`` filled in."""
    dp, problems = _check_layout(job, world_size)
    problems += strategy_class(job).check_job(job, world_size)  # what the mode itself asks
    problems += _check_modes(job)
    problems += _check_model(job)
    problems += _check_pipeline(job)
    problems += _check_batch(job, dp)
    problems += _check_experts(job, dp)
    problems += _check_no_decay(job)
    problems += _check_packages(job)
    if job.lr_schedule.min_lr > job.optimizer.lr:  # a warm-up longer than train.steps is fine (a shortened run)
        problems.append(("lr_schedule.min_lr", f"{job.lr_schedule.min_lr:g} is above optimizer.lr = "
                                               f"{job.optimizer.lr:g}; the cosine decays from lr down to min_lr"))
    if job.data.kind == "text":
        problems += _check_token_file(job)
    if problems:
        raise JobError(job.source, problems)
    return replace(job, parallel=replace(job.parallel, dp=dp), world_size=world_size)


def _check_layout(job: Job, world_size: int) -> tuple[int | None, list]:
    """(dp, problems): dp stays None when the layout does not fit (the batch checks need it)."""
    p = job.parallel
    workers = strategy_class(job).grid_ranks(job, world_size)
    if workers < 1:  # the strategy's check_job says why (servers that take every rank)
        return None, []
    try:
        mesh = GRID.resolve(workers, **p.grid_sizes())
    except LayoutError as err:
        keys = ", ".join(f"parallel.{name}" for name, size in p.grid_sizes().items()  # given (a suffix axis: above 1)
                         if size is not None and not (GRID.axis(name).suffix and size == 1))
        servers = (f" (the grid holds the {workers} of the {world_size} ranks that train)"
                   if workers < world_size else "")
        return None, [(keys, f"{err}{servers}")]
    return mesh.size(GRID.fill), []


def _check_modes(job: Job) -> list:
    """Options that exclude each other whatever the mode (the mode's own: ``Strategy.check_job``)."""
    p, problems = job.parallel, []
    if p.zero and p.compression != "none":
        problems.append(("parallel.zero", f"ZeRO reduce-scatters gradients itself and cannot use "
                                          f"compression = {toml_value(p.compression)}; set one of them off"))
    replicas = None if p.dp is None else p.dp * p.cp  # ZeRO shards over dp x cp
    if p.zero and p.shard_size is not None and replicas is not None and replicas % p.shard_size:
        over = f"dp = {p.dp}" if p.cp == 1 else f"dp x cp = {p.dp} x {p.cp} = {replicas}"
        problems.append(("parallel.shard_size", f"{p.shard_size} does not divide {over}: the shard groups "
                                                f"would be unequal"))
    if p.cp > 1 and p.compression != "none":
        problems.append(("parallel.compression", f"compression = {toml_value(p.compression)} is not supported with "
                                                 f"context parallelism (cp = {p.cp}); set compression = \"none\" or cp = 1"))
    return problems


def _check_model(job: Job) -> list:
    """The model against tensor and sequence parallelism, and against the data."""
    p, m, problems = job.parallel, job.model, []
    if m.kind == "gpt":
        if m.n_embd % m.n_head:
            problems.append(("model.n_head", f"n_embd = {m.n_embd} is not divisible by n_head = {m.n_head} "
                                             f"(head size {m.n_embd / m.n_head:g}); n_head must divide n_embd: "
                                             f"one of {_divisors(m.n_embd)}"))
        if m.n_head % p.tp:
            problems.append(("parallel.tp", f"n_head = {m.n_head} is not divisible by tp = {p.tp}: each tp rank "
                                            f"holds whole heads; use tp in {_divisors(m.n_head)}"))
        if m.vocab_size % p.tp:
            problems.append(("parallel.tp", f"vocab_size = {m.vocab_size} is not divisible by tp = {p.tp}: the "
                                            f"embedding is split by rows; use tp in {_divisors(m.vocab_size)} "
                                            f"or pad model.vocab_size"))
    elif p.tp > 1:
        problems.append(("parallel.tp", f"tensor parallelism splits the GPT's heads and MLP; model.kind = "
                                        f"\"cnn\" needs tp = 1, got {p.tp}"))
    if p.sequence_parallel and p.tp == 1:
        problems.append(("parallel.sequence_parallel", "splits activations over the tp ranks; with tp = 1 there "
                                                       "is nothing to split: set tp > 1 or sequence_parallel = false"))
    elif p.sequence_parallel and m.kind == "gpt" and m.block_size % (p.tp * p.cp):
        over = f"tp = {p.tp} ranks" if p.cp == 1 else f"the tp = {p.tp} ranks of each of cp = {p.cp}"
        problems.append(("parallel.sequence_parallel", f"block_size = {m.block_size} tokens do not split over "
                                                       f"{over}; use a block_size that is a multiple of "
                                                       f"{p.tp * p.cp} or sequence_parallel = false"))
    problems += _check_context(job)
    if (m.kind == "gpt") != (job.data.kind == "text"):
        want = "text" if m.kind == "gpt" else "digits"
        problems.append(("data.kind", f"model.kind = {toml_value(m.kind)} trains on data.kind = "
                                      f"{toml_value(want)}, got {toml_value(job.data.kind)}"))
    return problems


def _check_context(job: Job) -> list:
    """Context parallelism against the model: the GPT's sequences cut into 2 x cp chunks."""
    p, m = job.parallel, job.model
    if p.cp == 1:
        return []
    if m.kind != "gpt":
        return [("parallel.cp", f"context parallelism splits the GPT's sequences; model.kind = {toml_value(m.kind)} "
                                f"needs cp = 1, got {p.cp}")]
    if m.block_size % (2 * p.cp):
        return [("parallel.cp", f"block_size = {m.block_size} is not divisible by 2 x cp = {2 * p.cp}: each sequence "
                                f"is cut into 2 x cp zigzag chunks; use a block_size that is a multiple of {2 * p.cp}")]
    return []


def _check_experts(job: Job, dp: int | None) -> list:
    """Mixture of Experts and expert parallelism against the model and the layout."""
    p, e = job.parallel, job.moe
    if e.experts == 0:
        return [] if p.ep == 1 else [("parallel.ep", f"ep = {p.ep} splits the experts of MoE blocks, but "
                                                     f"model.moe.experts = 0 (a dense model); set experts or ep = 1")]
    problems = []  # (MoE on the CNN is refused by load_job: model.moe.experts applies to the GPT only)
    if e.top_k > e.experts:
        problems.append(("model.moe.top_k", f"{e.top_k} is more than the {e.experts} experts"))
    if e.every > job.model.n_layer:
        problems.append(("model.moe.every", f"{e.every} is more than n_layer = {job.model.n_layer}: no block would "
                                            f"have experts"))
    if p.cp > 1:
        problems.append(("parallel.cp", f"Mixture of Experts routes and balances whole sequences; cp = {p.cp} splits "
                                        f"them: use cp = 1 with model.moe"))
    if p.mode != "allreduce":
        problems.append(("parallel.mode", f"Mixture of Experts trains with mode = \"allreduce\" only, got "
                                          f"{toml_value(p.mode)}"))
    if p.ep > 1:
        problems += _check_expert_parallel(job, dp)
    return problems


def _check_expert_parallel(job: Job, dp: int | None) -> list:
    p, e, problems = job.parallel, job.moe, []
    if e.experts % p.ep:
        problems.append(("parallel.ep", f"{e.experts} experts do not split over ep = {p.ep} ranks; use ep in "
                                        f"{_divisors(e.experts)}"))
    if dp is not None and dp % p.ep:
        problems.append(("parallel.ep", f"ep = {p.ep} does not divide dp = {dp}: expert groups are carved out of dp; "
                                        f"use ep in {_divisors(dp)}"))
    if p.zero and p.shard_size is not None:
        problems.append(("parallel.shard_size", f"hybrid sharding with expert parallelism (ep = {p.ep}) is not "
                                                f"supported; leave shard_size unset"))
    if p.compression != "none":
        problems.append(("parallel.compression", f"compression = {toml_value(p.compression)} is not supported with "
                                                 f"expert parallelism (ep = {p.ep}); set compression = \"none\""))
    return problems


def _check_pipeline(job: Job) -> list:
    """Stages against layers, explicit partitions, the interleaved schedule's micro-batches."""
    p, problems = job.parallel, []
    layers, stages = job.num_layers, p.pp * p.chunks
    if stages > layers:
        problems.append(("parallel.pp", f"pp x chunks = {p.pp} x {p.chunks} = {stages} stages, but the model has "
                                        f"only {layers} layers to cut"
                                        + (f" (n_layer + 2 = {job.model.n_layer} + 2)" if job.model.kind == "gpt" else "")
                                        + "; lower pp or chunks or add layers"))
    if p.partition == "blocks" and stages > layers - 2:
        problems.append(("parallel.partition", f"partition = \"blocks\" gives each of pp x chunks = {stages} stages a "
                                               f"block, but the model has {layers - 2}; lower pp or chunks"))
    if not isinstance(p.partition, str):
        if len(p.partition) != stages:
            problems.append(("parallel.partition", f"{len(p.partition)} per-stage counts for pp x chunks = "
                                                   f"{stages} stages; give {stages}"))
        elif sum(p.partition) != layers:
            problems.append(("parallel.partition", f"per-stage counts {list(p.partition)} add up to "
                                                   f"{sum(p.partition)}, but the model has {layers} layers"))
    fit = interleaved_fit(p.pp, p.micro_batches)
    if p.schedule == "interleaved" and fit is not None:
        problems.append(("parallel.micro_batches", f"the interleaved schedule needs micro_batches divisible by pp: "
                                                   f"{p.micro_batches} % {p.pp} != 0; use {fit}"))
    return problems


def _check_batch(job: Job, dp: int | None) -> list:
    """The global batch splits evenly over the replicas and their micro-batches."""
    b, micro = job.data.batch_size, job.parallel.micro_batches
    if dp is None:
        return []
    if b % dp:
        return [("data.batch_size", f"{b} is not divisible by dp = {dp}: every replica takes an equal "
                                    f"share; use a multiple of {dp}")]
    if (b // dp) % micro:
        return [("parallel.micro_batches", f"each of the dp = {dp} replicas gets {b // dp} samples, not "
                                           f"divisible into {micro} micro-batches; use micro_batches in "
                                           f"{_divisors(b // dp)} or data.batch_size = "
                                           f"{dp * micro * max(1, b // (dp * micro))}")]
    return []


def check_machine(job: Job, writes: bool = True) -> None:
    """Before training on this machine (not in ``validate``: plans and dry runs are for other machines): the
    paths the run writes (unless ``writes`` is False: ``hpcpar compare`` writes none of them), the
    environment variables that decide unset keys, and the memory; a JobError listing what is wrong."""
    problems = (_check_outputs(job) if writes else []) + _check_environment(job) + _check_memory(job)
    if problems:
        raise JobError(job.source, problems)


def _check_environment(job: Job) -> list[tuple[str, str]]:
    """A variable that decides an unset key holds a value it takes (a bad one was a ValueError traceback
    while the run's context was built)."""
    from ..backend import DEVICES
    from ..runtime.device_transport import device_nonblocking_supported
    from ..runtime.nodes import node_size_setting
    from ..runtime.shm import shm_setting

    p, problems = job.parallel, []
    device = os.environ.get("HPCPAR_DEVICE") if job.train.device == "auto" else None
    if device and device not in DEVICES:
        problems.append(("train.device", f"\"auto\" takes $HPCPAR_DEVICE, which is {device!r}, not one of "
                                         f"{', '.join(DEVICES)}; fix the variable or set the key"))
    settings = (("parallel.shm", p.shm, shm_setting), ("parallel.node_size", p.node_size, node_size_setting),
                ("parallel.device_nonblocking", p.device_nonblocking,  # a library named: no MPI query
                 lambda _: device_nonblocking_supported("MPICH", ())))
    for key, value, setting in settings:
        if value is None:
            try:
                setting(None)
            except ValueError as error:
                problems.append((key, f"unset, so the environment decides, and {error}; fix the variable or set "
                                      f"the key"))
    return problems


def _check_memory(job: Job) -> list[tuple[str, str]]:
    """A GPT whose float32 weights alone, split over pp x tp, or one micro-batch's logits exceed this
    machine's memory (a MemoryError traceback while the model was built, or a first step that never
    ended). Deliberately loose (no gradients, optimizer state or other activations, one rank per
    machine): it refuses only what cannot run, never what might."""
    m, p = job.model, job.parallel
    if m.kind != "gpt":
        return []
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    count = 12 * m.n_layer * m.n_embd ** 2 + (m.vocab_size + m.block_size) * m.n_embd  # blocks + embeddings
    weights = 4 * count / (p.pp * p.tp)
    tokens = job.data.batch_size // ((p.dp or 1) * p.micro_batches) * m.block_size // p.cp  # one micro-batch's, per rank
    logits = 4 * tokens * m.vocab_size / p.tp
    if weights > memory:
        problem = ("model.n_embd, model.n_layer, model.vocab_size",
                   f"a GPT of about {count:.3g} parameters takes {weights / 2**30:,.0f} GiB in float32 on each of the "
                   f"pp x tp = {p.pp * p.tp} ranks that split it")
    elif logits > memory:
        problem = ("data.batch_size, model.block_size",
                   f"one micro-batch of {tokens:,} tokens has logits of {logits / 2**30:,.0f} GiB in float32 per rank")
    else:
        return []
    return [(problem[0], f"{problem[1]}, beyond this machine's {memory / 2**30:,.0f} GiB of memory; lower them")]


# Packages a job may need beyond hpcpar's own dependencies: (key, its value, module, the extra naming it)
OPTIONAL_PACKAGES = (("data.kind", "digits", "sklearn", "digits"),)


def _check_packages(job: Job) -> list[tuple[str, str]]:
    """The optional package a job's settings need, where it is not installed (found, not imported);
    the precision's is its own (``Precision.package``, the extra named like the precision)."""
    needs = [(key, value, module, extra) for key, value, module, extra in OPTIONAL_PACKAGES if job.get(key) == value]
    if job.precision.package is not None:
        needs.insert(0, ("train.precision", job.precision.name, job.precision.package, job.precision.name))
    return [(key, f"{toml_value(value)} needs the {module} package: pip install 'hpcpar[{extra}]'")
            for key, value, module, extra in needs if importlib.util.find_spec(module) is None]


# The paths a run writes: (key, whether it is a folder)
OUTPUTS = (("train.metrics", False), ("train.trace", False), ("train.tensorboard", True), ("checkpoint.dir", True))


def _check_outputs(job: Job) -> list[tuple[str, str]]:
    """Each path the run writes can be made (else it failed mid-run or at the end, after the rest was
    written) and replaces nothing the run reads or writes elsewhere."""
    problems = [(key, f"{toml_value(path)} {problem}")
                for key, folder in OUTPUTS if (path := job.get(key)) and (problem := output_problem(path, folder))]
    return problems or _check_overlaps(job)


def _lock_name_of(path: str, folder: str) -> str | None:
    """``run.lock`` when ``path`` is the run lock of the checkpoint root ``folder`` (``run_lock``)."""
    from .run_lock import LOCK_NAME

    lock = os.path.join(folder, LOCK_NAME)
    return LOCK_NAME if os.path.realpath(path) == os.path.realpath(lock) else None


def _check_overlaps(job: Job) -> list[tuple[str, str]]:
    """A metrics file or trace on the data file, the job file or each other (a fresh run renamed the token
    file aside as an old metrics file; the trace replaced the file at the end, exit 0), an output at a name
    the checkpoint writes (a metrics file named checkpoint.dir/latest replaced the pointer: no step loaded),
    and a checkpoint.dir that is a step folder (a second root was written inside it)."""
    taken = [("data.path", job.data.path if job.data.kind == "text" else None), ("the job file", job.source)]
    problems = []
    for key in ("train.metrics", "train.trace"):
        path = job.get(key)
        same = [name for name, other in taken if path and other and os.path.realpath(other) == os.path.realpath(path)]
        if same:
            problems.append((key, f"{toml_value(path)} is also {same[0]}, which writing it would replace; "
                                  f"choose another path"))
        taken.append((key, path))
    folder = job.checkpoint.dir
    for key in ("train.metrics", "train.trace", "train.tensorboard"):
        if (path := job.get(key)) and _lock_name_of(path, folder):
            problems.append((key, f"{toml_value(path)} is checkpoint.dir's run lock ('run.lock', which keeps a second "
                                  f"run off the folder); choose another path"))
        elif path and (name := checkpoint_name_of(path, folder)):
            where = "is checkpoint.dir itself" if name == "." else \
                f"lies at {name!r} in checkpoint.dir, a name its checkpoints write (the pointer 'latest', the step folders)"
            problems.append((key, f"{toml_value(path)} {where}, so a checkpoint there would be lost; choose another path"))
    if os.path.isfile(os.path.join(folder, MANIFEST)):
        problems.append(("checkpoint.dir", f"{toml_value(folder)} is a step folder of a checkpoint; give a checkpoint "
                                           f"root (such as {os.path.dirname(os.path.normpath(folder)) or '.'}) or a "
                                           f"new folder"))
    return problems


def _check_token_file(job: Job) -> list[tuple[str, str]]:
    path, m = job.data.path, job.model
    if not os.path.lexists(path):
        if not prepares_builtin_corpus(job):
            return [("data.path", missing_data_message(job))]
        info = {"vocab_size": BYTE_VOCAB}  # what `hpcpar data prepare` will make
    else:
        from ..data.loader import dataset_info

        if problem := input_problem(path):  # a named pipe would block h5py's open forever
            return [("data.path", f"{toml_value(path)} {problem}; give the token file of `hpcpar data prepare`")]
        try:
            info = dataset_info(path)
        except (OSError, KeyError, ValueError) as err:
            text = " ".join(str(err).split())  # HDF5's messages may span lines
            return [("data.path", f"{toml_value(path)} is not a token file of `hpcpar data prepare`: {text}")]
    problems = []
    if m.kind == "gpt" and m.vocab_size < info["vocab_size"]:
        problems.append(("model.vocab_size", f"{m.vocab_size} is smaller than the vocab_size {info['vocab_size']} "
                                             f"of {path}; use at least {info['vocab_size']}"))
    for split in ("train", "val"):
        if split in info and info[split] <= m.block_size:
            problems.append(("data.path", f"the {split} split of {path} has {info[split]} tokens, not more than "
                                          f"model.block_size = {m.block_size}; prepare more text"))
    return problems or _check_token_ids(job, info)


def _check_token_ids(job: Job, info: dict) -> list[tuple[str, str]]:
    """Every token id of the file is in 0..model.vocab_size-1 (an id outside fails in the embedding,
    mid-run). Free for byte tokens: the ids of a file whose dtype holds no id out of range are not read."""
    from ..data.loader import id_range

    vocab = job.model.vocab_size
    for split, dtype in info.get("dtypes", {}).items():
        if job.model.kind != "gpt" or (np.iinfo(dtype).min >= 0 and np.iinfo(dtype).max < vocab):
            continue
        low, high = id_range(job.data.path, split)
        if low < 0 or high >= vocab:
            bad = low if low < 0 else high
            return [("data.path", f"the {split} split of {job.data.path} holds token id {bad}, outside "
                                  f"0..model.vocab_size-1 = 0..{vocab - 1}; "
                                  + ("remake the file" if bad < 0 else f"set model.vocab_size >= {high + 1}"))]
    return []


def prepares_builtin_corpus(job: Job) -> bool:
    """Whether a missing ``data.path`` is prepared on first use: only the built-in corpus at its default
    path (what ``make demo`` trains on); a missing file anywhere else is more likely a typo."""
    return job.data.prepare_if_missing and os.path.abspath(job.data.path) == os.path.abspath(defaults.TEXT_CORPUS)


def missing_data_message(job: Job) -> str:
    path = job.data.path
    return (f"{toml_value(path)} does not exist (relative paths start at the current folder: {os.path.abspath(path)}); "
            f"make it with `hpcpar data prepare --out {path} [TEXT FILES]` (no files: the Python standard library). "
            f"Only the built-in corpus at its default path {defaults.TEXT_CORPUS} is prepared automatically")


def parameter_names(job: Job) -> list[str]:
    """The model's parameter names, from a copy of it with every width 1 (names do not depend on widths)."""
    m = job.model
    if m.kind == "gpt":
        from ..nn.gpt import GPT, GPTConfig

        tiny = GPTConfig(vocab_size=1, block_size=1, n_layer=m.n_layer, n_head=1, n_embd=1, bias=m.bias,
                         tie_weights=m.tie_weights)
        return [name for name, _ in GPT(tiny).named_parameters()]
    from ..nn.cnn import DigitsCNN

    return [name for name, _ in DigitsCNN(channels=(1, 1)).named_parameters()]


def _check_no_decay(job: Job) -> list[tuple[str, str]]:
    """Given ``optimizer.no_decay`` patterns each match some parameter of the model (the default's may not)."""
    from ..optim.groups import unmatched_patterns

    if "optimizer.no_decay" not in job.given:
        return []
    names = parameter_names(job)
    unmatched = unmatched_patterns(names, job.optimizer.no_decay)
    if not unmatched:
        return []
    return [("optimizer.no_decay", f"{', '.join(map(toml_value, unmatched))} match(es) no parameter of the "
                                   f"{job.model.kind}; its names look like {', '.join(names[:4])}, ... "
                                   f"(shell-style patterns: * matches any text, dots included)")]
