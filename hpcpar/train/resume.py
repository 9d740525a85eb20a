"""How a run starts: fresh, or from a checkpoint, by the resume policy; never by accident.

| policy (``--resume``, ``checkpoint.resume``) | dir holds no checkpoint | dir holds this run's | dir holds another run's |
|---|---|---|---|
| ``auto`` (default)  | starts fresh, says so | resumes from ``latest`` | refused (exit 2) |
| ``never``           | starts fresh | refused; ``--overwrite`` moves them aside | the same |
| ``must``            | refused | resumes | refused |
| a step folder PATH  | resumes from PATH | resumes from PATH | refused; ``--overwrite`` moves them aside |

"This run" is decided by the fingerprint (``identity``): model, data, optimizer kind and
precision. ``--load-weights-only`` (with PATH) takes the model's weights only, from a run of
any data and optimizer, and starts a new run at step 0. Rank 0 decides from the manifests and
every rank learns the verdict, so a refusal is the same on every rank (exit 2) before anything
is written or loaded.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field

from ..checkpoint.manifest import CheckpointError, MANIFEST, latest_step, list_steps, read_manifest, step_dirname
from . import identity
from .config import JobError
from .config_types import RESUME_MODES

class ResumeRefused(JobError):
    """A start the policy refuses: one message (every difference and the ways out), exit 2 on every rank."""

    def __init__(self, source: str, message: str):
        ValueError.__init__(self, f"{source}: {message}")
        self.source, self.problems = source, [("checkpoint.resume", message)]


@dataclass
class Request:
    """What the command line asks: the policy (None: the job's), ``--overwrite``, ``--load-weights-only``."""
    mode: str | None = None
    overwrite: bool = False
    weights_only: bool = False


@dataclass
class Decision:
    """Rank 0's verdict, the same on every rank: what to load (nothing: a fresh run) and what to say."""
    load: str | None = None  # a checkpoint root (its latest loadable step) or a step folder
    from_root: bool = False
    weights_only: bool = False
    move_aside: str | None = None  # a fresh run's dir holds checkpoints: moved to this folder first
    run_id: str | None = None
    lines: list = field(default_factory=list)
    error: str | None = None


def decide(job, request: Request, current: dict) -> Decision:
    """The verdict for ``job`` (rank 0 alone: it reads manifests); ``current`` is this job's fingerprint."""
    mode = request.mode if request.mode is not None else job.checkpoint.resume
    root = job.checkpoint.dir
    if request.weights_only and mode in RESUME_MODES:
        return Decision(error=f"--load-weights-only takes the weights of a step folder: --resume PATH "
                              f"--load-weights-only (got --resume {mode})")
    if request.overwrite and mode in ("auto", "must"):
        return Decision(error=f"--overwrite starts a new run in {root}: use it with --resume never (or a step "
                              f"folder), not {mode}")
    steps = list_steps(root)
    if mode == "never":
        return _fresh(root, steps, request, mode, source=None)
    if request.weights_only:
        problem = _not_a_step_folder(mode, root) or _other_model(mode, current)
        return Decision(error=problem) if problem else _fresh(root, steps, request, mode, source=mode)
    if mode in ("auto", "must"):
        if not steps:
            if mode == "must":
                return Decision(error=f"--resume must: no checkpoint in {root} (nothing to continue); start the "
                                      f"run with --resume auto or never")
            return Decision(lines=[f"starting fresh: no checkpoint in {root}"], run_id=identity.new_run_id())
        return _continue(job, root, _newest_manifest(root, steps), current, from_root=True)
    return _from_step_folder(job, mode, root, steps, current, request.overwrite)


def _fresh(root: str, steps: list, request: Request, mode: str, source: str | None) -> Decision:
    """A new run in ``root``: refused over checkpoints unless ``--overwrite``, which moves them aside."""
    decision = Decision(run_id=identity.new_run_id())
    if steps:
        if not request.overwrite:
            return Decision(error=f"{root} holds checkpoints (steps {_listed(steps)}) and --resume {mode} starts a "
                                  f"new run; nothing was changed. Continue that run with --resume auto, start this one "
                                  f"in another folder (--set checkpoint.dir=...), or pass --overwrite to move the old "
                                  f"checkpoints aside (they are kept, renamed)")
        decision.move_aside = aside_name(root)
        decision.lines.append(f"--overwrite: moving {root} (steps {_listed(steps)}) aside to {decision.move_aside}; "
                              f"nothing is deleted")
    if source is not None:
        decision.load, decision.weights_only = moved(source, root, decision.move_aside), True
    else:
        decision.lines.append(f"starting fresh in {root} (--resume never)")
    return decision


def _from_step_folder(job, path: str, root: str, steps: list, current: dict, overwrite: bool) -> Decision:
    """``--resume PATH``: continue from a step folder; ``root`` must be empty or hold the same run
    (``--overwrite``: another run's checkpoints there are moved aside first)."""
    if problem := _not_a_step_folder(path, root):
        return Decision(error=problem)
    decision = _continue(job, path, _manifest_or_error(path), current, from_root=False)
    if decision.error or not steps or os.path.abspath(os.path.dirname(path)) == os.path.abspath(root):
        return decision
    theirs = _newest_manifest(root, steps)
    if isinstance(theirs, dict) and not identity.differences(_print_of(theirs), current):
        return decision
    if not overwrite:
        return Decision(error=f"{root} holds checkpoints (steps {_listed(steps)}) of another run than {path}; "
                              f"continuing there would mix two runs; nothing was changed. Choose another "
                              f"checkpoint.dir, or pass --overwrite to move them aside (they are kept, renamed)")
    decision.move_aside = aside_name(root)
    decision.load = moved(path, root, decision.move_aside)
    decision.lines.append(f"--overwrite: moving {root} (steps {_listed(steps)}, another run's) aside to "
                          f"{decision.move_aside}; nothing is deleted")
    return decision


def moved(path: str, root: str, aside: str | None) -> str:
    """Where ``path`` is once ``root`` has been renamed ``aside`` (unchanged when it is outside root)."""
    inside = os.path.abspath(path).startswith(os.path.abspath(root) + os.sep)
    return os.path.join(aside, os.path.relpath(path, root)) if aside and inside else path


def _not_a_step_folder(path: str, root: str) -> str | None:
    if os.path.isfile(os.path.join(path, MANIFEST)):
        return None
    return (f"--resume {path}: not a step folder (no {MANIFEST} in it); give a step folder such as "
            f"{os.path.join(root, step_dirname(100))}, or auto, never, must")


def _other_model(path: str, current: dict) -> str | None:
    """Why the weights of ``path`` do not fit this job's model (None: they do). A dense model's
    weights fit the same model with MoE blocks: their MLPs become every expert (``checkpoint.upcycle``)."""
    manifest = _manifest_or_error(path)
    if isinstance(manifest, str):
        return f"--resume {path}: {manifest}"
    saved = _print_of(manifest)
    if "moe" in current.get("model", {}) and "moe" not in (saved.get("model") or {}):  # sparse upcycling
        current = {**current, "model": {k: v for k, v in current["model"].items() if k != "moe"}}
    different = identity.differences(saved, current, parts=identity.WEIGHTS_ONLY)
    if not different:
        return None
    return (f"--load-weights-only: {path} holds another model; it differs in:\n"
            + "".join(f"    {line}\n" for line in different) + "  nothing was loaded, written or deleted")


def _continue(job, source: str, manifest, current: dict, from_root: bool) -> Decision:
    """Resume from ``source`` when its fingerprint is this job's; else the refusal naming every difference."""
    if isinstance(manifest, str):  # no manifest reads: damage, for the loader to report (nothing will load)
        return Decision(load=source, from_root=from_root, run_id=identity.new_run_id(),
                        lines=[f"{source}: no manifest reads ({manifest})"])
    saved = _print_of(manifest)
    different = identity.differences(saved, current)
    if different:
        where = source if from_root else os.path.dirname(source)
        return Decision(error=f"{source} holds another run's checkpoint (step {manifest['step']}); it differs in:\n"
                              + "".join(f"    {line}\n" for line in different)
                              + f"  nothing was loaded, written or deleted. Start this run in another folder "
                                f"(--set checkpoint.dir=...), or here with --resume never --overwrite (the old "
                                f"checkpoints of {where} are moved aside, not deleted)")
    extra = manifest.get("extra", {})
    run_id = (extra.get("provenance", {}).get("value") or {}).get("run_id") or identity.new_run_id()
    return Decision(load=source, from_root=from_root, run_id=run_id)


def _print_of(manifest: dict) -> dict:
    """A checkpoint's fingerprint (from before fingerprints: its model config, the one part it kept)."""
    extra = manifest.get("extra", {})
    saved = (extra.get("fingerprint") or {}).get("value")
    if saved is None:
        return {"model": (extra.get("model_config") or {}).get("value")}
    return saved


def _newest_manifest(root: str, steps: list):
    """The manifest of the step ``latest`` names (else the newest that reads), or what is wrong with them."""
    pointed = latest_step(root)
    order = ([pointed] if pointed in steps else []) + [s for s in reversed(steps) if s != pointed]
    problems = []
    for step in order:
        try:
            return read_manifest(os.path.join(root, step_dirname(step)))
        except CheckpointError as error:
            problems.append(str(error))
    return "; ".join(problems)


def _manifest_or_error(path: str):
    try:
        return read_manifest(path)
    except CheckpointError as error:
        return str(error)


def _listed(steps: list) -> str:
    return ", ".join(map(str, steps[:5])) + (f", ... ({len(steps)} in all)" if len(steps) > 5 else "")


def aside_name(root: str) -> str:
    """A new sibling name for ``root``'s old checkpoints: ``ROOT.old-1``, ``ROOT.old-2``, ..."""
    base, n = os.path.normpath(root) + ".old", 1
    while os.path.exists(f"{base}-{n}"):
        n += 1
    return f"{base}-{n}"


# ----- executing the verdict (collective) -----------------------------------------------------------
def agree(run, request: Request, current: dict, lock=None) -> Decision:
    """Rank 0 decides, every rank gets the verdict; a refusal raises ``ResumeRefused`` on every rank.
    ``lock`` (rank 0's run lock, in the root) moves on to the new root when the old one is moved aside."""
    world = run.strategy.world_ctx.world
    decision = decide(run.job, request, current) if world.rank == 0 else None
    decision = world.bcast_object(decision, root=0)
    if decision.error:
        raise ResumeRefused(run.job.source, decision.error)
    if decision.move_aside and world.rank == 0:
        os.rename(run.job.checkpoint.dir, decision.move_aside)
        if lock is not None:
            lock.moved()
    world.barrier()
    return decision


def load(run, decision: Decision) -> dict | None:
    """Load what the verdict names (collective); None for a fresh run. Damage falls back to an older
    step under a root; when nothing loads, the run stops (exit 2) instead of starting over a used folder.
    A load that does not fit (names, shapes, dtypes) fails on every rank alike: one line, exit 2."""
    if decision.load is None:
        return None
    try:
        info = _load(run, decision)
    except CheckpointError as error:
        raise ResumeRefused(run.job.source, f"{error}; nothing was loaded or written. Start a new run with "
                                            f"--resume never --overwrite, or use another checkpoint.dir") from None
    if info is None:
        raise ResumeRefused(run.job.source, f"no checkpoint in {decision.load} loads (see the warnings above); nothing "
                                            f"was written. Repair or remove the damaged steps (hpcpar ckpt verify), or "
                                            f"start a new run with --resume never --overwrite")
    return info


def _load(run, decision: Decision) -> dict | None:
    if decision.weights_only:  # a new run from step 0 (``source_step``: where the weights come from)
        info = run.strategy.load_weights(decision.load)
        return {**info, "source_step": info["step"], "step": 0}
    if decision.from_root:
        return run.strategy.load_latest(decision.load, run.checkpoint_extra())
    return run.strategy.load_step(decision.load, run.checkpoint_extra())

