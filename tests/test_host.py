"""Process-wide settings: none on import; init() tunes the allocator (opt-out) and counts usable CPUs."""
import json
import os
import subprocess
import sys

import pytest

from conftest import REPO
from hpcpar import host

# RSS kept after allocating and freeing 100 MB: ~0 with glibc's defaults (the block is an mmap,
# unmapped on free), ~100 MB once its mmap threshold is raised above the block.
ALLOCATOR_SCRIPT = """
import json, os, sys
import numpy as np

def kept_after_free():
    rss = lambda: int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    before = rss()
    block = np.ones(100 * 2**20 // 8)
    del block
    return (rss() - before) / 2**20

facts = {"before import": kept_after_free()}
import atexit, logging, h5py, mpi4py.MPI  # what these register at exit on import is theirs
exit_handlers = atexit._ncallbacks()
import hpcpar, hpcpar.runtime, hpcpar.nn, hpcpar.optim, hpcpar.parallel, hpcpar.checkpoint, hpcpar.train, hpcpar.cli
facts["after import"] = kept_after_free()
facts["exit handlers added by import"] = atexit._ncallbacks() - exit_handlers
ctx = hpcpar.init(**json.loads(sys.argv[1]))
facts["after init"] = kept_after_free()
facts["reported"] = ctx.host["allocator"]
print(json.dumps(facts))
"""


def allocator_facts(init_kwargs: dict, **env) -> dict:
    environment = {k: v for k, v in os.environ.items() if not k.startswith(("PMI_", "HYDRA_", "MPI"))}
    proc = subprocess.run([sys.executable, "-c", ALLOCATOR_SCRIPT, json.dumps(init_kwargs)], capture_output=True,
                          text=True, timeout=120, env={**environment, "PYTHONPATH": REPO, **env})
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.splitlines()[-1])


def test_importing_hpcpar_leaves_glibc_and_exit_alone_until_init():
    facts = allocator_facts({})
    assert facts["before import"] < 20 and facts["after import"] < 20, facts  # the 100 MB went back to the OS
    assert facts["exit handlers added by import"] == 0, facts  # the checkpoint writer's: at its first save
    assert facts["after init"] > 90, facts  # init() tuned it: the heap keeps the block (so this test can fail)
    assert facts["reported"].startswith("tuned"), facts


@pytest.mark.parametrize("init_kwargs, env, reason", [({"tune_allocator": False}, {}, "tune_allocator=False"),
                                                      ({}, {"HPCPAR_MALLOC_TUNING": "0"}, "HPCPAR_MALLOC_TUNING=0")])
def test_init_can_leave_the_allocator_alone(init_kwargs, env, reason):
    facts = allocator_facts(init_kwargs, **env)
    assert facts["after init"] < 20, facts
    assert facts["reported"] == f"left alone ({'init(' + reason + ')' if 'tune' in reason else reason})"


def write(path, text):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_cgroup_v2_quota_is_the_tightest_on_the_path(tmp_path):
    proc, root = tmp_path / "proc", tmp_path / "cgroup"
    write(proc / "cgroup", "0::/job/step\n")
    write(root / "cpu.max", "max 100000\n")
    write(root / "job" / "cpu.max", "250000 100000\n")
    write(root / "job" / "step" / "cpu.max", "max 100000\n")
    assert host.cgroup_cpu_limit(proc, root) == 2.5
    write(root / "job" / "step" / "cpu.max", "150000 100000\n")
    assert host.cgroup_cpu_limit(proc, root) == 1.5
    assert host.usable_cpus(set(range(8)), host.cgroup_cpu_limit(proc, root)) == 2  # 1.5 CPUs: 2 can run at once


def test_cgroup_v1_quota_and_no_quota(tmp_path):
    proc, root = tmp_path / "proc", tmp_path / "cgroup"
    write(proc / "cgroup", "5:memory:/x\n4:cpu,cpuacct:/x\n0::/\n")
    write(root / "cpu,cpuacct" / "x" / "cpu.cfs_quota_us", "300000\n")
    write(root / "cpu,cpuacct" / "x" / "cpu.cfs_period_us", "100000\n")
    assert host.cgroup_cpu_limit(proc, root) == 3.0
    write(root / "cpu,cpuacct" / "x" / "cpu.cfs_quota_us", "-1\n")
    assert host.cgroup_cpu_limit(proc, root) is None
    assert host.cgroup_cpu_limit(tmp_path / "nowhere", root) is None


def test_a_container_sees_its_own_cgroup_at_the_mount_root(tmp_path):
    proc, root = tmp_path / "proc", tmp_path / "cgroup"
    write(proc / "cgroup", "0::/kubepods/pod1/c1\n")  # the host's path; the mount shows only this container
    write(root / "cpu.max", "200000 100000\n")
    assert host.cgroup_cpu_limit(proc, root) == 2.0


def test_usable_cpus_and_the_wait_policy(monkeypatch):
    from hpcpar.runtime.comm import default_wait_policy

    assert host.usable_cpus({0, 1, 2, 3}, None) == 4
    assert host.usable_cpus({0, 1, 2, 3}, 0.5) == 1
    monkeypatch.delenv("HPCPAR_WAIT", raising=False)
    assert default_wait_policy(4, cpus=2) == "yield" and default_wait_policy(2, cpus=2) == "spin"
    monkeypatch.setattr(host, "cgroup_cpu_limit", lambda: 1.0)  # a one-CPU quota on a many-core machine
    assert default_wait_policy(2) == "yield"
