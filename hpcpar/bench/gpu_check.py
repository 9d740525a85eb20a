"""``make gpu-check``: one run on a machine with a GPU that tests and measures hpcpar's GPU path.

    python -m hpcpar.bench.gpu_check [--report gpu-check-report.md] [--budget 450]

It needs the system Python with CuPy, torch, mpi4py, h5py (pytest and pytest-mpi for the test
matrix) and NCCL; no network (without ``mpiexec`` it installs the MPICH and mpi4py wheels of
``.whl/`` into ``.gpu-venv``). Parts, each under its own time limit and all within ``--budget``
seconds (``make gpu-check`` kills it at 8 minutes): 1. probe (without a usable GPU it writes "no
GPU: <reason>" and exits 0, 1 when CuPy is installed but fails to import); 2. matrix (the GPU
tests at 1 and 2 ranks per backend); 3. step (a GPT training step in fp32, bf16 and fp16 against
PyTorch CUDA and against its own matrix products replayed alone); 4. bandwidth (all-reduce per backend, 8 B to 256 MiB); 5. checkpoint (device
arrays saved and loaded back, equal). Parts fail independently: a failing part is reported and
the next one runs. docs/gpu.md ("make gpu-check") describes each part, the report and the summary.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SIZES = [8 << (2 * k) for k in range(13)] + [256 << 20]  # 8 B, 32 B, ..., 128 MiB, 256 MiB
SIZES = sorted(set(SIZES))
PRECISIONS = ("fp32", "bf16", "fp16")
BACKENDS = ("mpi-staged", "mpi-cuda-aware", "nccl")


# ----------------------------------------------------------------------------------------
# 1. the probe
# ----------------------------------------------------------------------------------------
def probe() -> dict:
    """What this machine has; ``gpus`` 0 and ``why`` when no GPU is usable.

    Without CuPy it imports nothing else (not even NumPy): "no GPU" works on any Python."""
    facts = {"python": sys.version.split()[0], "cupy": None, "gpus": 0, "why": None, "nccl": False, "torch_cuda": False}
    if importlib.util.find_spec("cupy") is None:
        facts["why"] = "CuPy is not installed"
        facts["torch"] = "installed" if importlib.util.find_spec("torch") else None
        return facts
    from .. import backend

    if backend.cupy_broken():
        facts["why"] = f"CuPy is installed but fails to import ({backend.cupy_broken()}): {backend.CUPY_FIX}"
        facts["broken"] = True
    elif backend.cupy_module() is None:
        facts["why"] = "CuPy is not installed"
    else:
        facts["cupy"] = backend.cupy_module().__version__
        facts["gpus"] = backend.gpu_count()
        facts["why"] = None if facts["gpus"] else "CuPy sees no CUDA device"
    if facts["gpus"]:
        from ..runtime.nccl import nccl_available

        facts["nccl"] = nccl_available()
        facts["gpu_name"] = _gpu_name(backend.cupy_module())
    try:
        import torch

        facts["torch"] = torch.__version__
        facts["torch_cuda"] = bool(torch.cuda.is_available())
    except ImportError:
        facts["torch"] = None
    return facts


def _gpu_name(cupy) -> str:
    try:
        return cupy.cuda.runtime.getDeviceProperties(0)["name"].decode()
    except Exception:  # noqa: BLE001 - a name is decoration
        return "?"


def mpi_facts() -> dict:
    from mpi4py import MPI

    from ..runtime.device_transport import device_nonblocking_supported, library_version, query_cuda_aware

    name, version = library_version()
    return {"library": MPI.Get_library_version().splitlines()[0].strip(), "name": name,
            "version": ".".join(map(str, version)), "cuda_aware": query_cuda_aware(),
            "device_nonblocking": device_nonblocking_supported()}


# ----------------------------------------------------------------------------------------
# Measurements, each usable on any device (the tests run them on the transfer guard)
# ----------------------------------------------------------------------------------------
def allreduce_bandwidth(comm, xp, sizes=SIZES, synchronize=lambda: None, budget_s: float = 60.0) -> list[dict]:
    """Median seconds of an in-place all-reduce of each size in ``sizes`` (bytes of float32; 8 B at
    least two elements), algorithm and bus bandwidth (bus = algorithm x 2(n-1)/n, NCCL-tests' rule)."""
    rows = []
    deadline = time.perf_counter() + budget_s
    for nbytes in sizes:
        x = xp.ones(max(2, nbytes // 4), dtype=xp.float32)
        iterations = 20 if nbytes <= 1 << 20 else 5
        times = []
        for i in range(iterations + 2):
            synchronize()
            comm.barrier()
            start = time.perf_counter()
            comm.allreduce(x, out=x)
            synchronize()
            if i >= 2:  # two untimed warm-ups
                times.append(time.perf_counter() - start)
        seconds = comm.allreduce_object(statistics.median(times), op="max")  # the slowest rank's median
        algorithm = x.nbytes / seconds
        rows.append({"bytes": x.nbytes, "us": seconds * 1e6, "algbw_GBps": algorithm / 1e9,
                     "busbw_GBps": algorithm * 2 * (comm.size - 1) / comm.size / 1e9})
        if comm.allreduce_object(time.perf_counter() > deadline, op="max"):
            break  # every rank stops at the same size
    return rows


def step_times(device: str, precisions=PRECISIONS, steps: int = 10, warmup: int = 3, torch_device: str | None = None,
               config=None, batch_size: int = 8) -> list[dict]:
    """ms/step and tokens/s of a GPT step in each precision, hpcpar on ``device`` and PyTorch on
    ``torch_device`` (same model and batch), and the step's own matrix products replayed alone
    (``bench.roofline``: GEMM-only ms, the step over it), timed in turns; a precision the device
    lacks gets its reason."""
    from .. import backend
    from ..optim import check_precision, precision_named
    from .roofline import recorded_products, replay
    from .step import BENCH_CONFIG, _time_interleaved, hpcpar_step, torch_step

    config = config or BENCH_CONFIG
    sync = _synchronizer(device)
    rows = []
    for precision in precisions:
        try:
            check_precision(device, precision_named(precision))
        except backend.DeviceError as error:
            rows.append({"precision": precision, "error": str(error)})
            continue
        step = hpcpar_step(config, batch_size, precision, device=device)
        step()  # AdamW's state and the pools' blocks made: the step recorded next is a steady one
        with recorded_products() as calls:
            step()
        functions = {"hpcpar": _synced(step, sync), "gemm": _synced(replay(calls), sync)}
        reference = torch_step(config, batch_size, torch_device, precision) if torch_device else None
        if reference is not None:
            functions["pytorch"] = _synced(reference, _torch_synchronizer(torch_device))
        times = _time_interleaved(functions, steps, warmup)
        tokens = batch_size * config.block_size
        seconds = times["hpcpar"][0]
        row = {"precision": precision, "hpcpar_ms": seconds * 1e3, "hpcpar_tokens_s": tokens / seconds,
               "gemm_ms": times["gemm"][0] * 1e3, "vs_gemm": seconds / times["gemm"][0], "products": len(calls)}
        if "pytorch" in times:
            row.update(pytorch_ms=times["pytorch"][0] * 1e3, pytorch_tokens_s=tokens / times["pytorch"][0],
                       ratio=times["hpcpar"][0] / times["pytorch"][0])
        rows.append(row)
    return rows


def _synced(step, sync):
    def timed():
        step()
        sync()
    return timed


def _synchronizer(device: str):
    from .. import backend

    if device == "cpu":
        return lambda: None
    xp = backend.array_module(device)
    return lambda: xp.cuda.Device().synchronize()


def _torch_synchronizer(device: str):
    if device != "cuda":
        return lambda: None
    import torch

    return torch.cuda.synchronize


def checkpoint_roundtrip(ctx, folder: str) -> dict:
    """Save a GPT and its AdamW state that live on ``ctx.device``, load them into fresh ones, compare."""
    from .. import checkpoint
    from ..backend import to_host
    from ..nn.gpt import GPT, GPTConfig
    from ..optim import AdamW

    config = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32, seed=3)
    ids = ctx.xp.asarray([[1, 2, 3, 4, 5, 6, 7, 8]] * 2)
    first, fresh = GPT(config, device=ctx.device), GPT(GPTConfig(**{**vars(config), "seed": 4}), device=ctx.device)
    optimizer = AdamW(first.named_parameters(), lr=1e-3)
    first.loss(ids[:, :-1], ids[:, 1:]).backward()
    optimizer.step()
    start = time.perf_counter()
    checkpoint.save(folder, 1, first, optimizer, ctx)
    saved = time.perf_counter() - start
    loaded_optimizer = AdamW(fresh.named_parameters(), lr=1e-3)
    start = time.perf_counter()
    checkpoint.load(folder, fresh, loaded_optimizer, ctx)
    loaded = time.perf_counter() - start
    saved_pieces, loaded_pieces = ({p.key: p.array for p in model.checkpoint_pieces()[0] + opt.checkpoint_pieces()[0]}
                                   for model, opt in ((first, optimizer), (fresh, loaded_optimizer)))
    equal = saved_pieces.keys() == loaded_pieces.keys() and all(
        (to_host(array) == to_host(loaded_pieces[key])).all() for key, array in saved_pieces.items())
    on_device = all(type(array).__module__.split(".")[0] != "numpy" for array in loaded_pieces.values())
    return {"equal": bool(equal), "on_device": on_device, "save_s": saved, "load_s": loaded,
            "tensors": len(saved_pieces)}


# ----------------------------------------------------------------------------------------
# Workers: the MPI parts, run under mpiexec by the driver
# ----------------------------------------------------------------------------------------
def worker(kind: str, comm_backend: str, out: str, budget_s: float, device: str = "cuda",
           max_bytes: int = SIZES[-1]) -> None:
    from mpi4py import MPI

    from ..runtime.context import init

    ctx = init(device=device, backend="nccl" if comm_backend == "nccl" else "mpi", shm=False)
    if kind == "bandwidth":
        sync = _synchronizer(device)
        sizes = [size for size in SIZES if size <= max_bytes]
        result = {"rows": allreduce_bandwidth(ctx.dp, ctx.xp, sizes, sync, budget_s), "comm": type(ctx.dp).__name__,
                  "cuda_aware": ctx.cuda_aware}
    else:
        folder = ctx.world.bcast_object(tempfile.mkdtemp(prefix="hpcpar-gpu-ckpt-") if ctx.rank == 0 else None)
        result = checkpoint_roundtrip(ctx, folder)
        ctx.world.barrier()
        if ctx.rank == 0:
            shutil.rmtree(folder, ignore_errors=True)
    if MPI.COMM_WORLD.Get_rank() == 0:
        with open(out, "w") as file:
            json.dump(result, file)


# ----------------------------------------------------------------------------------------
# The driver
# ----------------------------------------------------------------------------------------
class Budget:
    """Seconds left of the whole run, and a part's share of them."""

    def __init__(self, seconds: float):
        self.end = time.monotonic() + seconds

    def left(self) -> float:
        return max(0.0, self.end - time.monotonic())

    def share(self, at_most: float) -> float:
        return min(at_most, self.left())


def find_mpiexec(python: str) -> tuple[str, str] | None:
    """(python, mpiexec) that start 2 ranks of one world: the interpreter's own ``mpiexec``, the PATH's,
    else a venv made from the MPICH and mpi4py wheels in ``.whl/`` (system site packages visible).

    Each candidate is tried: a system ``mpiexec`` of another MPI than mpi4py's would start two
    worlds of one rank each."""
    candidates = [os.path.join(os.path.dirname(python), "mpiexec"), shutil.which("mpiexec")]
    for mpiexec in dict.fromkeys(c for c in candidates if c and os.path.exists(c)):
        if _starts_two_ranks(python, mpiexec):
            return python, mpiexec
    wheels = os.path.join(REPO, ".whl")
    if not os.path.isdir(wheels):
        return None
    venv = os.path.join(REPO, ".gpu-venv")
    venv_python = os.path.join(venv, "bin", "python")
    if not os.path.exists(venv_python):
        subprocess.run([python, "-m", "venv", "--system-site-packages", venv], check=True)
        subprocess.run([venv_python, "-m", "pip", "install", "-q", "--no-index", "--find-links", wheels, "mpich",
                        "mpi4py"], check=True)
    mpiexec = os.path.join(venv, "bin", "mpiexec")
    return (venv_python, mpiexec) if _starts_two_ranks(venv_python, mpiexec) else None


def _starts_two_ranks(python: str, mpiexec: str) -> bool:
    probe_code = "from mpi4py import MPI; assert MPI.COMM_WORLD.Get_size() == 2"
    try:
        return subprocess.run([mpiexec, "-n", "2", python, "-c", probe_code], capture_output=True,
                              timeout=60).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def mpi_facts_of(python: str) -> dict:
    """``mpi_facts`` from a process of its own: this one never starts MPI (it launches ``mpiexec``)."""
    code = "import json; from hpcpar.bench.gpu_check import mpi_facts; print(json.dumps(mpi_facts()))"
    done = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=60, env=backend_env("mpi"))
    return json.loads(done.stdout.strip().splitlines()[-1]) if done.returncode == 0 else {}


def backend_env(name: str) -> dict:
    """The environment that makes the communicators of a run use ``name``."""
    env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", ""), "HPCPAR_STALL_S": "60"}
    if name == "mpi-staged":
        env["HPCPAR_CUDA_AWARE"] = "0"
    env["HPCPAR_GPU_BACKEND"] = "nccl" if name == "nccl" else "mpi"
    return env


def available_backends(facts: dict, mpi: dict) -> dict:
    """{backend: None if it runs here, else why not}."""
    return {"mpi-staged": None,
            "mpi-cuda-aware": None if mpi.get("cuda_aware") else "the MPI library is not CUDA-aware",
            "nccl": None if facts["nccl"] else "CuPy has no NCCL"}


def run_matrix(python, mpiexec, backends: dict, gpus: int, budget: Budget) -> list[dict]:
    rows = []
    for name, why_not in backends.items():
        for ranks in (1, 2):
            row = {"backend": name, "ranks": ranks}
            if why_not or (name == "nccl" and ranks > gpus):
                row["result"] = f"skipped: {why_not or 'NCCL needs one GPU per rank'}"
            elif budget.left() < 20:
                row["result"] = "not run: time budget spent"
            else:
                command = [mpiexec, "-n", str(ranks), python, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           "--with-mpi", "-m", "mpi", os.path.join(REPO, "tests", "test_nccl_gpu.py")]
                row.update(_run(command, backend_env(name), budget.share(90)))
            rows.append(row)
    return rows


def _run(command, env, timeout) -> dict:
    start = time.monotonic()
    try:
        done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=timeout, cwd=REPO)
        tail = (done.stdout + done.stderr).strip().splitlines()
        result = (tail[-1] if tail else "ok") if done.returncode == 0 else f"FAILED (exit {done.returncode})"
        return {"result": result, "seconds": time.monotonic() - start, "log": "\n".join(tail[-30:])}
    except subprocess.TimeoutExpired:
        return {"result": f"FAILED: timed out after {timeout:.0f} s", "seconds": timeout, "log": ""}


def run_worker(python, mpiexec, kind, name, ranks, budget: Budget, limit: float, device: str = "cuda",
               max_bytes: int = SIZES[-1]) -> dict:
    if budget.left() < 20:
        return {"result": "not run: time budget spent"}
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as file:
        out = file.name
    seconds = budget.share(limit)
    command = [mpiexec, "-n", str(ranks), python, "-m", "hpcpar.bench.gpu_check", "--worker", kind, "--backend", name,
               "--out", out, "--worker-budget", str(max(5.0, seconds - 30)), "--device", device,
               "--max-bytes", str(max_bytes)]
    status = _run(command, backend_env(name), seconds)
    status["result"] = status["result"] if status["result"].startswith("FAILED") else f"{ranks} rank(s)"
    try:
        with open(out) as file:
            return {**json.load(file), **status}
    except (OSError, ValueError):
        return status
    finally:
        os.unlink(out)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hpcpar.bench.gpu_check", description=__doc__.splitlines()[0])
    parser.add_argument("--report", default="gpu-check-report.md", help="the report file (default: %(default)s)")
    parser.add_argument("--budget", type=float, default=450.0, help="seconds for all parts (default: %(default)s)")
    parser.add_argument("--worker", choices=("bandwidth", "checkpoint"), help=argparse.SUPPRESS)
    parser.add_argument("--backend", choices=BACKENDS, default="nccl", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--worker-budget", type=float, default=60.0, help=argparse.SUPPRESS)
    parser.add_argument("--device", default="cuda", help=argparse.SUPPRESS)  # the tests run the workers on "guard"
    parser.add_argument("--max-bytes", type=int, default=SIZES[-1], help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args.worker, args.backend, args.out, args.worker_budget, args.device, args.max_bytes)
        return 0
    budget = Budget(args.budget)
    facts = probe()
    if not facts["gpus"]:
        write_report(args.report, facts, None)
        print(f"no GPU: {facts['why']}; nothing to check (report: {args.report})")
        return 1 if facts.get("broken") else 0  # a broken CuPy is a problem to fix, not a machine without a GPU
    return check(args.report, facts, budget)


def check(report: str, facts: dict, budget: Budget, device: str = "cuda", step_config=None, steps: int = 10,
          max_bytes: int = SIZES[-1]) -> int:
    """Every part on this machine's GPU 0; the report, the summary; 1 when a part failed.

    ``device``, ``step_config``, ``steps``, ``max_bytes``: the tests run it all on the transfer guard, small."""
    from .. import backend

    if device == "cuda":
        backend.select_gpu(0)
    results = {"commands": {"matrix": "mpiexec -n R python -m pytest -q --with-mpi -m mpi tests/test_nccl_gpu.py "
                                      "(HPCPAR_GPU_BACKEND=mpi|nccl, HPCPAR_CUDA_AWARE=0 for mpi-staged)",
                            "step": "hpcpar.bench.gpu_check.step_times('cuda', torch_device='cuda') in the driver",
                            "workers": "mpiexec -n R python -m hpcpar.bench.gpu_check --worker bandwidth|checkpoint "
                                       "--backend mpi-staged|mpi-cuda-aware|nccl"}}
    found = find_mpiexec(sys.executable)
    mpi = mpi_facts_of(found[0]) if found else {}
    backends = available_backends(facts, mpi)
    if found:
        python, mpiexec = found
        results["matrix"] = run_matrix(python, mpiexec, backends, facts["gpus"], budget)
    else:
        results["matrix"] = [{"backend": "all", "ranks": "-", "result": "skipped: no mpiexec and no .whl/ folder"}]
    try:
        torch_device = ("cuda" if facts["torch_cuda"] else None) if device == "cuda" else "cpu"
        results["step"] = step_times(device, steps=steps, torch_device=torch_device, config=step_config)
        results["reference"] = f"PyTorch {torch_device.upper() if torch_device == 'cuda' else torch_device}"
        if device == "cuda":  # the workers below share the GPU: give back what the step's pool holds
            backend.cupy_module().get_default_memory_pool().free_all_blocks()
    except Exception as error:  # noqa: BLE001 - one part failing must not hide the others
        results["step"] = [{"precision": "all", "error": f"FAILED: {type(error).__name__}: {error}"}]
    results["bandwidth"] = {}
    for name, why_not in backends.items():
        ranks = 1 if name == "nccl" and facts["gpus"] < 2 else 2
        results["bandwidth"][name] = ({"result": f"skipped: {why_not}"} if why_not or not found else
                                      run_worker(python, mpiexec, "bandwidth", name, ranks, budget, 100, device,
                                                 max_bytes))
    results["checkpoint"] = (run_worker(python, mpiexec, "checkpoint", "mpi-staged", 2, budget, 60, device)
                             if found else {"result": "skipped: no mpiexec"})
    write_report(report, facts, results, mpi)
    summary = summarize(facts, results)
    print("\n".join(summary + [f"report: {report}"]))
    return 1 if any("FAILED" in line for line in summary) else 0


def summarize(facts: dict, results: dict) -> list[str]:
    lines = [f"GPU: {facts.get('gpu_name')} x {facts['gpus']}, CuPy {facts['cupy']}, "
             f"NCCL {'yes' if facts['nccl'] else 'no'}"]
    for row in results["matrix"]:
        lines.append(f"tests {row['backend']} at {row['ranks']} rank(s): {row['result']}")
    for row in results["step"]:
        if "error" in row:
            lines.append(f"GPT step {row['precision']}: {row['error']}")
        else:
            ratio = f", {row['ratio']:.2f} x {results.get('reference', 'PyTorch')}" if "ratio" in row else ""
            lines.append(f"GPT step {row['precision']}: {row['hpcpar_ms']:.1f} ms/step{ratio}, "
                         f"{row['vs_gemm']:.2f} x its GEMMs alone ({row['gemm_ms']:.1f} ms)")
    for name, result in results["bandwidth"].items():
        rows = result.get("rows")
        best = f"{max(r['busbw_GBps'] for r in rows):.1f} GB/s bus bandwidth at best" if rows else result["result"]
        lines.append(f"all-reduce {name}: {best}")
    ckpt = results["checkpoint"]
    lines.append("checkpoint of device arrays: " + (("equal after load" if ckpt.get("equal") else "FAILED: not equal")
                                                   if "equal" in ckpt else ckpt["result"]))
    return lines


def write_report(path: str, facts: dict, results: dict | None, mpi: dict | None = None) -> None:
    from .gpu_report import format_report

    with open(path, "w") as file:
        file.write(format_report(facts, results, mpi or {}))


if __name__ == "__main__":
    sys.exit(main())
