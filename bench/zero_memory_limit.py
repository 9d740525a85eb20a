"""The deepest GPT each ZeRO stage trains under a per-rank memory limit (address space, RLIMIT_AS).

    python bench/zero_memory_limit.py TOKENS.h5 [--ranks 4] [--limit-mb 600] [--n-embd 256]

For stage 0 (DDP), 1 and 2 at dp = ranks: `hpcpar train jobs/gpt-dp.toml` of a GPT of the given
width (block 64, 2 rows per rank, AdamW fp32, the shared-memory path off so every buffer is the
rank's own) for 2 steps and its final checkpoint, each rank under `ulimit -v LIMIT`; n_layer
grows by 4 until a run fails, then by 1 from the last that trained. Prints the deepest that
trained per stage and the first error of the depth that did not. The limit includes what a
rank maps before training (Python, NumPy, MPI: find it with a small --limit-mb first).
"""
import argparse
import os
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BIN = os.path.dirname(sys.executable)


def trains(tokens: str, ranks: int, limit_mb: int, stage: int, n_layer: int, n_embd: int) -> tuple[bool, str]:
    with tempfile.TemporaryDirectory() as folder:
        sets = {"data.path": f'"{tokens}"', "checkpoint.dir": f'"{folder}/ckpt"', "train.metrics": f'"{folder}/m.jsonl"',
                "model.n_embd": n_embd, "model.n_layer": n_layer, "model.block_size": 64, "data.batch_size": 2 * ranks,
                "parallel.dp": ranks, "parallel.zero": stage, "parallel.shm": "false", "train.steps": 2,
                "checkpoint.interval": 0, "train.eval_interval": 0, "train.sample_tokens": 0}
        args = " ".join(f"--set '{key}={value}'" for key, value in sets.items())
        rank = f"ulimit -v {limit_mb * 1024}; exec {sys.executable} -m hpcpar train {REPO}/jobs/gpt-dp.toml {args}"
        proc = subprocess.run([os.path.join(BIN, "mpiexec"), "-n", str(ranks), "bash", "-c", rank], capture_output=True,
                              text=True, timeout=600, env={**os.environ, "OPENBLAS_NUM_THREADS": "1"})
    errors = [line for line in (proc.stdout + proc.stderr).splitlines() if "Error" in line]
    return proc.returncode == 0, errors[0].strip() if errors else ""


def deepest(tokens, ranks, limit_mb, stage, n_embd) -> tuple[int, str]:
    layers, why = 0, ""
    step = 4
    while step:
        ok, error = trains(tokens, ranks, limit_mb, stage, layers + step, n_embd)
        if ok:
            layers += step
        else:
            why, step = error, (1 if step == 4 else 0)
    return layers, why


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("tokens", help="a token file of `hpcpar data prepare`")
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--limit-mb", type=int, default=600, help="address space per rank, MiB")
    parser.add_argument("--n-embd", type=int, default=256)
    args = parser.parse_args()
    print(f"deepest GPT (width {args.n_embd}) trained at dp {args.ranks}, each rank under ulimit -v "
          f"{args.limit_mb} MiB")
    for stage in (0, 1, 2):
        layers, why = deepest(args.tokens, args.ranks, args.limit_mb, stage, args.n_embd)
        print(f"ZeRO stage {stage}: n_layer {layers}; {layers + 1} failed: {why}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
