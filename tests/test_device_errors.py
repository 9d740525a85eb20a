"""Device problems end a run at its start with one line naming the fix and a non-zero exit:
a broken CuPy install, a GPU requested without CuPy, bf16 on a CuPy without bfloat16 (the
transfer guard lacks it as CuPy does). ``device = "auto"`` says which device it chose."""
import os
import subprocess
import sys

import pytest

from conftest import REPO

SMALL = [item for key in ("parallel.dp=1", "parallel.pp=1", "model.n_layer=1", "model.n_embd=16", "model.n_head=2",
                          "model.block_size=8", "data.batch_size=2", "parallel.micro_batches=1", "train.steps=1",
                          "train.sample_tokens=0", "data.eval_batches=1") for item in ("--set", key)]


def hpcpar(tmp_path, *args, cupy_says=None, env=None):
    """``python -m hpcpar ARGS`` in a fresh process; ``cupy_says``: the body of a fake, broken ``cupy``."""
    environment = {**os.environ, **(env or {})}
    environment.pop("HPCPAR_DEVICE", None)
    if cupy_says is not None:
        (tmp_path / "fake" / "cupy").mkdir(parents=True)
        (tmp_path / "fake" / "cupy" / "__init__.py").write_text(cupy_says)
        environment["PYTHONPATH"] = f"{tmp_path / 'fake'}{os.pathsep}{environment.get('PYTHONPATH', REPO)}"
    return subprocess.run([sys.executable, "-m", "hpcpar", *args], capture_output=True, text=True, timeout=120,
                          env=environment, cwd=tmp_path)


def job_args(tmp_path, token_file, *overrides):
    args = ["train", os.path.join(REPO, "jobs", "demo.toml"), "--progress", "none", *SMALL,
            "--set", f'data.path="{token_file}"', "--set", f'checkpoint.dir="{tmp_path}/ckpt"',
            "--set", f'train.metrics="{tmp_path}/metrics.jsonl"']
    for item in overrides:
        args += ["--set", item]
    return args


def one_line(result) -> str:
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 2 and len(lines) == 1, (result.returncode, result.stderr)
    return lines[0]


@pytest.mark.parametrize("broken, device", [
    ('raise ImportError("libcudart.so.12: cannot open shared object file: No such file or directory")', "auto"),
    ("import cupy_backends_that_is_not_there", "cuda"),
], ids=["missing-cuda-library-auto", "missing-cupy-module-cuda"])
def test_a_broken_cupy_install_is_one_line_naming_the_fix(tmp_path, token_file, broken, device):
    line = one_line(hpcpar(tmp_path, *job_args(tmp_path, token_file, f'train.device="{device}"'), cupy_says=broken))
    assert "CuPy is installed but fails to import" in line and "pip install 'hpcpar[gpu]'" in line
    assert "set the device to 'cpu'" in line
    assert not (tmp_path / "ckpt").exists()  # nothing written


def test_a_broken_cupy_does_not_stop_cpu_runs(tmp_path, token_file):
    result = hpcpar(tmp_path, "info", "--device", "cpu", cupy_says='raise ImportError("libcuda.so.1")')
    assert result.returncode == 0 and "cupy broken (ImportError: libcuda.so.1)" in result.stdout


def test_a_gpu_without_cupy_is_one_line_naming_the_fix(tmp_path, token_file):
    line = one_line(hpcpar(tmp_path, *job_args(tmp_path, token_file, 'train.device="cuda"')))
    assert "CuPy is not installed" in line and "pip install 'hpcpar[gpu]'" in line


def test_bf16_on_an_array_library_without_bfloat16_is_one_line(tmp_path, token_file):
    pytest.importorskip("ml_dtypes")
    line = one_line(hpcpar(tmp_path, *job_args(tmp_path, token_file, 'train.device="guard"', 'train.precision="bf16"')))
    assert "needs bfloat16 arrays" in line and "use precision fp16" in line


def test_nccl_without_a_gpu_is_one_line(tmp_path, token_file):
    line = one_line(hpcpar(tmp_path, *job_args(tmp_path, token_file, 'parallel.backend="nccl"', 'train.device="cpu"')))
    assert 'needs train.device = "cuda"' in line


def test_auto_says_which_device_it_chose(tmp_path, token_file):
    result = hpcpar(tmp_path, *job_args(tmp_path, token_file, 'train.device="auto"'))
    assert result.returncode == 0, result.stderr
    assert "device cpu (auto: CuPy is not installed); communication: mpi" in result.stdout


def test_a_driver_error_is_named_where_cupy_sees_no_device(monkeypatch):
    import types

    from hpcpar import backend

    def no_driver():
        raise RuntimeError("cudaErrorInsufficientDriver: CUDA driver version is insufficient for CUDA runtime version")

    fake = types.SimpleNamespace(__version__="13.0", cuda=types.SimpleNamespace(
        runtime=types.SimpleNamespace(getDeviceCount=no_driver)))
    monkeypatch.setattr(backend, "_cupy", fake)
    monkeypatch.delenv("HPCPAR_DEVICE", raising=False)
    assert backend.resolve_device("auto") == "cpu"
    assert backend.device_choice("auto", "cpu") == ("device cpu (auto: CuPy sees no CUDA device (RuntimeError: "
                                                    "cudaErrorInsufficientDriver: CUDA driver version is insufficient "
                                                    "for CUDA runtime version))")
    with pytest.raises(backend.DeviceError, match="cudaErrorInsufficientDriver.*or set the device to 'cpu'"):
        backend.resolve_device("cuda")


def test_info_names_each_communicators_backend_and_refuses_nccl_without_a_gpu(tmp_path):
    shown = hpcpar(tmp_path, "info")
    assert shown.returncode == 0, shown.stderr
    for name in ("world", "dp", "pp", "tp"):
        assert f"comm {name:<8} MPI" in shown.stdout
    assert "GPU MPI       non-blocking collectives on device buffers:" in shown.stdout
    line = one_line(hpcpar(tmp_path, "info", "--backend", "nccl"))
    assert line.startswith("hpcpar info: error:") and 'needs train.device = "cuda"' in line
