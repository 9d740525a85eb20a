"""The longest sequence a GPT trains on at cp = 1, 2, 4 under a per-rank memory limit.

    python bench/cp_memory_limit.py TOKENS.h5 [--cps 1 2 4] [--limit-mb 400] [--kind cgroup]

For each C: `hpcpar train jobs/gpt-dp.toml` at parallel.cp = C, dp = 1 (C ranks, one sequence
per step, AdamW fp32, shm off so every buffer is the rank's own) for one step, each rank under
the limit as bench/zero_memory_limit.py sets it (``ulimit -v``, or its own cgroup v1 memory
controller as root). block_size doubles from --start until a run fails, then the gap is
bisected to a multiple of --step. At cp = 1 attention is ``ops.attention``, keeping T x T
scores; at cp > 1 ``ring_attention`` keeps T/C rows per rank. Prints the longest that trained
per C and the first error (or exit) of the shortest that did not. The limit includes what a
rank holds before training (Python, NumPy, MPI).
"""
import argparse
import os
import subprocess
import sys
import tempfile

from zero_memory_limit import BIN, REPO, limited, remove_cgroups


def trains(tokens: str, cp: int, block: int, args) -> tuple[bool, str]:
    """Whether one step of block ``block`` trains at cp = ``cp`` under the limit, and why not."""
    with tempfile.TemporaryDirectory() as folder:
        sets = {"data.path": f'"{tokens}"', "checkpoint.dir": f'"{folder}/ckpt"', "train.metrics": f'"{folder}/m.jsonl"',
                "model.n_embd": args.n_embd, "model.n_layer": args.n_layer, "model.block_size": block,
                "model.dropout": 0.0, "data.batch_size": 1, "parallel.dp": 1, "parallel.cp": cp,
                "parallel.shm": "false", "train.steps": 1, "checkpoint.interval": 0, "train.eval_interval": 0,
                "train.sample_tokens": 0}
        sets = " ".join(f"--set '{key}={value}'" for key, value in sets.items())
        tag = f"cp{os.getpid()}-{cp}-{block}"
        rank = limited(f"{sys.executable} -m hpcpar train {REPO}/jobs/gpt-dp.toml {sets}", args.kind, args.limit_mb, tag)
        try:
            proc = subprocess.run(["timeout", "600", os.path.join(BIN, "mpiexec"), "-n", str(cp), "bash", "-c", rank],
                                  capture_output=True, text=True, env={**os.environ, "OPENBLAS_NUM_THREADS": "1"})
        finally:
            if args.kind == "cgroup":
                remove_cgroups(tag)
    lines = (proc.stdout + proc.stderr).splitlines()
    errors = [line for line in lines if "Error" in line or "KILLED" in line or "Killed" in line]
    return proc.returncode == 0, errors[0].strip() if errors else f"exit {proc.returncode}"


def longest(tokens: str, cp: int, args) -> tuple[int, int, str]:
    """(the longest block that trained, the shortest that did not, its error); 0 when --start fails."""
    good, bad, why = 0, args.start, ""
    while True:  # doubling, until a block fails
        ok, error = trains(tokens, cp, bad, args)
        if not ok:
            why = error
            break
        good, bad = bad, 2 * bad
    while good and bad - good > args.step:  # bisecting the gap, in multiples of step
        middle = (good + bad) // 2 // args.step * args.step
        ok, error = trains(tokens, cp, middle, args)
        if ok:
            good = middle
        else:
            bad, why = middle, error
    return good, bad, why


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("tokens", help="a token file of `hpcpar data prepare`")
    parser.add_argument("--cps", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--limit-mb", type=int, default=400, help="memory per rank, MiB")
    parser.add_argument("--n-embd", type=int, default=128)
    parser.add_argument("--n-layer", type=int, default=4)
    parser.add_argument("--start", type=int, default=256, help="first block_size tried (a multiple of 2 x max cp)")
    parser.add_argument("--step", type=int, default=128, help="block_size resolution of the bisection")
    parser.add_argument("--kind", choices=["address-space", "cgroup"], default="address-space",
                        help="what the limit counts: ulimit -v, or a cgroup v1 memory limit per rank (root)")
    args = parser.parse_args()
    print(f"command: python {' '.join(sys.argv)}\nlongest block_size of a GPT (width {args.n_embd}, {args.n_layer} layers, "
          f"batch 1, AdamW fp32) trained one step at cp = C on C ranks, each under a {args.kind} limit of "
          f"{args.limit_mb} MiB", flush=True)
    for cp in args.cps:
        good, bad, why = longest(args.tokens, cp, args)
        print(f"cp {cp}: block_size {good} trained; {bad} failed: {why}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
