"""``hpcpar train JOB.toml``: the training loop for every layout.

    mpiexec -n 4 hpcpar train jobs/gpt-3d.toml --set train.steps=50
    sbatch slurm/train.sbatch jobs/gpt-3d.toml

Per step: this dp replica's rows of the global batch -> engine (forward, backward, gradient
averaging) -> clip -> optimizer -> LR schedule. Rank 0 logs step, loss, learning rate,
tokens/s, the step split into compute / communication / pipeline idle, and peak memory per
rank (a progress bar on a terminal, plain lines otherwise), appends metrics to a JSONL file,
evaluates on the validation split, and checkpoints every ``checkpoint.interval`` steps and at
the end. On SIGTERM or SIGUSR1 (SLURM's warning before the time limit or a preemption) every
rank agrees at the next step boundary, a checkpoint is saved, the job asks SLURM to requeue
it when it runs under SLURM, and every rank exits 0; the requeued job resumes from it.
"""
from __future__ import annotations

import json
import os
import resource
import signal
import subprocess
import sys
import time

import numpy as np

from .. import checkpoint
from ..autograd import no_grad
from ..dist.context import init
from ..parallel.tensor import clip_grad_norm_parallel, counts_toward_norm, sum_over_model_parallel
from .build import Run, build
from .config import Job, JobError

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class StopRequest:
    """Remembers a stop signal; the ranks agree on it at step boundaries (never mid-step).

    The handler only sets a flag: a rank may get the signal several times (from SLURM, from
    the launcher, and SIGTERM again when ``scontrol requeue`` ends the job after the save).
    """

    def __init__(self):
        self.signal = None
        for sig in STOP_SIGNALS:
            signal.signal(sig, self._handle)

    def _handle(self, signum, frame):
        self.signal = signum

    def agreed(self, world) -> bool:
        return bool(world.allreduce(np.array([1.0 if self.signal else 0.0]), "max")[0])


def peak_memory_mb() -> float:
    """This process's peak resident memory (plus the CuPy pool's peak on a GPU)."""
    host = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # KiB on Linux
    try:
        import cupy

        return host + cupy.get_default_memory_pool().total_bytes() / 2**20
    except Exception:  # noqa: BLE001 - no CuPy, no GPU
        return host


class Logger:
    """Rank 0's console and JSONL output."""

    def __init__(self, job: Job, ctx, total_steps: int):
        self.rank0 = ctx.rank == 0
        self.total = total_steps
        self.tty = sys.stdout.isatty()
        self.path = job.train.metrics
        if self.rank0 and self.path:
            os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)

    def record(self, entry: dict) -> None:
        if self.rank0 and self.path:
            with open(self.path, "a") as f:
                f.write(json.dumps(entry) + "\n")

    def line(self, text: str) -> None:
        if self.rank0:
            print(text, flush=True)

    def progress(self, step: int, text: str) -> None:
        if not self.rank0:
            return
        if self.tty:
            done = int(30 * step / self.total)
            print(f"\r[{'#' * done}{'.' * (30 - done)}] {text}", end="", flush=True)
            if step >= self.total:
                print(flush=True)
        else:
            print(text, flush=True)


def evaluate(run: Run) -> float:
    """Mean loss over the fixed evaluation batches (and accuracy for the cnn), over all dp replicas."""
    ctx, model = run.ctx, run.model
    was_training = model.training
    model.eval()
    total, count, correct = 0.0, 0, 0
    with no_grad():
        for inputs, targets in run.eval_data:
            if run.job.model.kind == "cnn":
                logits = model(inputs)
                correct += int((logits.numpy().argmax(axis=1) == targets).sum())
                total += model.loss_from_logits(logits, targets).item() * len(targets)
            else:
                total += run.engine.evaluate_loss(inputs, targets) * len(targets)
            count += len(targets)
    model.train(was_training)
    summed = ctx.dp.allreduce(np.array([total, count, correct], dtype=np.float64), "sum")
    return {"val_loss": summed[0] / summed[1], **({"val_accuracy": summed[2] / summed[1]}
                                                   if run.job.model.kind == "cnn" else {})}


def clip(run: Run, max_norm: float) -> float:
    """Clip by the global norm of the whole model, however it is split; returns the norm.

    Under mixed precision the float32 masters' (unscaled) gradients are clipped; a master
    counts toward the norm where its model parameter does (a weight tied across stages once).
    """
    owns = run.engine.owns_for_norm
    if run.amp is not None:
        run.amp.unscale_grads()
        model_param = {id(master): param for (_, master), param in zip(run.amp.master, run.amp.model_params)}
        owns = lambda master: run.engine.owns_for_norm(model_param[id(master)])  # noqa: E731
    counts = lambda param: counts_toward_norm(param, run.ctx, owns)  # noqa: E731
    if hasattr(run.optimizer, "clip_grad_norm"):  # ZeRO-1: each rank clips its shard by the global norm
        run.optimizer.reduce_gradients()
        return run.optimizer.clip_grad_norm(max_norm, counts=counts, model_parallel_sum=sum_over_model_parallel(run.ctx))
    return clip_grad_norm_parallel(run.named_parameters(), max_norm, run.ctx, owns=owns)


def optimizer_step(run: Run, clipped_zero: bool, loss: float) -> None:
    if run.mode is not None:  # parameter server or local SGD: exchange, clip, step, clear grads
        run.mode.after_backward()
        return
    if run.amp is not None:  # skipped everywhere when the loss or a gradient is not finite on any rank
        run.amp.step(run.optimizer, loss=loss,
                     allreduce_max=lambda v: float(run.ctx.world.allreduce(np.array([v]), "max")[0]),
                     **({"reduce": False} if clipped_zero else {}))
    elif clipped_zero:
        run.optimizer.step(reduce=False)  # the gradients were reduced for clipping already
    else:
        run.optimizer.step()
    run.optimizer.zero_grad()
    for _, param in run.engine.named_parameters():  # the model's own grads (distinct from masters under amp)
        param.grad = None


def save(run: Run, step: int, final: bool = False):
    """Checkpoint ``step``; in a parameter-server job the workers call this and the servers join."""
    c = run.job.checkpoint
    named, optimizer, ctx = run.checkpoint_target
    ps = run.job.parallel.mode == "ps"

    def write():  # a parameter-server job saves synchronously: the servers pause serving for it
        return checkpoint.save(c.dir, step, named, optimizer, ctx, extra=run.extra_state() if run.trains else None,
                               keep=c.keep, asynchronous=c.async_ and not final and not ps)

    if ps and run.trains:
        written = []
        run.mode.ps.save_checkpoint(step, lambda: written.append(write()))
        return written[0]
    return write()


def resume_from_checkpoint(run: Run, resume: bool | None) -> dict | None:
    """Load the latest valid checkpoint, when the job resumes and there is one (collective)."""
    job = run.job
    if not ((job.checkpoint.resume if resume is None else resume) and checkpoint.list_steps(job.checkpoint.dir)):
        return None
    named, optimizer, ctx = run.checkpoint_target
    job_decays = optimizer.named_weight_decays() if hasattr(optimizer, "named_weight_decays") else {}
    info = checkpoint.load_latest(job.checkpoint.dir, named, optimizer, ctx,
                                  extra=run.extra_state() if run.trains else None)
    if info is not None and run.amp is not None:
        run.amp.copy_to_model()
    if info is not None:
        check_weight_decay_groups(job, ctx, job_decays, optimizer)
    return info


def check_weight_decay_groups(job: Job, ctx, job_decays: dict, optimizer) -> None:
    """The checkpoint restores the weight-decay groups it was trained with; a job that asks for other
    ones (optimizer.weight_decay, optimizer.no_decay) fails on every rank instead of being ignored."""
    restored = optimizer.named_weight_decays() if hasattr(optimizer, "named_weight_decays") else {}
    differ = sorted(name for name, value in job_decays.items() if restored.get(name, value) != value)
    differ = sorted(set().union(*ctx.world.allgather_object(differ)))
    if differ:
        raise JobError(job.source, [("optimizer.no_decay", f"the checkpoint in {job.checkpoint.dir} was trained with "
                                     f"another weight decay for {len(differ)} parameter(s) ({', '.join(differ[:3])}"
                                     f"{', ...' if len(differ) > 3 else ''}) than optimizer.weight_decay and "
                                     f"optimizer.no_decay give; resume with the settings it was trained with, or "
                                     f"start anew with checkpoint.resume = false")])


def train(job: Job, resume: bool | None = None, stop: StopRequest | None = None) -> dict:
    p = job.parallel
    stop = stop or StopRequest()
    # A parameter-server job's dp counts the workers only: the world context includes the servers.
    ctx = init(dp=None if p.mode == "ps" else p.dp, pp=p.pp, tp=p.tp, device=job.train.device)
    if ctx.rank == 0:
        print(job.describe(), flush=True)
        print(ctx.grid_table(), flush=True)
    run = build(job, ctx)
    if not run.trains:  # a parameter server: loads with the workers, then serves until each has stopped
        resume_from_checkpoint(run, resume)
        run.mode.ps.on_save = lambda step: save(run, step, final=True)  # when the workers ask
        run.mode.serve()
        run.mode.shutdown()
        return {}
    ctx = run.ctx  # for a parameter-server job: the workers
    logger = Logger(job, ctx, job.train.steps)

    start_step = 0
    info = resume_from_checkpoint(run, resume)
    if info is not None:
        start_step = info["step"]
        logger.line(f"resumed from {info['step_dir']} (written by layout {info['layout']})")

    tokens_per_step = job.data.batch_size * (job.model.block_size if job.model.kind == "gpt" else 1)
    unit = "tok" if job.model.kind == "gpt" else "img"
    last = {"step": start_step}
    began = time.perf_counter()
    step = start_step
    reason = "done"
    while step < job.train.steps:
        t0 = time.perf_counter()
        inputs, targets = run.train_data.batch_at(step)
        run.train_data.step = step + 1
        loss = run.engine.train_step(inputs, targets)
        clipped_zero = False
        if job.optimizer.grad_clip > 0 and run.mode is None:  # the modes clip inside their exchange
            clip(run, job.optimizer.grad_clip)
            clipped_zero = hasattr(run.optimizer, "clip_grad_norm")
        lr = run.optimizer.lr
        exchange_start = time.perf_counter()
        optimizer_step(run, clipped_zero, loss)
        # parameter server / local SGD: their exchange happens here, not inside the engine's step
        exchange_s = time.perf_counter() - exchange_start if run.mode is not None else 0.0
        run.schedule.step()
        step += 1
        step_s = time.perf_counter() - t0
        if step % job.train.log_interval == 0 or step == job.train.steps or step == start_step + 1:
            stats = run.engine.stats
            loss_mean = float(ctx.dp.allreduce(np.array([loss]), "mean")[0])
            memory = ctx.world.allgather_object(round(peak_memory_mb(), 1))
            entry = {"step": step, "loss": loss_mean, "lr": lr, "tokens_per_s": tokens_per_step / step_s,
                     "step_s": step_s, "compute_s": stats.get("compute_s", 0.0),
                     "comm_s": stats.get("comm_s", 0.0) + exchange_s,
                     "idle_s": stats.get("idle_s", 0.0), "peak_mem_mb": memory, "time": time.time()}
            if run.amp is not None:  # steps skipped for a non-finite loss or gradient (the same on every rank)
                entry["skipped_steps"] = run.amp.skipped_steps
            logger.record(entry)
            logger.progress(step, f"step {step:>5}/{job.train.steps}  loss {loss_mean:.4f}  lr {lr:.2e}  "
                                  f"{entry['tokens_per_s']:,.0f} {unit}/s  step {1e3 * step_s:.0f} ms = compute "
                                  f"{1e3 * entry['compute_s']:.0f} + comm {1e3 * entry['comm_s']:.0f} + idle "
                                  f"{1e3 * entry['idle_s']:.0f}  mem {max(memory):.0f} MB")
            last = entry
        if job.train.eval_interval and step % job.train.eval_interval == 0 and step < job.train.steps:
            metrics = evaluate(run)
            logger.record({"step": step, **metrics})
            logger.line(f"step {step}: " + ", ".join(f"{k} {v:.4f}" for k, v in metrics.items()))
        local_steps = job.parallel.local_steps if job.parallel.mode == "local_sgd" else 1
        if (job.checkpoint.interval and step % job.checkpoint.interval == 0 and step < job.train.steps
                and step % local_steps == 0):  # local SGD: right after an average
            save(run, step)
        out_of_time = job.train.max_seconds is not None and time.perf_counter() - began > job.train.max_seconds
        if stop.agreed(ctx.world) or bool(ctx.world.allreduce(np.array([float(out_of_time)]), "max")[0]):
            reason = f"signal {signal.Signals(stop.signal).name}" if stop.signal else "train.max_seconds"
            break

    final_save = step > start_step or reason != "done"
    servers_save_first = job.parallel.mode == "ps"  # while the servers still serve
    if final_save and servers_save_first:
        logger.line(f"checkpoint {save(run, step, final=True)}")
    if run.mode is not None:
        run.mode.shutdown()  # stop the servers / the last parameter average: the replicas agree again
    if final_save and not servers_save_first:
        logger.line(f"checkpoint {save(run, step, final=True)}")
    checkpoint.wait()
    if reason != "done":
        logger.line(f"stopped at step {step} ({reason}); checkpoint saved")
        if stop.signal is not None and os.environ.get("SLURM_JOB_ID"):
            ctx.world.barrier()  # requeueing ends the job at once: every rank must be done first
            if ctx.rank == 0:
                request_requeue(os.environ["SLURM_JOB_ID"])
        return {**last, "stopped": reason}

    metrics = evaluate(run)
    logger.record({"step": step, **metrics})
    logger.line(", ".join(f"{k} {v:.4f}" for k, v in metrics.items()) + f" after {step} steps")
    if job.model.kind == "gpt" and job.train.sample_tokens:
        text = sample_text(run, job.train.sample_tokens)
        logger.line("--- sampled from the model ---\n" + text + "\n------------------------------")
    return {**last, **metrics}


def request_requeue(job_id: str) -> None:
    """Ask SLURM to run this job again (it resumes from the checkpoint just written)."""
    result = subprocess.run(["scontrol", "requeue", job_id], capture_output=True, text=True)
    print(f"requeue of SLURM job {job_id}: " + ("requested" if result.returncode == 0 else result.stderr.strip()),
          flush=True)


def sample_text(run: Run, tokens: int) -> str:
    """Sample from the trained model; with pipeline stages the last checkpoint is read whole on rank 0."""
    from ..data.corpus import stdlib_corpus

    ctx = run.ctx
    prompt = stdlib_corpus(4096)[:16][None, :].astype(np.int64)  # the first bytes of the stdlib's first file
    rng = np.random.default_rng(run.job.train.seed)
    if ctx.pp_size == 1:
        ids = run.model.generate(prompt, tokens, temperature=0.8, top_k=40, rng=rng)
    else:
        ids = None
        if ctx.rank == 0:
            from ..dist.context import single_process
            from ..nn.gpt import GPT

            whole = GPT(run.job.gpt_config(), dtype=np.float32)
            checkpoint.load(run.job.checkpoint.dir, whole, None, single_process(), strict=True)
            ids = whole.generate(prompt, tokens, temperature=0.8, top_k=40, rng=rng)
    if ctx.rank != 0:
        return ""
    return bytes(np.asarray(ids[0]).astype(np.uint8).tolist()).decode("utf-8", errors="replace")
