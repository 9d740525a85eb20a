"""The job combinations tests/sweep.py draws: a small base job, and random keys on top of it.

A combination is a dict of job keys to values as TOML writes them ('"fp16"', "true", 2); the
sweep writes the base to job.toml and passes the drawn keys as `--set KEY=VALUE`, so a failing
command names every key it was run with. Some draws are refused by `hpcpar train`'s validation
(more pipeline stages than layers, ZeRO-1 with compression, ...): on purpose, the refusals are
checked too (one `error:` line, exit status 2).
"""
from __future__ import annotations

import random

GPT_BASE = {"model.kind": '"gpt"', "model.block_size": 16, "model.n_layer": 4, "model.n_head": 4, "model.n_embd": 32,
            "data.batch_size": 48, "train.log_interval": 1, "train.eval_interval": 0, "train.sample_tokens": 0,
            "train.metrics": '"metrics.jsonl"', "checkpoint.dir": '"ckpt"', "checkpoint.interval": 2,
            "checkpoint.keep": 5}
CNN_BASE = {"model.kind": '"cnn"', "model.channels": "[4, 8]", "data.kind": '"digits"', "data.batch_size": 48,
            "train.log_interval": 1, "train.eval_interval": 0, "train.metrics": '"metrics.jsonl"',
            "checkpoint.dir": '"ckpt"', "checkpoint.interval": 2, "checkpoint.keep": 5}

# The keys that say how a job is laid out on its ranks, not what it computes: a resume in another
# layout draws these again and keeps the rest.
LAYOUT_KEYS = {"parallel.dp", "parallel.pp", "parallel.tp", "parallel.schedule", "parallel.micro_batches",
               "parallel.chunks", "parallel.partition", "parallel.sequence_parallel", "parallel.zero", "parallel.shm",
               "parallel.node_size", "parallel.overlap", "parallel.bucket_mb", "checkpoint.async", "model.recompute",
               "parallel.reshard_after_forward"}
# Keys of data-parallel all-reduce only: a parameter-server or local-SGD job leaves them out.
ALLREDUCE_KEYS = ("parallel.dp", "parallel.zero", "parallel.compression", "parallel.overlap", "parallel.bucket_mb",
                  "parallel.shm", "parallel.node_size", "parallel.reshard_after_forward")
MODE_KEYS = ("parallel.mode", "parallel.staleness", "parallel.local_steps", "parallel.average_optimizer_state")
SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb1")


def q(text: str) -> str:
    """A TOML string."""
    return f'"{text}"'


def flag(rng: random.Random) -> str:
    return rng.choice(["true", "false"])


def job_toml(keys: dict) -> str:
    """The TOML text of flat ``section.key`` keys."""
    sections: dict[str, list[str]] = {}
    for name, value in keys.items():
        section, key = name.split(".", 1)
        sections.setdefault(section, []).append(f"{key} = {value}")
    return "".join(f"[{section}]\n" + "\n".join(lines) + "\n" for section, lines in sections.items())


def is_gpt(keys: dict) -> bool:
    return keys.get("model.kind", '"gpt"') == '"gpt"'


def layout(rng: random.Random, world: int, gpt: bool, layers: int | None = None) -> dict:
    """A random dp x pp x tp of ``world`` ranks (tp only for the GPT) and how it runs. With
    ``layers``, an interleaved schedule is drawn only where its pp x 2 chunks fit that many layers."""
    grid = [(world // (pp * tp), pp, tp) for pp in (1, 2, 4) for tp in ((1, 2, 4) if gpt else (1,)) if world % (pp * tp) == 0]
    replicated = [shape for shape in grid if shape[0] > 1]
    # dp > 1 half the time where the world allows it: ZeRO-1, compression, shm and the modes need it
    dp, pp, tp = rng.choice(replicated if replicated and rng.random() < 0.5 else grid)
    keys = {"parallel.dp": dp, "parallel.pp": pp, "parallel.tp": tp, "checkpoint.async": flag(rng)}
    if pp > 1:
        schedule = rng.choice([s for s in SCHEDULES if s != "interleaved" or layers is None or 2 * pp <= layers])
        keys["parallel.schedule"] = q(schedule)
        keys["parallel.micro_batches"] = rng.choice([m for m in (2, 4, 8) if schedule != "interleaved" or m % pp == 0])
        if schedule == "interleaved":
            keys["parallel.chunks"] = 2
        if rng.random() < 0.5:
            keys["parallel.partition"] = q(rng.choice(["uniform", "blocks", "parameters", "balanced"]))
    else:
        keys["parallel.micro_batches"] = rng.choice([1, 2])
    if tp > 1:
        keys["parallel.sequence_parallel"] = flag(rng)
    if dp > 1:
        keys |= {"parallel.zero": rng.choice([0, 1, 2, 3]), "parallel.shm": flag(rng), "parallel.overlap": flag(rng),
                 "parallel.bucket_mb": rng.choice([0.01, 1.0, 25.0])}
        if keys["parallel.zero"] == 3:
            keys["parallel.reshard_after_forward"] = flag(rng)
        if keys["parallel.shm"] == "true" and rng.random() < 0.5:
            keys["parallel.node_size"] = rng.choice([1, 2])
    if gpt:
        keys["model.recompute"] = q(rng.choice(["none", "selective", "full"]))
    return keys


DIVERGING_LR = {"fp64": 1e100}  # else 1e4: beyond any precision's range within a few steps, fp64's aside


def options(rng: random.Random, gpt: bool, precisions=("fp32", "bf16", "fp16", "fp64"), diverging: float = 0.2) -> dict:
    """What a job computes, apart from its layout: precision, optimizer, clipping, the model's options,
    what a non-finite step does and, with probability ``diverging``, a learning rate that diverges."""
    precision = rng.choice(precisions)
    keys = {"train.precision": q(precision), "optimizer.name": q(rng.choice(["adamw", "adam", "sgd"])),
            "optimizer.grad_clip": rng.choice([0.0, 0.5]), "lr_schedule.warmup_steps": rng.choice([0, 2]),
            "train.on_nonfinite": q(rng.choice(["stop", "skip", "rewind"]))}
    if rng.random() < diverging:
        keys |= {"optimizer.lr": DIVERGING_LR.get(precision, 1e4), "optimizer.grad_clip": 0.0}
        if rng.random() < 0.5:
            keys["train.max_skipped"] = rng.choice([0, 2])
    if gpt:
        keys |= {"model.dropout": rng.choice([0.0, 0.1]), "model.tie_weights": flag(rng), "model.bias": flag(rng)}
    return keys


def diverges(keys: dict) -> bool:
    """Whether ``keys`` drew a diverging learning rate (a run may then end with exit status 3)."""
    return float(keys.get("optimizer.lr", 0.0)) >= 1e4


def compression(rng: random.Random, keys: dict) -> dict:
    """Gradient compression for a job of dp > 1 without ZeRO (the two are exclusive)."""
    if keys.get("parallel.dp", 1) > 1 and not keys.get("parallel.zero"):
        keys["parallel.compression"] = q(rng.choice(["none", "fp16", "topk", "powersgd"]))
    return keys


def other_mode(rng: random.Random, keys: dict, world: int, local_steps=(2, 3), staleness=(0, 1)) -> dict:
    """A pp = tp = 1 job of ``world`` >= 2 ranks made a parameter-server or local-SGD one (the parameter
    server takes one rank: dp = world - 1); local SGD averages every H steps, H one of ``local_steps``,
    so that checkpoints and stops fall at averages and between them."""
    if world < 2 or keys.get("parallel.pp", 1) != 1 or keys.get("parallel.tp", 1) != 1:
        return keys
    keys = {k: v for k, v in keys.items() if k not in ALLREDUCE_KEYS}
    mode = rng.choice(["ps", "local_sgd"])
    keys["parallel.mode"] = q(mode)
    if mode == "ps":
        keys.pop("checkpoint.async", None)
        if keys.get("train.on_nonfinite") == q("rewind"):  # the servers cannot rewind (refused)
            keys["train.on_nonfinite"] = q("skip")
        keys["parallel.staleness"] = rng.choice(staleness)
    else:
        keys["parallel.local_steps"] = rng.choice(local_steps)
        keys["parallel.average_optimizer_state"] = flag(rng)
    return keys


def gpt_shape(rng: random.Random) -> dict:
    heads = rng.choice([2, 4])
    return {"model.n_layer": rng.choice([1, 2, 4]), "model.n_head": heads, "model.n_embd": heads * rng.choice([4, 8]),
            "model.block_size": rng.choice([8, 16])}


def crash_job(rng: random.Random, world: int) -> tuple[dict, dict]:
    """(base, keys) of a crash combination: a GPT of random shape (two draws in three) or the digits CNN,
    any layout, precision, compression, mode, evaluation, sampling and trace."""
    gpt = rng.random() < 2 / 3
    keys = {**(gpt_shape(rng) if gpt else {}), **layout(rng, world, gpt), **options(rng, gpt)}
    keys = compression(rng, keys)
    if rng.random() < 0.3:
        keys = other_mode(rng, keys, world)
    keys["train.eval_interval"] = rng.choice([0, 2])
    if gpt:
        keys["train.sample_tokens"] = rng.choice([0, 4])
    if rng.random() < 0.3:
        keys["train.trace"] = q("trace.json")
    return (GPT_BASE if gpt else CNN_BASE), keys


def relaid(rng: random.Random, keys: dict, world: int, gpt: bool) -> dict:
    """``keys`` in a new random layout of ``world`` ranks: the same computation, its mode kept where the
    layout allows it (else the checkpoint loads into all-reduce), compression only where dp > 1."""
    kept = {k: v for k, v in keys.items() if k not in LAYOUT_KEYS}
    new = {**kept, **layout(rng, world, gpt)}
    if "parallel.mode" in kept and (world < 2 or new["parallel.pp"] != 1 or new["parallel.tp"] != 1):
        new = {k: v for k, v in new.items() if k not in MODE_KEYS}
    elif "parallel.mode" in kept:
        new = {k: v for k, v in new.items() if k not in ALLREDUCE_KEYS}
        if kept["parallel.mode"] == q("ps"):
            new.pop("checkpoint.async", None)
    if new.get("parallel.dp", 1) == 1 or new.get("parallel.zero"):
        new.pop("parallel.compression", None)
    return new


def equal_jobs(rng: random.Random, world: int, ranks: list[int]) -> tuple[int, dict, int, dict]:
    """(world, keys, world, keys) of an equality combination: fp64, all-reduce, two layouts of the
    same computation (dropout masks are keyed by step and row, so they are the same in both), the
    second in a world size of ``ranks``."""
    common = options(rng, True, precisions=("fp64",), diverging=0.0)
    worlds = world, rng.choice(ranks)
    a, b = ({**layout(rng, size, True, layers=GPT_BASE["model.n_layer"]), **common} for size in worlds)
    return worlds[0], a, worlds[1], b


def resume_job(rng: random.Random, world: int) -> dict:
    """Keys of a stop-and-resume combination in one layout: any precision, compression, local SGD or the
    synchronous parameter server."""
    keys = {**layout(rng, world, True, layers=GPT_BASE["model.n_layer"]), **options(rng, True)}
    keys = compression(rng, keys)
    if rng.random() < 0.4:
        keys = other_mode(rng, keys, world, local_steps=(3, 4, 5), staleness=(0,))
    return keys


def replicas_job(rng: random.Random, world: int) -> dict:
    """Keys of a replica-agreement combination: a layout with dp > 1 or tp > 1 (where copies exist)."""
    while True:
        keys = layout(rng, world, True)
        if keys["parallel.dp"] > 1 or keys["parallel.tp"] > 1:
            break
    keys.pop("checkpoint.async")
    return compression(rng, {**keys, **options(rng, True, precisions=("fp32", "bf16", "fp16"), diverging=0.0)})
