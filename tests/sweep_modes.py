"""The four checks of tests/sweep.py, each one random combination in its own folder.

- crash: a run, its resume in another layout and world size, `--resume STEP --load-weights-only`,
  `--dry-run`, `--resume must`, `--resume never --overwrite`, `hpcpar ckpt ls/verify/inspect/export`
  and `hpcpar generate`: none may end in a traceback, a timeout or an exit status other than 0 or
  2 (2 only as one `error:` line; the checkpoint commands must exit 0). A job that drew a diverging
  learning rate may also end with 3 (`train.on_nonfinite`), as one line naming the step, when
  `hpcpar ckpt verify` then finds every checkpoint it left finite; that ends its combination.
- equal: fp64, a run's step-4 checkpoint resumed in another layout and world size ends, at step
  6, with every model and optimizer tensor within a relative 1e-12 of the uninterrupted run's
  (max |a - b| / max |a| per tensor: the sums of another layout round in another order).
- resume: a run of one layout sent SIGUSR1 at a random moment of its training (after a random
  step's log line, by a random share of a step), resumed; the last checkpoint's
  model/, optim/, compression/ and local_sgd/ tensors are bit for bit the uninterrupted run's
  (unless either rewound for a non-finite step: a rewind reloads the newest checkpoint, and the
  stop added one).
  The asynchronous parameter server (staleness > 0) is left out: its updates apply in the order
  the workers' gradients arrive, which no two runs share, so no two runs are equal.
- replicas: a few steps through the Python API; every copy of every parameter is equal across
  the dp replicas, and across the tp ranks for the parameters each holds whole.
"""
from __future__ import annotations

import json
import os
import random
import re
import shutil
import sys

import numpy as np

from sweep_jobs import (GPT_BASE, crash_job, diverges, equal_jobs, is_gpt, job_toml, q, relaid, replicas_job,
                        resume_job)
from sweep_run import TRAIN_TIMEOUT, hpcpar, mpiexec, run, tensors, timed_train, train

TOLERANCE = 1e-12  # equal: the largest relative difference of a tensor
EXACT = ("model/", "optim/", "compression/", "local_sgd/")  # resume: the tensors compared bit for bit
REPLICAS_WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sweep_replicas.py")
RESUME_STEPS = 10
RESUME_BASE = {**GPT_BASE, "checkpoint.interval": 5}


class Ended(Exception):
    """A combination's verdict, reached before its last command: ``outcome`` is passed, refused or
    defect, ``why`` says what, ``command`` is the last command's Outcome."""

    def __init__(self, outcome: str, why: str, command=None):
        super().__init__(why)
        self.fields = {"outcome": outcome, "why": why}
        if command is not None:
            self.fields |= {"command": command.shell(), "tail": command.tail()}


class Case:
    """One combination: its random draws, its folder, the world sizes it may use and its record."""

    def __init__(self, rng: random.Random, folder: str, ranks: list[int], tokens: str):
        self.rng, self.folder, self.ranks, self.tokens = rng, folder, ranks, tokens
        self.record: dict = {"refused": []}

    def parallel_world(self) -> int:
        """A world size of more than one rank where the sweep's --ranks has one: a first run's."""
        return self.rng.choice([r for r in self.ranks if r > 1] or self.ranks)

    def job_folder(self, name: str, base: dict) -> str:
        """A subfolder holding job.toml: ``base`` (with the sweep's token file for a GPT)."""
        folder = os.path.join(self.folder, name)
        os.makedirs(folder)
        data = {"data.path": q(self.tokens)} if is_gpt(base) else {}
        with open(os.path.join(folder, "job.toml"), "w") as f:
            f.write(job_toml({**base, **data}))
        return folder

    def require(self, outcome, what: str, refused: str = "refused"):
        """``outcome`` of ``what``, which the rest needs: a defect ends the combination, and so does a
        refusal (as ``refused``: "refused" for a first run, else "passed")."""
        self.diverged(outcome, what)
        why = outcome.defect()
        if why:
            raise Ended("defect", f"{what}: {why}", outcome)
        if outcome.rc == 2:
            raise Ended(refused, f"{what} refused: {outcome.error_line()}", outcome)
        return outcome

    def check(self, outcome, what: str, refusal: bool = True):
        """``outcome`` of ``what``, which nothing after needs: a defect ends the combination, a refusal
        is noted."""
        self.diverged(outcome, what)
        why = outcome.defect(refusal)
        if why:
            raise Ended("defect", f"{what}: {why}", outcome)
        if outcome.rc == 2:
            self.record["refused"].append(f"{what}: {outcome.error_line()}")
        return outcome


    def diverged(self, outcome, what: str) -> None:
        """A run that stopped for a non-finite step (exit status 3) ends the combination: passed when
        its job drew a diverging learning rate, said so in one line and left only finite checkpoints."""
        if outcome.rc != 3 or "Traceback" in outcome.stdout + outcome.stderr:
            return
        lines = [line for line in outcome.stderr.splitlines() if re.match(r"hpcpar train: step \d+: ", line)]
        if not diverges(self.record.get("resume_keys") or self.record.get("keys") or {}):
            raise Ended("defect", f"{what}: a non-finite step without a diverging learning rate", outcome)
        if len(lines) != 1:
            raise Ended("defect", f"{what}: exit status 3 with {len(lines)} lines naming the step", outcome)
        root = os.path.join(outcome.folder, "ckpt")
        if os.path.isdir(root) and any(name.startswith("step-") for name in os.listdir(root)):
            verify = run(hpcpar("ckpt", "verify", "ckpt"), outcome.folder)
            if verify.rc != 0:
                raise Ended("defect", f"{what}: a diverged run left a checkpoint that fails verification", verify)
        raise Ended("passed", f"{what} diverged as drawn: {lines[0]}", outcome)


def crash(case: Case) -> None:
    rng = case.rng
    world = case.parallel_world()
    base, keys = crash_job(rng, world)
    case.record |= {"world": world, "keys": keys}
    folder = case.job_folder("run", base)
    case.require(train(folder, world, keys, 4), "run")
    world_b = rng.choice(case.ranks)
    b = relaid(rng, keys, world_b, is_gpt(base))
    if rng.random() < 0.3:
        b["train.max_seconds"] = 0.3
    case.record |= {"resume_world": world_b, "resume_keys": b}
    resumed = case.check(train(folder, world_b, b, 6), "resume in another layout")
    if resumed.rc == 0:
        _later_runs(case, folder, world_b, b)
    _checkpoint_commands(case, folder, is_gpt(base))


def _later_runs(case: Case, folder: str, world: int, keys: dict) -> None:
    """The other ways to start a run, in the resumed run's layout and folder."""
    rng = case.rng
    weights = {**keys, "optimizer.name": q(rng.choice(["adamw", "adam", "sgd"])), "checkpoint.dir": q("other")}
    case.check(train(folder, world, weights, 3, "--resume", "ckpt/step-00000004", "--load-weights-only",
                     "--progress", rng.choice(["bar", "log", "none"])), "--load-weights-only")
    case.check(train(folder, world, keys, 6, "--dry-run"), "--dry-run")
    case.check(train(folder, world, keys, 8, "--resume", "must"), "--resume must")
    case.check(train(folder, world, keys, 2, "--resume", "never", "--overwrite"), "--resume never --overwrite")


def _checkpoint_commands(case: Case, folder: str, gpt: bool) -> None:
    commands = [("ls", "ckpt"), ("verify", "ckpt"), ("inspect", "ckpt"), ("export", "ckpt", "all.h5")]
    for args in commands:
        case.check(run(hpcpar("ckpt", *args), folder), f"ckpt {args[0]}", refusal=False)
    if gpt:
        case.check(run(hpcpar("generate", "ckpt", "--tokens", "4"), folder), "generate", refusal=False)


def copy_step(source: str, target: str, step: int) -> None:
    """``source``'s checkpoint ``step`` as ``target``'s only and latest one: a run stopped there."""
    name = f"step-{step:08d}"
    shutil.copytree(os.path.join(source, "ckpt", name), os.path.join(target, "ckpt", name))
    with open(os.path.join(target, "ckpt", "latest"), "w") as f:
        f.write(name + "\n")


def equal(case: Case) -> None:
    world_a, a, world_b, b = equal_jobs(case.rng, case.parallel_world(), case.ranks)
    case.record |= {"world": world_a, "keys": a, "resume_world": world_b, "resume_keys": b}
    straight = case.job_folder("straight", GPT_BASE)
    case.require(train(straight, world_a, a, 6), "uninterrupted run")
    resumed = case.job_folder("resumed", GPT_BASE)
    copy_step(straight, resumed, 4)
    outcome = case.require(train(resumed, world_b, b, 6), "resume in another layout")
    if "resumed from" not in outcome.stdout:
        raise Ended("defect", "resume in another layout: started afresh", outcome)
    x, y = _final_tensors(case, straight, resumed, 6)
    worst, where = 0.0, None
    names = [n for n in x if n.startswith(("model/", "optim/")) and x[n].dtype.kind == "f"]
    for name in names:
        scale = float(np.max(np.abs(x[name]))) if x[name].size else 0.0
        if name not in y or y[name].shape != x[name].shape:
            raise Ended("defect", f"{name}: missing or reshaped after the resume", outcome)
        difference = float(np.max(np.abs(x[name] - y[name]))) / (scale or 1.0) if x[name].size else 0.0
        if not difference <= worst:  # NaN counts as the worst
            worst, where = (difference if difference == difference else float("inf")), name
    case.record |= {"compared": len(names), "worst": worst, "where": where}
    if worst > TOLERANCE:
        raise Ended("defect", f"{where} differs by {worst:.3g} (relative) from the uninterrupted run", outcome)


def _final_tensors(case: Case, first: str, second: str, step: int) -> tuple[dict, dict]:
    (x, exported_x), (y, exported_y) = tensors(first, step), tensors(second, step)
    case.check(exported_x, "ckpt export", refusal=False)
    case.check(exported_y, "ckpt export", refusal=False)
    return x, y


def resume(case: Case) -> None:
    rng = case.rng
    world = case.parallel_world()
    keys = resume_job(rng, world)
    after = rng.randint(1, RESUME_STEPS - 2)  # SIGUSR1 comes after this step's line, by a share of a step
    share = rng.random()
    case.record |= {"world": world, "keys": keys, "signal_after_step": after, "signal_step_share": round(share, 3)}
    straight = case.job_folder("straight", RESUME_BASE)
    done, seconds = timed_train(straight, world, keys, RESUME_STEPS)
    case.require(done, "uninterrupted run")
    stopped = case.job_folder("stopped", RESUME_BASE)
    first, _ = timed_train(stopped, world, keys, RESUME_STEPS, stop=(after, share * seconds / (RESUME_STEPS - 1)))
    case.require(first, "run sent SIGUSR1", refused="defect")
    stop = re.search(r"stopped at step (\d+)", first.stdout + first.stderr)
    case.record["stopped_at"] = int(stop.group(1)) if stop else None
    outcome = case.require(train(stopped, world, keys, RESUME_STEPS), "resume", refused="defect")
    if any("rewound to step" in o.stdout + o.stderr for o in (done, first, outcome)):
        # a rewind reloads the newest checkpoint, and the stop added one the uninterrupted run lacks
        raise Ended("passed", "rewound: the runs went back to different checkpoints, not compared", outcome)
    x, y = _final_tensors(case, straight, stopped, RESUME_STEPS)
    names = sorted(n for n in x.keys() | y.keys() if n.startswith(EXACT))
    differ = [n for n in names if n not in x or n not in y or x[n].tobytes() != y[n].tobytes()]
    case.record["compared"] = len(names)
    if differ:
        raise Ended("defect", f"{len(differ)} tensors differ after the resume: {', '.join(differ[:4])}", outcome)


def replicas(case: Case) -> None:
    world = case.parallel_world()
    keys = replicas_job(case.rng, world)
    case.record |= {"world": world, "keys": keys}
    folder = case.job_folder("run", GPT_BASE)
    command = mpiexec(world, sys.executable, REPLICAS_WORKER, "job.toml", json.dumps(keys))
    outcome = case.require(run(command, folder, TRAIN_TIMEOUT), "replicas")
    verdicts = [line for line in outcome.stdout.splitlines() if line.startswith('{"differ"')]
    if not verdicts:
        raise Ended("defect", "replicas: no verdict line on stdout", outcome)
    differ = json.loads(verdicts[-1])["differ"]
    if differ:
        raise Ended("defect", f"{len(differ)} parameters differ between copies: {differ[:4]}", outcome)


MODES = {"crash": crash, "equal": equal, "resume": resume, "replicas": replicas}
