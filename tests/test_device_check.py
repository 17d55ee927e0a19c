"""tools/device_check.sh is run once, on a lent GPU with minutes to spare: where CuPy cannot reach
a device it must stop at the preflight with the reason in $OUT, not spend its time failing each
part in turn; and its parts, correctness first, fit the one call its header gives."""

import re

import subprocess
from pathlib import Path

import pytest

from cuda_harness import gpu_available

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.skipif(gpu_available(), reason="a GPU is here: the preflight would pass")
def test_without_a_device_the_check_stops_at_the_preflight(tmp_path):
    env = {"OUT": str(tmp_path), "PATH": "/usr/local/bin:/usr/bin:/bin"}
    done = subprocess.run(["bash", "tools/device_check.sh"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "preflight FAILED" in (tmp_path / "error.txt").read_text()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["device.txt", "error.txt"]  # no part ran


def test_the_parts_fit_the_one_call_the_header_gives():
    done = subprocess.run(["bash", "tools/device_check.sh", "--plan"], cwd=ROOT, capture_output=True, text=True,
                          timeout=30)
    lines = done.stdout.split()
    total, parts = int(lines[1]), [line.split(":") for line in lines[2:]]
    assert lines[0] == "total" and parts[0][0] == "pytest"  # correctness first
    assert sum(int(seconds) for _, seconds in parts) == total <= 300
    header = (ROOT / "tools/device_check.sh").read_text()
    call = int(re.search(r"timeout_s (\d+)", header).group(1))
    assert total + 30 <= call <= 600  # room for the install and the preflight, under the tool's limit
    for name, _ in parts:
        assert re.search(rf"^(run|engine) {name} ", header, re.M), name
