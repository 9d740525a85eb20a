"""The report of ``make gpu-check`` (``hpcpar.bench.gpu_check``) as Markdown; docs/gpu.md describes it."""
from __future__ import annotations

import datetime
import platform


def _table(headers: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def _size(nbytes: int) -> str:
    for unit, shift in (("MiB", 20), ("KiB", 10)):
        if nbytes >= 1 << shift:
            return f"{nbytes >> shift} {unit}"
    return f"{nbytes} B"


def format_report(facts: dict, results: dict | None, mpi: dict) -> str:
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    torch = f"torch {facts.get('torch') or '-'} (CUDA: {'yes' if facts['torch_cuda'] else 'no'})"
    head = [f"# hpcpar GPU check, {when}", "",
            f"host {platform.node()}, Python {facts['python']}, CuPy {facts['cupy'] or '-'}, {torch}", ""]
    if results is None:
        return "\n".join(head + [f"no GPU: {facts['why']}", "", "Nothing was run or measured.", ""])
    head += [f"GPU 0: {facts.get('gpu_name')} ({facts['gpus']} visible); NCCL through CuPy: "
             f"{'yes' if facts['nccl'] else 'no'}",
             f"MPI: {mpi.get('library', '-')}; CUDA-aware: {'yes' if mpi.get('cuda_aware') else 'no'}; non-blocking "
             f"collectives on device buffers: {'yes' if mpi.get('device_nonblocking') else 'no'}", ""]
    return "\n".join(head + _matrix(results) + _step(results) + _bandwidth(results) + _checkpoint(results))


def _matrix(results: dict) -> list[str]:
    rows = [[r["backend"], r["ranks"], r["result"], f"{r['seconds']:.0f}" if "seconds" in r else "-"]
            for r in results["matrix"]]
    logs = [f"\n<details><summary>{r['backend']} at {r['ranks']} rank(s)</summary>\n\n```\n{r['log']}\n```\n</details>"
            for r in results["matrix"] if r.get("log") and "FAILED" in r["result"]]
    return ["## 1. GPU tests (tests/test_nccl_gpu.py)", "", f"`{results['commands']['matrix']}`", "",
            _table(["backend", "ranks", "result", "seconds"], rows), *logs, ""]


def _step(results: dict) -> list[str]:
    rows = []
    for r in results["step"]:
        if "error" in r:
            rows.append([r["precision"], r["error"], "", "", "", "", "", ""])
        else:
            rows.append([r["precision"], f"{r['hpcpar_ms']:.2f}", f"{r['hpcpar_tokens_s']:.0f}",
                         f"{r['gemm_ms']:.2f}", f"{r['vs_gemm']:.2f}",
                         f"{r['pytorch_ms']:.2f}" if "pytorch_ms" in r else "-",
                         f"{r['pytorch_tokens_s']:.0f}" if "pytorch_tokens_s" in r else "-",
                         f"{r['ratio']:.2f}" if "ratio" in r else "-"])
    return ["## 2. GPT training step on the GPU", "",
            "n_layer 4, n_head 4, n_embd 256, block 128, batch 8, vocab 256; forward, backward, AdamW; medians of 10 "
            "steps after 3 warm-ups, the two frameworks taking turns, each step ended by a device synchronize. "
            "16 bits: float32 masters (hpcpar MixedPrecision, PyTorch autocast); fp16 with loss scale 1024. "
            "GEMM-only: the hpcpar step's own matrix products (recorded from one step) replayed alone, taking "
            "turns with the steps (`hpcpar bench roofline` on the GPU).", "",
            f"`{results['commands'].get('step', '')}`", "",
            _table(["precision", "hpcpar ms/step", "hpcpar tokens/s", "GEMM-only ms", "hpcpar / GEMM-only",
                    "PyTorch ms/step", "PyTorch tokens/s", "hpcpar / PyTorch"], rows), ""]


def _bandwidth(results: dict) -> list[str]:
    out = ["## 3. All-reduce bandwidth", "", "In-place all-reduce of float32, median of 20 calls (5 above 1 MiB) after "
           "2 warm-ups, the slowest rank's; bus bandwidth = algorithm bandwidth x 2(n-1)/n (NCCL-tests' rule).", "",
           f"`{results['commands']['workers']}`", ""]
    for name, result in results["bandwidth"].items():
        out.append(f"### {name}")
        if "rows" not in result:
            out += ["", result.get("result", "-"), ""]
            continue
        rows = [[_size(r["bytes"]), f"{r['us']:.1f}", f"{r['algbw_GBps']:.3f}", f"{r['busbw_GBps']:.3f}"]
                for r in result["rows"]]
        out += ["", f"communicator: {result['comm']}; {result['result']}", "",
                _table(["size", "us", "algorithm GB/s", "bus GB/s"], rows), ""]
    return out


def _checkpoint(results: dict) -> list[str]:
    ckpt = results["checkpoint"]
    if "equal" not in ckpt:
        return ["## 4. Checkpoint of device arrays", "", ckpt.get("result", "-"), ""]
    return ["## 4. Checkpoint of device arrays", "",
            f"{ckpt['tensors']} tensors (a GPT's parameters and their AdamW moments) saved from the GPU at 2 ranks "
            f"and loaded into a fresh model and optimizer: {'equal' if ckpt['equal'] else 'NOT EQUAL'}; loaded onto "
            f"the device: "
            f"{'yes' if ckpt['on_device'] else 'no'}; save {ckpt['save_s']:.2f} s, load {ckpt['load_s']:.2f} s.", ""]
