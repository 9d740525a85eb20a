"""The raw-MPI baseline: C's MPI_Allreduce timed inside this very process.

``build/libhpcpar_native.so`` (sources in ``native/``, built by ``CMakeLists.txt``: once with
``build_native(repo_root)``) holds the timing loop of ``build/allreduce_bench``. Loaded here with
ctypes, it runs in the mpi4py process on the same MPI library, so a benchmark can set mpi4py's
and hpcpar's all-reduce against raw C MPI measured in the same run::

    from mpi4py import MPI
    from hpcpar import native

    seconds = native.time_raw_allreduce(MPI.COMM_WORLD, 1 << 20, warmup=5, iters=50)
    lib = native.load_native()               # None (and a warning saying why) when unusable
    lib, why = native.try_load_native()      # the same, with the reason as a value
    lib.set_wait_policy(1)                   # sleep, not spin, in MPI waits (ranks > cores)
"""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

LIB_NAME = "libhpcpar_native.so"
ENV_VAR = "HPCPAR_NATIVE_LIB"  # a path that overrides <repo>/build/libhpcpar_native.so
REPO_ROOT = Path(__file__).resolve().parent.parent

BUILD_HINT = (
    "build it with `cmake -S . -B build -DMPI_C_COMPILER=$PWD/.venv/bin/mpicc && "
    "cmake --build build` in the repository (or hpcpar.native.build_native(repo_root)), "
    f"or point {ENV_VAR} at it"
)

# The negative return codes of hpcpar_time_allreduce (native/hpcpar_native.h).
_TIME_ERRORS = {
    -1.0: "bad arguments (nbytes must be a positive multiple of 4 and at most 8 GiB, "
    "warmup >= 0, iters >= 1) or MPI not running",
    -2.0: "a rank could not allocate its send and receive buffers",
    -3.0: "a rank received a wrong sum",
    -4.0: "an MPI call returned an error",
}


class NativeLib:
    """libhpcpar_native.so loaded into this process; see ``try_load_native``."""

    def __init__(self, path: Path, cdll: ctypes.CDLL):
        self.path = path
        self._time = cdll.hpcpar_time_allreduce
        self._time.argtypes = [ctypes.c_int, ctypes.c_size_t, ctypes.c_int, ctypes.c_int]
        self._time.restype = ctypes.c_double  # MPI_Fint is a C int
        self._time_call = cdll.hpcpar_time_allreduce_call
        self._time_call.argtypes = [ctypes.c_int, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                                    ctypes.c_int]
        self._time_call.restype = ctypes.c_double
        self._wait = cdll.hpcpar_set_wait_policy
        self._wait.argtypes = [ctypes.c_int]
        self._wait.restype = ctypes.c_int

    def __repr__(self) -> str:
        return f"NativeLib({str(self.path)!r})"

    def time_allreduce(self, comm, nbytes: int, warmup: int, iters: int) -> float:
        """Mean seconds per MPI_Allreduce(MPI_FLOAT, MPI_SUM) of nbytes on comm, slowest rank.

        Collective over comm (an mpi4py communicator): `warmup` untimed calls, a
        barrier, `iters` back-to-back timed calls, then a check of the sums.
        """
        seconds = self._time(comm.py2f(), nbytes, warmup, iters)
        if seconds < 0:
            reason = _TIME_ERRORS.get(seconds, f"error code {seconds}")
            raise RuntimeError(
                f"hpcpar_time_allreduce(nbytes={nbytes}, warmup={warmup}, iters={iters}): {reason}"
            )
        return seconds

    def time_allreduce_call(self, comm, nbytes: int, warmup: int, iters: int, call: str, polite: bool) -> float:
        """Mean seconds per all-reduce of the kind ``call`` (a key of CALLS), slowest rank.

        ``polite``: between MPI_Test polls of the polled call, yield the core as hpcpar's
        "yield" wait policy does (sched_yield for 2 ms, then 50 us sleeps); else spin.
        """
        seconds = self._time_call(comm.py2f(), nbytes, warmup, iters, CALLS[call], int(polite))
        if seconds < 0:
            reason = _TIME_ERRORS.get(seconds, f"error code {seconds}")
            raise RuntimeError(f"hpcpar_time_allreduce_call(nbytes={nbytes}, call={call!r}): {reason}")
        return seconds

    def set_wait_policy(self, polls_before_sleep: int) -> bool:
        """Spin (0) or sleep 1 us after that many idle polls while waiting in MPI.

        Affects every MPI call of this process from now on, mpi4py's included
        (MPICH's progress throttle, set through MPI_T). With more ranks than
        cores, 1 turned a 4-rank 8-byte all-reduce on 2 cores from ~10 ms into
        ~10 us. Returns False when this MPI has no such control.
        """
        return self._wait(polls_before_sleep) == 0


# The calls hpcpar_time_allreduce_call times (HPCPAR_CALL_* in native/hpcpar_native.h).
CALLS = {"out of place": 0, "in place": 1, "polled in place": 2}

_loaded: dict[Path, NativeLib] = {}  # successful loads only: a later build can fix a failure


def library_path() -> Path:
    """Where load_native looks: $HPCPAR_NATIVE_LIB, else <repo>/build/libhpcpar_native.so."""
    return Path(os.environ.get(ENV_VAR) or REPO_ROOT / "build" / LIB_NAME)


def _mapped_mpi_libraries() -> set[str]:
    """Real paths of the libmpi* files mapped into this process; empty where /proc is absent."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return set()
    fields = (line.split(maxsplit=5) for line in maps.splitlines())
    return {
        os.path.realpath(f[5])
        for f in fields
        if len(f) == 6 and os.path.basename(f[5]).startswith("libmpi")
    }


def _first_line(text: str) -> str:
    return text.strip().splitlines()[0] if text.strip() else ""


def load_native(path: str | os.PathLike | None = None, *, quiet: bool = False) -> NativeLib | None:
    """The native library, or None when it is missing or unusable (with a warning saying why).

    See try_load_native for what makes it unusable.
    """
    lib, why = try_load_native(path)
    if lib is None and not quiet:
        warnings.warn(f"hpcpar.native: {why}", RuntimeWarning, stacklevel=2)
    return lib


def try_load_native(path: str | os.PathLike | None = None) -> tuple[NativeLib | None, str]:
    """Load the native library; returns ``(lib, "")``, or ``(None, reason)`` when unusable.

    Refuses a library linked against another MPI than the one mpi4py loaded
    (two MPI libraries in one process do not mix), judged by the libmpi files
    mapped into the process and by MPI_Get_library_version.
    """
    origin = ""
    if path is None:
        path = library_path()
        origin = f" (from ${ENV_VAR})" if os.environ.get(ENV_VAR) else ""
    path = Path(path)
    if not path.is_file():
        return None, f"{path}{origin} not found; {BUILD_HINT}"
    path = path.resolve()
    if path in _loaded:
        return _loaded[path], ""
    try:
        from mpi4py import MPI  # loads (and initializes) mpi4py's MPI first
    except ImportError as exc:
        return None, f"mpi4py is not importable: {exc}"

    mpi4py_libs = _mapped_mpi_libraries()
    try:
        cdll = ctypes.CDLL(str(path))
    except OSError as exc:
        return None, f"cannot load {path}: {exc}; {BUILD_HINT}"
    extra = _mapped_mpi_libraries() - mpi4py_libs
    if mpi4py_libs and extra:
        return None, (
            f"{path} links {sorted(extra)} but mpi4py uses {sorted(mpi4py_libs)}; rebuild it "
            "with -DMPI_C_COMPILER=<the mpicc of mpi4py's MPI> in a fresh build folder"
        )
    # dlsym through the library's handle resolves in its own dependencies: its libmpi.
    version = ctypes.create_string_buffer(8192)  # >= MPI_MAX_LIBRARY_VERSION_STRING
    length = ctypes.c_int()
    try:
        cdll.MPI_Get_library_version(version, ctypes.byref(length))
        lib = NativeLib(path, cdll)
    except AttributeError as exc:
        return None, f"{path} lacks a symbol ({exc}); it is stale: {BUILD_HINT}"
    ours = _first_line(version.value.decode(errors="replace"))
    theirs = _first_line(MPI.Get_library_version())
    if ours != theirs:
        return None, f"{path} runs on {ours!r} but mpi4py on {theirs!r}; rebuild it"
    _loaded[path] = lib
    return lib, ""


def time_raw_allreduce(comm, nbytes: int, warmup: int, iters: int) -> float:
    """Mean seconds per raw C MPI_Allreduce of nbytes float32 on comm (slowest rank).

    Collective. The ranks first agree that all of them loaded the library, so
    a rank without it raises on every rank instead of leaving the others waiting.

    The C loop inherits the process's MPI state: mpi4py initializes MPI_THREAD_MULTIPLE
    by default, and MPICH's locking then adds about 1.5-3 us to each small all-reduce
    (8 B: ~2 us here against 0.25 us in the standalone ``allreduce_bench``, and against
    0.25 us in-process too with ``MPI4PY_RC_THREAD_LEVEL=single``).
    """
    return load_everywhere(comm).time_allreduce(comm, nbytes, warmup, iters)


def load_everywhere(comm):
    """The native library, loaded on every rank of ``comm`` or raising on all of them (collective)."""
    lib, why = try_load_native()
    reasons = comm.allgather(why)
    if any(reasons):
        failed = [rank for rank, reason in enumerate(reasons) if reason]
        first = next(reason for reason in reasons if reason)
        raise RuntimeError(f"raw-MPI baseline unavailable on ranks {failed}: {first}")
    return lib


def _find_mpicc(repo_root: Path) -> Path | None:
    """The MPI compiler wrapper of this Python's environment or of the repository's venv."""
    for candidate in (Path(sys.prefix) / "bin" / "mpicc", repo_root / ".venv" / "bin" / "mpicc"):
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return candidate
    return None


def build_native(
    repo_root: str | os.PathLike = REPO_ROOT, build_dir: str | os.PathLike | None = None
) -> Path:
    """Configure and build the native part with CMake; returns the library's path.

    Uses the mpicc of this Python's environment (the MPI mpi4py came with, e.g.
    PyPI's mpich) when there is one, else whatever MPI CMake finds. Raises
    RuntimeError with CMake's output when a step fails. Not collective: under
    MPI, call it on one rank and barrier before the others load it. By hand:
    ``cmake -S . -B build -DMPI_C_COMPILER=$PWD/.venv/bin/mpicc && cmake --build build``.
    """
    repo_root = Path(repo_root).resolve()
    build_dir = Path(build_dir) if build_dir is not None else repo_root / "build"
    cmake = shutil.which("cmake") or shutil.which("cmake", path=str(Path(sys.prefix) / "bin"))
    if cmake is None:
        raise RuntimeError(
            "cmake not found on PATH: install it (apt-get install cmake, or pip install cmake)"
        )
    configure = [cmake, "-S", str(repo_root), "-B", str(build_dir), "-DCMAKE_BUILD_TYPE=Release",
                 f"-DHPCPAR_PYTHON={sys.executable}"]
    mpicc = _find_mpicc(repo_root)
    if mpicc is not None:
        configure.append(f"-DMPI_C_COMPILER={mpicc}")
    build = [cmake, "--build", str(build_dir), "--target", "hpcpar_native", "allreduce_bench"]
    # The tools CMake starts must not take themselves for ranks of the job we run in.
    env = {
        key: value
        for key, value in os.environ.items()
        if not key.startswith(("PMI_", "PMIX_", "HYDRA_", "OMPI_", "MPI_LOCAL"))
    }
    for step in (configure, build):
        done = subprocess.run(step, cwd=repo_root, env=env, capture_output=True, text=True)
        if done.returncode != 0:
            output = (done.stdout + done.stderr).strip().splitlines()
            raise RuntimeError(
                f"{' '.join(step)} failed (exit {done.returncode}):\n" + "\n".join(output[-40:])
            )
    return build_dir / LIB_NAME
