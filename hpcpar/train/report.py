"""What rank 0 tells the user during training: log lines, progress, the metrics file, peak memory."""
from __future__ import annotations

import json
import os
import resource
import time

from .. import log
from .expert_load import LoadWatch, scalars, summary
from .progress import Progress

logger = log.get_logger(__name__)


def peak_memory_mb(device_peak_bytes: int = 0) -> float:
    """This process's peak resident memory plus ``device_peak_bytes`` (a GPU's, ``DevicePeak``)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0 + device_peak_bytes / 2**20  # KiB on Linux


class DevicePeak:
    """The most GPU memory this process's arrays held at once while it is entered (``with``).

    CuPy's pool reports only its current use (``used_bytes``) and size (``total_bytes``), so a
    memory hook (``cupy.cuda.MemoryHook``) follows every allocation from the pool and every
    release back to it, starting from the use at entry. Hooks are per thread: memory freed by
    another thread is not subtracted, which can only raise the peak. 0 off a GPU.
    """

    def __init__(self, device: str):
        self.used = self.peak = 0
        self._hook = _peak_hook(self) if device == "cuda" else None

    def add(self, nbytes: int) -> None:
        self.used += nbytes
        self.peak = max(self.peak, self.used)

    def __enter__(self) -> "DevicePeak":
        if self._hook is not None:
            import cupy

            self.used = self.peak = cupy.get_default_memory_pool().used_bytes()
            self._hook.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self._hook is not None:
            self._hook.__exit__(*exc)


def _peak_hook(peak: DevicePeak):
    import cupy

    class PeakHook(cupy.cuda.MemoryHook):
        name = "hpcpar_device_peak"

        def malloc_postprocess(self, **kwargs):  # device_id, size, mem_size, mem_ptr, pmem_id
            peak.add(kwargs["mem_size"])

        def free_postprocess(self, **kwargs):  # device_id, mem_size, mem_ptr, pmem_id
            peak.add(-kwargs["mem_size"])

    return PeakHook()


class Logger:
    """Rank 0's output of a run: log lines, the progress display, the metrics file, TensorBoard.

    Lines go through ``hpcpar.log`` (rank 0 by default, ``--log-ranks``); progress is a live bar
    or lines with elapsed time and ETA (``progress.Progress``); records are appended to
    ``train.metrics`` (JSONL) and, with ``train.tensorboard``, written as TensorBoard scalars.
    A run's first record, ``{"event": "start", ...}``, names the job, its layout and throughput
    unit, so that ``hpcpar plot`` can tell runs and resumed segments apart.
    """

    def __init__(self, job, ctx, total_steps: int, progress: str = "auto"):
        self.rank0 = ctx.rank == 0
        self.job, self.total = job, total_steps
        self.unit = "tok" if job.model.kind == "gpt" else "img"
        self.path = job.train.metrics
        self.tensorboard = None  # opened by begin, with the metrics file's folder: after the resume verdict
        self.progress = Progress(progress, total_steps, self.unit, show=self.rank0)
        self.every_loss = False  # set by begin: whether rank 0 shows a bar
        self.device_peak = DevicePeak(ctx.device).__enter__()  # left by close
        moe = job.moe_config() is not None
        self.load_watch = LoadWatch(job.moe.load_warning) if moe and self.rank0 else None

    def peak_memory_mb(self) -> float:
        """This rank's peak memory so far: resident on the host, plus the GPU's while training."""
        return peak_memory_mb(self.device_peak.peak)

    def begin(self, ctx, start_step: int, resumed_from: str | None, identity: dict | None = None) -> None:
        """The run's start record, and the progress display from ``start_step`` on.

        A fresh run starts a new metrics file (an old one is renamed with its own run id); a
        resumed run appends a ``{"event": "resume", "step": N}`` record to its run's file. Nothing is
        written before: a start that is refused leaves no folder behind."""
        self.open_outputs()
        name = os.path.splitext(os.path.basename(self.job.source))[0]
        run_id = ((identity or {}).get("provenance") or {}).get("run_id")
        if resumed_from is None:
            self.set_aside_old_metrics()
        else:
            self.record({"event": "resume", "step": start_step, "from": resumed_from, "run_id": run_id,
                         "time": time.time()})
        self.record({"event": "start", "step": start_step, "job": name, "layout": ctx.layout,
                     "unit": "tokens" if self.unit == "tok" else "images", "resumed_from": resumed_from,
                     "run_id": run_id, "time": time.time()})
        self.progress.begin(start_step)
        self.every_loss = ctx.world.bcast_object(self.progress.live, root=0)  # a bar shows every step's loss

    def open_outputs(self) -> None:
        """Rank 0: the metrics file's folder, and the TensorBoard writer (which makes its own)."""
        if self.rank0 and self.path:
            os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
        if self.rank0 and self.job.train.tensorboard and self.tensorboard is None:
            from .tensorboard import TensorBoardWriter

            self.tensorboard = TensorBoardWriter(self.job.train.tensorboard)

    def set_aside_old_metrics(self) -> None:
        """Rank 0, at a fresh start: rename an existing metrics file ``NAME.RUNID.jsonl`` (its run's id,
        from its first record; else its time), so that one file holds one run."""
        if not (self.rank0 and self.path and os.path.exists(self.path)):
            return
        try:
            with open(self.path) as f:
                first = json.loads(f.readline() or "{}")
        except ValueError:
            first = {}
        old_id = first.get("run_id") or time.strftime("%Y%m%d-%H%M%S", time.localtime(os.path.getmtime(self.path)))
        stem, ext = os.path.splitext(self.path)
        target, n = f"{stem}.{old_id}{ext}", 1
        while os.path.exists(target):
            target, n = f"{stem}.{old_id}-{n}{ext}", n + 1
        os.rename(self.path, target)
        logger.info(f"a new run: the previous metrics file is now {target}")

    def record(self, entry: dict) -> None:
        if self.rank0 and self.path:
            with open(self.path, "a") as f:
                f.write(json.dumps(entry) + "\n")
        if self.tensorboard is not None:
            self.tensorboard.record({**entry, **scalars(entry["moe"])} if "moe" in entry else entry)

    def line(self, text: str) -> None:
        logger.info(text)

    def step(self, entry: dict) -> None:
        """A logged step's record: to the metrics file, and a progress line in log mode (with the
        expert load of an MoE model, and its warning when one expert keeps too many tokens)."""
        self.record(entry)
        moe = f"  {summary(entry['moe'])}" if "moe" in entry else ""
        self.progress.line(entry["step"], f"step {entry['step']:>5}/{self.total}  loss {entry['loss']:.4f}  "
                                          f"lr {entry['lr']:.2e}  {entry['tokens_per_s']:,.0f} {self.unit}/s  step "
                                          f"{1e3 * entry['step_s']:.0f} ms = compute {1e3 * entry['compute_s']:.0f} + "
                                          f"comm {1e3 * entry['comm_s']:.0f} + idle {1e3 * entry['idle_s']:.0f}  "
                                          f"mem {max(entry['peak_mem_mb']):.0f} MB{moe}")
        if self.load_watch is not None:
            for text in self.load_watch.update(entry["step"], entry["moe"]):
                logger.warning(text)

    def close(self) -> None:
        """The bar ends, the console is the console again, TensorBoard's file is closed (twice is fine)."""
        self.progress.close()
        self.device_peak.__exit__(None, None, None)
        if self.tensorboard is not None:
            self.tensorboard.close()
            self.tensorboard = None

    def __enter__(self) -> "Logger":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
