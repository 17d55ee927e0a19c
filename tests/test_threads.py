"""Thread counts follow the CPUs the process may use: its affinity and its cgroup's CPU quota,
in either cgroup hierarchy, and never the machine's core count alone."""

import os
import shutil
import subprocess
import sys

import pytest

from model.threads import cgroup_cpu_limit, usable_cpus


def write(path, text):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_a_v2_quota_binds_from_the_process_cgroup_or_any_parent(tmp_path):
    write(tmp_path / "kubepods" / "cpu.max", "max 100000\n")
    write(tmp_path / "kubepods" / "pod1" / "cpu.max", "150000 100000\n")
    write(tmp_path / "kubepods" / "pod1" / "spool" / "cpu.max", "max 100000\n")
    own = "0::/kubepods/pod1/spool\n"
    assert cgroup_cpu_limit(tmp_path, own) == 1.5
    assert usable_cpus(tmp_path, own) == 1  # rounded down, as a thread past the quota only waits
    assert cgroup_cpu_limit(tmp_path, "0::/kubepods\n") is None


def test_a_v1_quota_is_read_from_the_cpu_controller(tmp_path):
    write(tmp_path / "cpu" / "docker" / "c1" / "cpu.cfs_quota_us", "300000\n")
    write(tmp_path / "cpu" / "docker" / "c1" / "cpu.cfs_period_us", "100000\n")
    write(tmp_path / "cpu" / "cpu.cfs_quota_us", "-1\n")
    write(tmp_path / "cpu" / "cpu.cfs_period_us", "100000\n")
    own = "4:memory:/docker/c1\n2:cpu,cpuacct:/docker/c1\n"
    assert cgroup_cpu_limit(tmp_path, own) == 3.0
    assert usable_cpus(tmp_path, own) == min(3, len(os.sched_getaffinity(0)))


def test_no_quota_leaves_the_affinity_and_a_tiny_one_leaves_one_thread(tmp_path):
    assert usable_cpus(tmp_path, "0::/\n") == len(os.sched_getaffinity(0))
    write(tmp_path / "cpu.max", "20000 100000\n")
    assert usable_cpus(tmp_path, "0::/\n") == 1


@pytest.mark.skipif(shutil.which("taskset") is None, reason="needs taskset (util-linux)")
def test_both_pools_take_the_affinity_mask():
    probe = ("import model, os, numba; "
             "print(os.environ['OPENBLAS_NUM_THREADS'], os.environ['NUMBA_NUM_THREADS'], numba.get_num_threads())")
    env = {k: v for k, v in os.environ.items() if k not in ("OPENBLAS_NUM_THREADS", "NUMBA_NUM_THREADS")}
    first = str(min(os.sched_getaffinity(0)))
    out = subprocess.run(["taskset", "-c", first, sys.executable, "-c", probe], env=env,
                         capture_output=True, text=True, check=True).stdout.split()
    assert out == ["1", "1", "1"]


def test_a_thread_count_the_user_set_is_kept():
    probe = "import model, os; print(os.environ['OPENBLAS_NUM_THREADS'], os.environ['NUMBA_NUM_THREADS'])"
    env = {**os.environ, "OPENBLAS_NUM_THREADS": "7", "NUMBA_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True,
                         check=True).stdout.split()
    assert out == ["7", "1"]
