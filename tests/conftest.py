"""Shared test set-up.

MPI tests (``@pytest.mark.mpi``) run under ``mpiexec -n N python -m pytest --with-mpi -m mpi``.
If one rank's assertion fails before a collective, the other ranks would wait in it forever:
the hook below aborts the whole MPI job on any failed MPI test, so a failure ends the run at once
with a non-zero exit instead of hanging until the outer timeout.
"""
import os
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.failed and item.get_closest_marker("mpi") is not None and item.config.getoption("with_mpi", False):
        from mpi4py import MPI

        if MPI.COMM_WORLD.Get_size() > 1:
            rank = MPI.COMM_WORLD.Get_rank()
            sys.stderr.write(f"\n[rank {rank}] MPI test {item.nodeid} failed ({report.when}):\n{report.longreprtext}\n")
            sys.stderr.flush()
            MPI.COMM_WORLD.Abort(1)


@pytest.fixture(autouse=True)
def close_contexts_made_by_the_test(request):
    """An MPI test closes the contexts ``hpcpar.init`` made during it: MPI has about 2000
    communicator ids per process and the 4-rank suite builds hundreds of contexts. Contexts of
    wider-scoped fixtures are older and stay open."""
    if request.node.get_closest_marker("mpi") is None or not request.config.getoption("with_mpi", False):
        yield
        return
    from hpcpar.runtime.context import open_contexts

    newest = max((ctx.serial for ctx in open_contexts()), default=-1)
    yield
    for ctx in open_contexts():  # oldest first: the same order on every rank
        if ctx.serial > newest:
            ctx.close()


@pytest.fixture
def world():
    from mpi4py import MPI

    return MPI.COMM_WORLD


def venv_bin(name: str) -> str:
    """A program of the interpreter's environment (mpiexec, hpcpar), falling back to PATH."""
    candidate = os.path.join(os.path.dirname(sys.executable), name)
    return candidate if os.path.exists(candidate) else name


def prepared_tokens(path: str, max_mb: float) -> str:
    """``path`` made by `hpcpar data prepare` from ``max_mb`` MB of the standard library."""
    import subprocess

    subprocess.run([sys.executable, "-m", "hpcpar", "data", "prepare", "--out", path, "--max-mb", str(max_mb)],
                   check=True, capture_output=True, timeout=120)
    return path


def world_token_file(prefix: str, max_mb: float = 0.2) -> str:
    """A small token file in a fresh folder of world rank 0's, prepared once for every rank (collective
    over the world: MPI tests)."""
    import tempfile

    from mpi4py import MPI

    from hpcpar.data.prepare import ensure_prepared
    from hpcpar.runtime.comm import Communicator

    world = MPI.COMM_WORLD
    folder = world.bcast(tempfile.mkdtemp(prefix=prefix) if world.Get_rank() == 0 else None, root=0)
    path = os.path.join(folder, "tokens.h5")
    ensure_prepared(path, Communicator(world, "world"), max_mb=max_mb)
    return path


@pytest.fixture(scope="session")
def token_file(tmp_path_factory):
    """A small token file of `hpcpar data prepare` (1 MB of the standard library), shared by the job tests."""
    return prepared_tokens(str(tmp_path_factory.mktemp("data") / "stdlib.h5"), 1)


def final_parameters(ckpt_root: str) -> dict:
    """The model tensors of the latest checkpoint under ``ckpt_root``, read through plain h5py."""
    import h5py

    step_dir = os.path.join(ckpt_root, open(os.path.join(ckpt_root, "latest")).read().strip())
    with h5py.File(os.path.join(step_dir, "index.h5"), "r") as f:
        return {k: f["model"][k][...] for k in f["model"]}
