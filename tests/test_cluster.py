"""Multi-node tests on a two-node cluster on this machine (tests/cluster/bring_up.sh, as root):
MPI and SLURM across network namespaces node1 and node2, 2 ranks on each.

The commands are those of the README's "Several nodes" section. These are serial tests:
pytest runs as one process on this machine and each test starts its ranks on the nodes. The
cluster comes up once per session (under a second) and goes when the session that brought it
up ends (tests/services.py); where namespaces are not permitted (not root, a container without
CAP_SYS_ADMIN) the tests skip with the reason, and under CI=true they fail.

    .venv/bin/python -m pytest tests/test_cluster.py
"""
import json
import os
import re
import signal
import subprocess
import sys

import numpy as np
import pytest

from conftest import REPO, final_parameters
from services import run_script, shared_service, unavailable
from slurm_jobs import job_env, submit, wait_for, wait_for_output
from test_bench import positive, table

pytestmark = pytest.mark.cluster

CLUSTER = os.path.join(REPO, "tests", "cluster")
ON = os.path.join("tests", "cluster", "on")       # as the README writes it, from the repository root
NODE1 = (ON, "node1")
MPIEXEC = [*NODE1, "mpiexec", "-launcher-exec", ON, "-hosts", "node1,node2", "-ppn", "2", "-n", "4"]


@pytest.fixture(scope="session")
def cluster():
    """node1 and node2, brought up once per session."""
    yield from shared_service("cluster", [os.path.join(CLUSTER, "bring_up.sh")],
                              [os.path.join(CLUSTER, "tear_down.sh")],
                              is_up=lambda: os.path.exists("/run/hpcpar-cluster/nodes"),
                              marker="/run/hpcpar-cluster/started-by-tests")


@pytest.fixture(scope="session")
def cluster_slurm(cluster):
    """SLURM on the cluster: slurmctld on node1, a slurmd on each node (stops with the cluster)."""
    failure = run_script([os.path.join(CLUSTER, "bring_up.sh"), "--slurm"], "bring_up.sh --slurm")
    if failure is not None:
        unavailable("SLURM on the test cluster", failure)


def venv_env(**extra):
    """This environment with the venv's bin first on PATH, as after `source .venv/bin/activate`."""
    env = {**os.environ, "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""),
           "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}
    env.update(extra)
    return env


def run(argv, timeout=240, **extra):
    result = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=timeout, env=venv_env(**extra))
    assert result.returncode == 0, f"{' '.join(argv)} failed:\n{result.stdout[-4000:]}\n{result.stderr[-4000:]}"
    return result.stdout


def test_nodes_have_their_names_links_and_shared_memory(cluster):
    for i, node in ((1, "node1"), (2, "node2")):
        out = run([ON, node, "sh", "-c", "hostname; ip -br -4 addr show dev eth0; findmnt -n -o SOURCE /dev/shm | tail -n 1; "
                                         "getent hosts node1 node2"])
        lines = out.splitlines()
        assert lines[0] == node
        assert re.search(rf"^eth0\S* +UP +10\.77\.0\.{i}/24", out, re.M), out
        assert lines[2] == f"shm-{node}", out  # a /dev/shm of its own (mounted over this machine's)
        assert lines[3].split() == ["10.77.0.1", "node1"] and lines[4].split() == ["10.77.0.2", "node2"], out
    # The subnet is the namespaces' alone: this machine has no address on it and no route to it.
    assert "10.77.0." not in subprocess.run(["ip", "-4", "addr"], capture_output=True, text=True).stdout
    assert "10.77.0." not in subprocess.run(["ip", "-4", "route"], capture_output=True, text=True).stdout


def link_qdisc(node):
    return subprocess.run(["tc", "-n", f"hpcpar-{node}", "qdisc", "show", "dev", "eth0"], capture_output=True,
                          text=True, check=True).stdout


def test_links_can_be_slowed_and_set_back(cluster):
    bring_up = os.path.join(CLUSTER, "bring_up.sh")
    try:
        result = subprocess.run([bring_up, "--rate", "1gbit"], capture_output=True, text=True, timeout=60)
        assert result.returncode == 0, result.stderr
        assert all(re.search(r"qdisc tbf .* rate 1Gbit", link_qdisc(node)) for node in ("node1", "node2"))
        result = subprocess.run([bring_up, "--delay", "20us", "--rate", "10gbit"], capture_output=True, text=True,
                                timeout=60)
        if result.returncode == 0:  # the kernel has netem
            assert all(re.search(r"qdisc netem .*delay 20us.* rate 10Gbit", link_qdisc(n)) for n in ("node1", "node2"))
        else:  # one clear line, and the links as they were
            assert "--delay needs the netem qdisc, which this kernel lacks" in result.stderr, result.stderr
        result = subprocess.run([bring_up, "--rate", "fast"], capture_output=True, text=True, timeout=60)
        assert result.returncode != 0 and "--rate 'fast' is not a rate such as 10gbit" in result.stderr
    finally:
        subprocess.run([bring_up], capture_output=True, timeout=60)
    assert all("tbf" not in link_qdisc(node) and "netem" not in link_qdisc(node) for node in ("node1", "node2"))


def test_hpcpar_info_shows_two_nodes_and_what_crosses_them(cluster):
    out = run([*MPIEXEC, "hpcpar", "info", "--tp", "2", "--pp", "2"])
    assert re.findall(r"^ +(\d) +(node\d) +(\d) +\d+$", out, re.M) == [
        ("0", "node1", "0"), ("1", "node1", "1"), ("2", "node2", "0"), ("3", "node2", "1")], out
    assert "2 nodes: node1 (ranks 0-1), node2 (ranks 2-3)" in out, out
    assert re.search(r"^tp +2 +2 +1 +0 of 2 +1 / 0$", out, re.M), out    # each tp pair inside a node
    assert re.search(r"^pp +2 +2 +2 +2 of 2 +0 / 1$", out, re.M), out    # each pipeline spans both
    assert "across nodes: pp (tp inside nodes)" in out and "warning" not in out, out


def test_tensor_parallelism_across_nodes_is_warned_about(cluster):
    """Ranks placed round-robin (-ppn 1) put each tp pair on two nodes, though it fits in one."""
    out = run([*NODE1, "mpiexec", "-launcher-exec", ON, "-hosts", "node1,node2", "-ppn", "1", "-n", "4",
               "hpcpar", "info", "--tp", "2"])
    assert "2 nodes: node1 (ranks 0,2), node2 (ranks 1,3)" in out, out
    assert "warning: tensor parallelism crosses nodes although tp=2 divides the ranks of every node" in out, out


def test_multinode_mpi_tests_and_collectives_pass_on_two_nodes(cluster):
    """tests/test_multinode.py (the network is used between nodes and not inside one; collectives;
    the 3D model with tp inside and pp across nodes, and ZeRO-3's hybrid sharding inside nodes,
    equal one process) and the collectives suite."""
    out = run([*MPIEXEC, "python", "-m", "pytest", "-q", "-p", "no:cacheprovider", "--with-mpi", "-m", "mpi",
               "tests/test_multinode.py", "tests/test_collectives.py"], timeout=300)
    summaries = re.findall(r"(\d+) passed in", out)  # one per rank; the launcher may join their lines
    assert len(summaries) == 4 and "skipped" not in out and "failed" not in out, out
    figures = re.findall(r"max \|parameter - one process\| = (\S+)", out)
    assert len(figures) == 3 and all(float(f) <= 1e-10 for f in figures), out  # 3D twice, HSDP


def test_compare_shows_the_communication_across_nodes(cluster, token_file, tmp_path):
    out = run([*MPIEXEC, "hpcpar", "compare", "jobs/gpt-dp.toml", "--steps", "2", "--out", str(tmp_path),
               "--set", "model.n_layer=2", "--set", "model.n_embd=32", "--set", f'data.path="{token_file}"'],
              timeout=300)
    assert "4 ranks on 2 nodes" in out and "comm (inter-node)" in out and "across nodes" in out, out
    results = {tuple(r["layout"]): r for r in json.load(open(tmp_path / "compare.json"))["results"]}
    # Ranks 0-1 on node1, 2-3 on node2; tp fastest, then cp, dp, pp. Layouts as (dp, pp, tp, cp).
    expected = {(1, 1, 1, 1): [], (4, 1, 1, 1): ["dp"], (1, 4, 1, 1): ["pp"], (1, 1, 4, 1): ["tp"],
                (1, 1, 1, 4): ["cp"], (1, 1, 2, 2): ["cp"], (1, 2, 1, 2): ["pp"], (1, 2, 2, 1): ["pp"],
                (2, 1, 1, 2): ["dp"], (2, 1, 2, 1): ["dp"], (2, 2, 1, 1): ["pp"]}
    assert {layout: r["across_nodes"] for layout, r in results.items()} == expected, out
    for layout, r in results.items():
        assert r["nodes"] == (1 if layout == (1, 1, 1, 1) else 2)
        assert (r["inter_node_share"] > 0) == (layout != (1, 1, 1, 1)), (layout, r)
        assert r["inter_node_share"] <= r["comm_share"]


def test_bench_net_measures_inside_and_across_nodes(cluster):
    out = run([*MPIEXEC, "hpcpar", "bench", "net", "--max-mib", "0.01", "--rounds", "1"])
    for title in ("point-to-point ping-pong", "all-reduce, float32 sum in place, 2 ranks"):
        assert f"{title}" in out and "intra: ranks [0, 1] on node1; inter: ranks [0, 2] on node1, node2" in out, out
    for title in ("point-to-point", "all-reduce"):
        header, rows = table(out[out.index(title):], "size")
        assert header[1:4] == ["intra", "us", "inter"], out
        # 8 B to 10 KiB by factors of 4: 7 sizes, each with times, their ratio and bandwidths
        assert [" ".join(row[:2]) for row in rows] == ["8 B", "32 B", "128 B", "512 B", "2 KiB", "8 KiB", "10.2 KiB"]
        assert all(len(row) == 7 and all(positive(cell) for cell in row[2:]) for row in rows), out


# ----- SLURM across the nodes ----------------------------------------------------------------
SMALL = ["--set", "parallel.dp=1", "--set", "model.n_embd=32", "--set", "train.log_interval=1",
         "--set", "train.eval_interval=0", "--set", "checkpoint.interval=0"]
STEPS = 30


def train_args(tmp, token_file):
    return ["jobs/gpt-3d.toml", *SMALL, "--set", f"train.steps={STEPS}", "--set", f'data.path="{token_file}"',
            "--set", f'checkpoint.dir="{tmp}/ckpt"', "--set", f'train.metrics="{tmp}/metrics.jsonl"']


def test_train_sbatch_on_two_nodes_requeues_and_resumes_exactly_with_both_launchers(cluster_slurm, token_file,
                                                                                     tmp_path):
    """gpt-3d (tp 2 inside nodes, pp 2 across) under srun and under hydra's mpiexec, each stopped by
    `scancel --signal=USR1 --batch`: checkpoint, requeue, resume, and end where a straight run does."""
    run([*MPIEXEC, "hpcpar", "train", *train_args(tmp_path / "straight", token_file)])
    outputs, jobs = {}, {}
    for launcher in ("srun", "mpiexec"):  # both jobs at once: the partition oversubscribes
        outputs[launcher] = tmp_path / f"{launcher}.out"
        jobs[launcher] = submit("--nodes=2", "--ntasks-per-node=2", "--cpus-per-task=1", f"--output={outputs[launcher]}",
                                "slurm/train.sbatch", *train_args(tmp_path / launcher, token_file), on=NODE1,
                                env=job_env(HPCPAR_LAUNCHER=launcher))
    for launcher, job in jobs.items():
        wait_for_output(outputs[launcher], "step     3/", timeout=180)  # training is under way
        subprocess.run([*NODE1, "scancel", "--signal=USR1", "--batch", job], check=True, timeout=30)
    straight = final_parameters(tmp_path / "straight" / "ckpt")
    for launcher, job in jobs.items():
        info = wait_for(job, timeout=300, on=NODE1)
        text = outputs[launcher].read_text()
        assert (info["JobState"], info["ExitCode"], info["Restarts"]) == ("COMPLETED", "0:0", "1"), text
        assert info["NodeList"] == "node[1-2]", info
        assert f"launcher {launcher}" in text and "2 nodes: node1 (ranks 0-1), node2 (ranks 2-3)" in text, text
        assert "stopped at step" in text and "signal SIGUSR1" in text and "requeue of SLURM job" in text, text
        assert "resumed from" in text and f"step    {STEPS}/{STEPS}" in text, text
        resumed = final_parameters(tmp_path / launcher / "ckpt")
        assert straight.keys() == resumed.keys(), launcher
        assert all(np.array_equal(straight[k], resumed[k]) for k in straight), f"{launcher}: resumed run differs"


def test_a_checkpoint_on_one_nodes_own_storage_is_refused_on_every_rank(cluster, token_file, tmp_path):
    """checkpoint.dir in /dev/shm, which each node has of its own: node1 holds a checkpoint (a run
    there alone), node2 none. Before, node2's ranks found no 'latest', exited 2 alone and node1's
    waited in the load forever; now every rank hears node2's damage and exits 2 with one line."""
    folder = f"/dev/shm/hpcpar-test-{os.getpid()}-{tmp_path.name}"
    keys = ["model.n_layer=1", "model.n_embd=32", "train.steps=2", "train.eval_interval=0", "train.sample_tokens=0",
            "checkpoint.interval=0", f'data.path="{token_file}"', f'checkpoint.dir="{folder}"',
            f'train.metrics="{tmp_path}/metrics.jsonl"']
    args = ["hpcpar", "train", "jobs/gpt-dp.toml", *[word for key in keys for word in ("--set", key)]]
    try:
        run([*NODE1, "mpiexec", "-n", "2", *args])
        proc = subprocess.Popen([*MPIEXEC, *args], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, env=venv_env(), start_new_session=True)
        try:
            output, _ = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # the launcher and every rank on both nodes
            output = proc.communicate()[0] + "\n(still running after 60 s: killed)"
        assert proc.returncode == 2, output
        errors = [line for line in output.splitlines() if "hpcpar train: error" in line]
        assert len(errors) == 1 and "nothing was" in errors[0] and "(ranks 2, 3)" in output, output
    finally:
        subprocess.run([*NODE1, "rm", "-rf", folder], timeout=30)
