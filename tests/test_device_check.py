"""tools/device_check.sh is run once, on a lent GPU with minutes to spare: where CuPy cannot reach
a device it must stop at the preflight with the reason in $OUT, not spend its time failing each
part in turn."""

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
