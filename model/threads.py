"""How many threads the CPU kernels may run: the CPUs this process may use, not the machine's.
Affinity (taskset, a cpuset) and a cgroup CPU quota (a container's `limits.cpu`) both count.

numba already follows affinity, but neither it nor OpenBLAS reads a quota: a pod limited to 2
CPUs on a 64-core node would start 64 threads each and spend its time throttled. model/__init__
sets both pools' sizes from usable_cpus() before NumPy or numba load, unless the user already
set OPENBLAS_NUM_THREADS or NUMBA_NUM_THREADS.
"""

import math
import os
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")


def _quota_v2(directory: Path) -> float | None:
    """cpu.max holds "max PERIOD" or "QUOTA PERIOD"."""
    try:
        quota, period = (directory / "cpu.max").read_text().split()
    except (OSError, ValueError):
        return None
    return None if quota == "max" else int(quota) / int(period)


def _quota_v1(directory: Path) -> float | None:
    """cpu.cfs_quota_us is -1 when there is no quota."""
    try:
        quota = int((directory / "cpu.cfs_quota_us").read_text())
        period = int((directory / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    return None if quota <= 0 or period <= 0 else quota / period


def _cgroup_dirs(root: Path, proc_cgroup: str) -> list[tuple[Path, object]]:
    """The directories whose quota binds this process: its own cgroup and every parent, for
    the unified hierarchy (v2) and the cpu controller (v1)."""
    found = []
    for line in proc_cgroup.splitlines():
        hierarchy, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        if hierarchy == "0" and controllers == "":
            base, read = root, _quota_v2
        elif "cpu" in controllers.split(","):
            base = root / controllers if (root / controllers).is_dir() else root / "cpu"
            read = _quota_v1
        else:
            continue
        own = base / path.lstrip("/")
        found += [(d, read) for d in (own, *own.parents) if d == base or base in d.parents]
    return found


def cgroup_cpu_limit(root: Path = CGROUP_ROOT, proc_cgroup: str | None = None) -> float | None:
    """The tightest CPU quota over this process's cgroups, in CPUs; None when there is none."""
    if proc_cgroup is None:
        try:
            proc_cgroup = Path("/proc/self/cgroup").read_text()
        except OSError:
            return None
    quotas = [q for d, read in _cgroup_dirs(root, proc_cgroup) if (q := read(d)) is not None]
    return min(quotas, default=None)


def usable_cpus(root: Path = CGROUP_ROOT, proc_cgroup: str | None = None) -> int:
    """CPUs in this process's affinity mask, cut to its cgroup quota (rounded down: a thread
    more than the quota only waits to be throttled), and at least one."""
    try:
        count = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        count = os.cpu_count() or 1
    limit = cgroup_cpu_limit(root, proc_cgroup)
    if limit is not None:
        count = min(count, math.floor(limit))
    return max(1, count)


def set_thread_count(count: int) -> None:
    """--threads: both pools' sizes. NumPy's OpenBLAS and numba read these once, as they load,
    so this runs before either is imported (model/__init__ only fills in what is unset)."""
    os.environ["OPENBLAS_NUM_THREADS"] = os.environ["NUMBA_NUM_THREADS"] = str(count)
