"""Daemons the tests share (the one-node SLURM, the test cluster), as session fixtures.

A service is brought up once per test session by its own script, as root. When a session found
it down and brought it up, the last session that uses it tears it down at the end, so a test run
leaves nothing running; one brought up by hand (or still up from before) is left alone. Sessions
that overlap (two checkouts testing at once) share it: each holds a shared lock on
``/run/hpcpar-NAME.users`` while it runs, and only one that gets the lock alone tears down.

When the bring-up fails (not root, no apt, namespaces not permitted) the tests that need it skip
with the script's reason, except under CI=true, where they fail: CI must exercise them.
"""
import fcntl
import os
import subprocess

import pytest


def _last_line(result: subprocess.CompletedProcess) -> str:
    lines = (result.stderr or "").strip().splitlines()
    return lines[-1] if lines else f"exit code {result.returncode}"


def run_script(argv, what: str, timeout: int = 600) -> str | None:
    """Run a bring-up script; None when it succeeded, else the reason (its last line of stderr)."""
    try:
        result = subprocess.run(["bash", *argv], capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return f"{what} ran for more than {timeout} s"
    return None if result.returncode == 0 else _last_line(result)


def unavailable(what: str, reason: str):
    if os.environ.get("CI") == "true":
        pytest.fail(f"{what} could not be brought up under CI=true: {reason}")
    pytest.skip(f"no {what} here: {reason}")


def shared_service(name: str, bring_up: list, tear_down: list, is_up, marker: str):
    """Generator body of a session fixture: bring the service up, yield, tear it down when due.

    ``is_up()`` tells whether it runs now; ``marker`` is a file that says a test session started
    it (the service's tear-down may remove it; it is removed here too)."""
    try:
        users = open(f"/run/hpcpar-{name}.users", "a")
    except OSError as error:
        unavailable(name, f"cannot open /run/hpcpar-{name}.users ({error.strerror}); the tests need root")
    with users:
        fcntl.flock(users, fcntl.LOCK_SH)  # waits while another session tears it down
        started_here = not os.path.exists(marker) and not is_up()
        failure = run_script(bring_up, os.path.basename(bring_up[0]))
        if failure is not None:
            unavailable(name, failure)
        if started_here:
            open(marker, "w").close()
        yield
        try:
            fcntl.flock(users, fcntl.LOCK_EX | fcntl.LOCK_NB)  # the last session using it
        except BlockingIOError:
            return
        if os.path.exists(marker):
            failure = run_script(tear_down, os.path.basename(tear_down[0]))
            assert failure is None, f"tearing down {name} failed: {failure}"
            if os.path.exists(marker):
                os.remove(marker)
