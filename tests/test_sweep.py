"""tests/sweep.py keeps working: each mode runs one combination at 2 ranks and passes, a defect
makes the exit status 1, and a command's ending is judged as the sweep documents."""
import json
import os
import subprocess
import sys

import pytest

from conftest import REPO

SWEEP = os.path.join(REPO, "tests", "sweep.py")


@pytest.mark.parametrize("mode", ["crash", "equal", "resume", "replicas"])
def test_each_mode_runs_one_combination(mode, tmp_path):
    proc = subprocess.run([sys.executable, SWEEP, mode, "--count", "1", "--ranks", "2", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"sweep {mode}\n  combinations     1\n  passed           1\n" in proc.stdout, proc.stdout
    (record,) = [json.loads(line) for line in open(tmp_path / f"sweep-{mode}-1.jsonl")]
    assert record["outcome"] == "passed" and record["world"] == 2 and record["keys"]
    assert "folder" not in record  # removed: it passed and --keep was not given


def test_a_defect_is_reported_kept_and_fails_the_sweep(tmp_path, monkeypatch, capsys):
    sys.path.insert(0, os.path.dirname(SWEEP))
    import sweep
    from sweep_modes import Ended

    def broken(case):
        raise Ended("defect", "planted")

    monkeypatch.setitem(sweep.MODES, "crash", broken)
    assert sweep.main(["crash", "--count", "2", "--out", str(tmp_path)]) == 1
    records = [json.loads(line) for line in open(tmp_path / "sweep-crash-1.jsonl")]
    assert [r["why"] for r in records] == ["planted", "planted"] and all(os.path.isdir(r["folder"]) for r in records)
    assert "  defect           2" in capsys.readouterr().out


def test_an_ending_is_a_defect_unless_it_is_a_success_or_a_one_line_refusal():
    from sweep_run import Outcome

    def ending(rc, stdout="", stderr=""):
        return Outcome(["hpcpar"], "/", rc, stdout, stderr).defect()

    assert ending(0) is None
    assert ending(2, stderr="hpcpar train: error: job.toml: parallel.tp: 3 does not divide 4\n") is None
    assert ending(2, stderr="error: a\nerror: b\n") == "exit status 2 with 2 `error:` lines on stderr"
    assert ending(2) == "exit status 2 with 0 `error:` lines on stderr"
    assert ending(0, stderr="Traceback (most recent call last):\n") == "traceback"
    assert ending(1) == "exit status 1"
    assert ending(124).startswith("timed out")
    assert Outcome(["x"], "/", 2, "", "").defect(refusal=False) == "exit status 2"
