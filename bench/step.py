"""Single-process GPT training step, hpcpar vs PyTorch CPU, one BLAS thread.

    python bench/step.py [--steps 10] [--warmup 3] [--profile]
"""
import os
import sys

# One BLAS/OpenMP thread for both frameworks, set before NumPy (or torch) is imported.
for variable in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(variable, "1")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from hpcpar.cli import main  # noqa: E402

if __name__ == "__main__":
    main(["bench", "step", *sys.argv[1:]])
