"""tools/bench_engine.py, the benchmark a GPU session runs on an 8B-shaped random model, run here
on a tiny random model: on the CPU as a user would, and on the CUDA path with CuPy stood in for
by the CPU harness (graphs, the overlapped loop, and the device columns from a stand-in clock),
so a device session does not find the script broken."""

import json
import subprocess
import sys
import time
import types
from pathlib import Path

import numpy as np

from cuda_harness import CpuLauncher
from model.ops.cuda_ops import CudaOps

ROOT = Path(__file__).resolve().parent.parent


def test_the_engine_benchmark_runs_on_a_random_model_of_a_shape(tmp_path):
    out = tmp_path / "bench.json"
    done = subprocess.run([sys.executable, "tools/bench_engine.py", "--shape", "tiny", "--backend", "cpu",
                           "--requests", "6", "--input-len", "20", "--output-len", "12", "--json", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    result = json.loads(out.read_text())
    assert result["backend"] == "cpu" and result["model"] == "tiny" and result["running"] == 6
    assert result["steady_steps"] >= 10 and result["steady_decode_tok_s"] > 0 and not result["graphs"]
    assert "| output tok/s |" in done.stdout


class StandInClock:
    """The DeviceClock's surface on the host's clock."""

    def mark(self):
        return time.perf_counter()

    def ms(self, a, b):
        return 1000 * (b - a)

    def synchronize(self):
        pass

    def copy_bandwidth(self):
        return 1e9


def test_the_engine_benchmark_takes_the_cuda_path(tmp_path, monkeypatch, capsys):
    sys.path.insert(0, str(ROOT / "tools"))
    import bench_engine
    import model.ops

    standin = types.SimpleNamespace(available=lambda: True,
                                    create=lambda dtype, kv="f16": CudaOps(np, CpuLauncher(), dtype, kv=kv))
    monkeypatch.setitem(sys.modules, "model.ops.cupy_ops", standin)
    monkeypatch.setattr(model.ops, "cupy_ops", standin, raising=False)
    monkeypatch.setattr(bench_engine, "DeviceClock", StandInClock)
    out = tmp_path / "bench.json"
    monkeypatch.setattr(sys, "argv", ["bench_engine.py", "--shape", "tiny", "--backend", "cuda", "--dtype", "float32",
                                      "--requests", "3", "--input-len", "10", "--output-len", "8", "--json", str(out)])
    bench_engine.main()
    result = json.loads(out.read_text())
    assert result["backend"] == "cuda" and result["graphs"] and result["steady_steps"] >= 5
    assert 0 <= result["idle_share"] <= 1 and result["floor_ms"] > 0
    assert "captured 3 decode graphs" in capsys.readouterr().out  # sizes 1, 2 and 3
