"""README.md cannot drift: its Python blocks are the examples/ scripts, every example runs, and
every shell block runs here (at a small scale) unless it is marked as one that cannot, with why.

A shell block that cannot run here (make itself, SLURM, a GPU) is preceded in README.md by
``<!-- not run by tests/test_readme.py: REASON -->``; the test of that block is skipped with
the reason, so ``pytest -rs`` lists them.
"""
import os
import re
import subprocess
import sys

import pytest

from conftest import REPO, venv_bin

README = os.path.join(REPO, "README.md")
EXAMPLES = os.path.join(REPO, "examples")
MARKER = re.compile(r"<!-- not run by tests/test_readme\.py: (.*?) -->")
# Each example, with the ranks and arguments of its small run.
EXAMPLE_RUNS = {"three_d.py": (4, ["--steps", "2"]), "data_parallel.py": (2, ["--steps", "2"])}
ENV = {**os.environ, "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}


def fenced_blocks(language: str) -> list[tuple[str, str, str | None]]:
    """(the section heading, the block's text, the skip reason or None) of each ```language block."""
    with open(README) as f:
        text = f.read()
    blocks, heading = [], "top"
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("#") and not line.startswith("#!"):
            heading = line.lstrip("#").strip()
        if line.strip() == f"```{language}":
            end = lines.index("```", i + 1)
            marker = MARKER.fullmatch(lines[i - 1].strip()) if i else None
            blocks.append((heading, "\n".join(lines[i + 1:end]) + "\n", marker.group(1) if marker else None))
            i = end
        i += 1
    return blocks


def readme_region(path: str) -> str:
    """The lines of an example between ``# --- README: NAME ---`` and ``# --- README end ---``."""
    with open(path) as f:
        text = f.read()
    start = re.search(r"# --- README: \w+ ---\n", text)
    return text[start.end():text.index("# --- README end ---")] if start else ""


def test_every_python_block_is_an_example_script():
    regions = {name: readme_region(os.path.join(EXAMPLES, name)) for name in sorted(os.listdir(EXAMPLES))
               if name.endswith(".py")}
    blocks = [text for _, text, _ in fenced_blocks("python")]
    assert blocks, "README.md has no Python block"
    for text in blocks:
        assert text in regions.values(), f"this README block is no examples/ script's README region:\n{text}"
    assert set(EXAMPLE_RUNS) == set(regions), "every example needs a small run in EXAMPLE_RUNS"


@pytest.mark.parametrize("name", sorted(EXAMPLE_RUNS))
def test_every_example_runs(name):
    ranks, args = EXAMPLE_RUNS[name]
    proc = subprocess.run([venv_bin("mpiexec"), "-n", str(ranks), sys.executable, os.path.join(EXAMPLES, name), *args],
                          capture_output=True, text=True, timeout=300, env=ENV, cwd=REPO)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    losses = [float(line.split()[-1]) for line in proc.stdout.splitlines() if line.startswith("step ")]
    assert len(losses) == 2 and all(4.0 < loss < 6.0 for loss in losses), proc.stdout


SMALL = ["--set", "train.steps=2", "--set", "train.eval_interval=0", "--set", "model.n_layer=2",
         "--set", "model.n_embd=32"]


def small_scale(line: str, token_file: str) -> str:
    """The README's command with options appended that make it quick (later options win)."""
    command = line.split(" #")[0].rstrip()  # the comment that explains it
    data = ["--set", f'data.path="{token_file}"']
    extra = {"hpcpar train ": SMALL + data, "hpcpar compare ": ["--steps", "1", *SMALL[4:], *data],
             "hpcpar data prepare": ["--max-mb", "0.5"], "hpcpar generate ": ["--tokens", "10"],
             "hpcpar run examples/": ["--steps", "2"]}
    for start, options in extra.items():
        if start in command and "--list-keys" not in command:
            return command + " " + " ".join(f"'{o}'" for o in options)
    return command


SHELL_BLOCKS = fenced_blocks("bash")


@pytest.fixture(scope="module")
def shell_results(tmp_path_factory, token_file):
    """Every runnable shell block in README order, in one folder that looks like the repository."""
    work = tmp_path_factory.mktemp("readme")
    for name in ("jobs", "examples", "slurm", "Makefile"):
        os.symlink(os.path.join(REPO, name), work / name)
    os.symlink(sys.prefix, work / ".venv")
    # The README activates the environment once, in its first runnable block; later blocks assume it.
    env = {**ENV, "PATH": os.path.dirname(sys.executable) + os.pathsep + ENV.get("PATH", "")}
    results = {}
    for number, (_, text, skip) in enumerate(SHELL_BLOCKS):
        if skip is None:
            script = "\n".join(small_scale(line, token_file) for line in text.splitlines())
            results[number] = subprocess.run(["bash", "-ex", "-c", script], capture_output=True, text=True,
                                             timeout=600, cwd=work, env=env)
    return results


@pytest.mark.parametrize("number", range(len(SHELL_BLOCKS)),
                         ids=[f"{i}-{heading}" for i, (heading, _, _) in enumerate(SHELL_BLOCKS)])
def test_every_shell_block_runs_or_says_why_not(number, request):
    heading, text, skip = SHELL_BLOCKS[number]
    if skip is not None:
        pytest.skip(f"README block under '{heading}': {skip}")
    proc = request.getfixturevalue("shell_results")[number]
    assert proc.returncode == 0, f"README block under '{heading}' failed:\n{proc.stdout}\n{proc.stderr}"
    assert "Traceback" not in proc.stderr, proc.stderr


def test_the_readme_has_runnable_and_marked_shell_blocks():
    """The markers are exact (a typo would silently run a block meant to be skipped, or the reverse)."""
    with open(README) as f:
        text = f.read()
    assert text.count("<!-- not run by") == len(MARKER.findall(text)) == sum(1 for *_, s in SHELL_BLOCKS if s)
    assert sum(1 for *_, s in SHELL_BLOCKS if s is None) >= 2
