"""The deepest GPT each ZeRO stage trains under a per-rank memory limit (address space or a cgroup).

    python bench/zero_memory_limit.py TOKENS.h5 [--ranks 4] [--limit-mb 600] [--n-embd 256] [--kind cgroup]

For stages 0 (DDP) to 3 at dp = ranks: `hpcpar train jobs/gpt-dp.toml` of a GPT of the given
width (block 64, 2 rows per rank, AdamW fp32, the shared-memory path off so every buffer is the
rank's own) for 2 steps and its final checkpoint, each rank under the limit: `ulimit -v`
(``address-space``: everything mapped counts, ZeRO-3's unit mappings too, dropped pages or not)
or its own cgroup v1 memory controller (``cgroup``, as root: resident memory, as SLURM limits
it; over it, the kernel kills the rank). n_layer grows by 4 until a run fails, then by 1 from
the last that trained. Prints the deepest that trained per stage and the first error (or exit)
of the depth that did not. The limit includes what a rank holds before training (Python, NumPy,
MPI: find it with a small --limit-mb first).
"""
import argparse
import os
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BIN = os.path.dirname(sys.executable)


CGROUPS = "/sys/fs/cgroup/memory"


def limited(command: str, kind: str, limit_mb: int, tag: str) -> str:
    """A rank's shell line: ``command`` under the limit (each rank its own cgroup, by PMI_RANK)."""
    if kind == "address-space":
        return f"ulimit -v {limit_mb * 1024}; exec {command}"
    group = f"{CGROUPS}/hpcpar-{tag}-$PMI_RANK"
    return (f"mkdir -p {group} && echo {limit_mb << 20} > {group}/memory.limit_in_bytes && "
            f"echo $$ > {group}/cgroup.procs && exec {command}")


def remove_cgroups(tag: str) -> None:
    for name in os.listdir(CGROUPS) if os.path.isdir(CGROUPS) else []:
        if name.startswith(f"hpcpar-{tag}-"):
            os.rmdir(os.path.join(CGROUPS, name))


def trains(tokens: str, ranks: int, limit_mb: int, stage: int, n_layer: int, n_embd: int,
           kind: str = "address-space") -> tuple[bool, str]:
    with tempfile.TemporaryDirectory() as folder:
        sets = {"data.path": f'"{tokens}"', "checkpoint.dir": f'"{folder}/ckpt"', "train.metrics": f'"{folder}/m.jsonl"',
                "model.n_embd": n_embd, "model.n_layer": n_layer, "model.block_size": 64, "data.batch_size": 2 * ranks,
                "parallel.dp": ranks, "parallel.zero": stage, "parallel.shm": "false", "train.steps": 2,
                "checkpoint.interval": 0, "train.eval_interval": 0, "train.sample_tokens": 0}
        args = " ".join(f"--set '{key}={value}'" for key, value in sets.items())
        tag = f"{os.getpid()}-{stage}-{n_layer}"
        rank = limited(f"{sys.executable} -m hpcpar train {REPO}/jobs/gpt-dp.toml {args}", kind, limit_mb, tag)
        try:
            proc = subprocess.run([os.path.join(BIN, "mpiexec"), "-n", str(ranks), "bash", "-c", rank],
                                  capture_output=True, text=True, timeout=600,
                                  env={**os.environ, "OPENBLAS_NUM_THREADS": "1"})
        finally:
            if kind == "cgroup":
                remove_cgroups(tag)
    lines = (proc.stdout + proc.stderr).splitlines()
    errors = [line for line in lines if "Error" in line or "KILLED" in line or "Killed" in line]
    return proc.returncode == 0, errors[0].strip() if errors else f"exit {proc.returncode}"


def deepest(tokens, ranks, limit_mb, stage, n_embd, kind) -> tuple[int, str]:
    layers, why = 0, ""
    step = 4
    while step:
        ok, error = trains(tokens, ranks, limit_mb, stage, layers + step, n_embd, kind)
        if ok:
            layers += step
        else:
            why, step = error, (1 if step == 4 else 0)
    return layers, why


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("tokens", help="a token file of `hpcpar data prepare`")
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--limit-mb", type=int, default=600, help="memory per rank, MiB")
    parser.add_argument("--n-embd", type=int, default=256)
    parser.add_argument("--kind", choices=["address-space", "cgroup"], default="address-space",
                        help="what the limit counts: ulimit -v, or a cgroup v1 memory limit per rank (root)")
    args = parser.parse_args()
    print(f"deepest GPT (width {args.n_embd}) trained at dp {args.ranks}, each rank under a {args.kind} limit of "
          f"{args.limit_mb} MiB", flush=True)
    for stage in (0, 1, 2, 3):
        layers, why = deepest(args.tokens, args.ranks, args.limit_mb, stage, args.n_embd, args.kind)
        print(f"ZeRO stage {stage}: n_layer {layers}; {layers + 1} failed: {why}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
