"""Sweeps of random job combinations through `hpcpar train` and the checkpoint commands, to find
the defects no single test names (`make sweep`; not part of `make test`, tests/test_sweep.py
runs each mode once so that this tool keeps working).

    python tests/sweep.py MODE [--seed 1,2] [--count K] [--first I] [--ranks 2,4] [--out DIR] [--keep]

MODE is crash, equal, resume or replicas (tests/sweep_modes.py says what each checks). Combination
I of seed S draws from its own random generator, so `--seed S --first I --count 1` reruns it
alone. A combination's first run takes a world size above 1 from --ranks (when there is one), a
resume any of them. Each combination is one JSON line in DIR/sweep-MODE-S.jsonl (its keys, its outcome and,
when it did not pass, the command and the tail of its output); a table of the outcomes ends the
run, whose exit status is 1 if any combination found a defect. A combination's folder (under
DIR/work-MODE-*/, beside the sweep's token file) is removed unless --keep is given or it found a
defect (its JSON line names it). Every command runs under `timeout` (tests/sweep_run.py).
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import random
import shutil
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from conftest import REPO, prepared_tokens  # noqa: E402
from sweep_modes import MODES, Case, Ended  # noqa: E402

DEFAULT_SEEDS = "1"
TOKEN_MB = 0.2  # MiB of the standard library in the sweep's token file


def integers(text: str) -> list[int]:
    return [int(item) for item in text.split(",")]


def parse(argv) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("mode", choices=sorted(MODES))
    parser.add_argument("--seed", type=integers, default=DEFAULT_SEEDS, help="seeds, comma-separated")
    parser.add_argument("--count", type=int, default=10, help="combinations per seed")
    parser.add_argument("--first", type=int, default=0, help="index of the first combination of each seed")
    parser.add_argument("--ranks", type=integers, default="1,2,4", help="world sizes to draw from")
    parser.add_argument("--out", default=os.path.join(REPO, "runs", "sweep"), help="folder of the JSONL files")
    parser.add_argument("--keep", action="store_true", help="keep every combination's folder")
    args = parser.parse_args(argv)
    args.out = os.path.abspath(args.out)  # the runs start in folders of their own
    if args.mode == "replicas" and max(args.ranks) < 2:
        parser.error("replicas needs a world size of at least 2 in --ranks")
    return args


def one(mode: str, seed: int, index: int, args, work: str, tokens: str) -> dict:
    """Combination ``index`` of ``seed``: its record, its folder removed unless kept."""
    folder = tempfile.mkdtemp(prefix=f"{mode}-{seed}-{index}-", dir=work)
    case = Case(random.Random(f"{mode}:{seed}:{index}"), folder, args.ranks, tokens)
    start = time.monotonic()
    try:
        MODES[mode](case)
        ended = {"outcome": "passed"}
    except Ended as end:
        ended = end.fields
    record = {"mode": mode, "seed": seed, "index": index, **ended, **case.record,
              "seconds": round(time.monotonic() - start, 1)}
    if args.keep or record["outcome"] == "defect":
        record["folder"] = folder
    else:
        shutil.rmtree(folder, ignore_errors=True)
    return record


def summary(counts: collections.Counter, mode: str) -> str:
    rows = [("combinations", sum(counts.values()))] + [(name, counts[name]) for name in ("passed", "refused", "defect")]
    return "\n".join([f"sweep {mode}"] + [f"  {name:<13}{number:>5}" for name, number in rows])


def main(argv=None) -> int:
    args = parse(argv)
    os.makedirs(args.out, exist_ok=True)
    work = tempfile.mkdtemp(prefix=f"work-{args.mode}-", dir=args.out)
    tokens = prepared_tokens(os.path.join(work, "stdlib.h5"), TOKEN_MB)
    counts: collections.Counter = collections.Counter()
    for seed in args.seed:
        path = os.path.join(args.out, f"sweep-{args.mode}-{seed}.jsonl")
        with open(path, "w") as log:
            for index in range(args.first, args.first + args.count):
                record = one(args.mode, seed, index, args, work, tokens)
                log.write(json.dumps(record) + "\n")
                log.flush()
                counts[record["outcome"]] += 1
                why = f": {record['why']}" if "why" in record else ""
                print(f"{args.mode} seed {seed} #{index}: {record['outcome']}{why} ({record['seconds']} s)", flush=True)
        print(f"wrote {path}")
    if args.keep or counts["defect"]:
        print(f"kept {work}")
    else:
        shutil.rmtree(work, ignore_errors=True)
    print(summary(counts, args.mode))
    return 1 if counts["defect"] else 0


if __name__ == "__main__":
    sys.exit(main())
