"""The CPU path dispatch (model/quant/cpu.py): it follows numba's target settings, never aborts
on a CPU it does not know, and every path this machine can run computes what it should.

Each target setting runs in a subprocess with a numba cache of its own (under tmp_path), so that
code compiled for one CPU never serves another; a path forced on this CPU's own target shares
the repository's cache (numba keys it on the CPU, and the path picks kernels, not their code)."""

import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import llvmlite.binding as llvm
import pytest

from model.quant import cpu

ROOT = Path(__file__).resolve().parent.parent
SETTINGS = ("SPOOL_CPU_PATH", "NUMBA_CPU_NAME", "NUMBA_CPU_FEATURES")
CHOICE = "import json; from model.quant import cpu; print(json.dumps([cpu.PATH, cpu.F16C, cpu.PMADDWD]))"


def run(args: list[str], cache: Path | None, timeout: float = 300, **settings) -> subprocess.CompletedProcess:
    """python args under exactly these settings (none inherited), numba's cache in cache (None:
    Spool's own, model/caches.py)."""
    env = {name: value for name, value in os.environ.items() if name not in SETTINGS and name != "NUMBA_CACHE_DIR"}
    env |= {"PYTHONPATH": str(ROOT), **settings} | ({} if cache is None else {"NUMBA_CACHE_DIR": str(cache)})
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)


def choice(tmp_path: Path, **settings) -> list:
    done = run(["-c", CHOICE], tmp_path / "numba", **settings)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1])


@pytest.mark.skipif(platform.machine() != "x86_64", reason="x86 CPU names")
@pytest.mark.parametrize("name, features, want", [
    ("generic", None, ["portable", False]),  # numba adds no features to generic
    ("x86-64-v2", "", ["portable", False]),  # as QEMU's kvm64 guests: no F16C
    ("haswell", "", ["portable", True]),  # AVX2 and F16C, no AVX-512
    ("skylake-avx512", "", ["avx512", True]),
    ("x86-64-v4", "", ["avx512", True]),
])
def test_the_path_is_what_numbas_target_has(tmp_path, name, features, want):
    settings = {"NUMBA_CPU_NAME": name} | ({} if features is None else {"NUMBA_CPU_FEATURES": features})
    path, f16c, pmaddwd = choice(tmp_path, **settings)
    assert [path, f16c] == want and pmaddwd == (path != "portable")


@pytest.mark.skipif(platform.machine() != "x86_64", reason="x86 CPU names and features")
def test_the_features_string_decides_what_it_names(tmp_path):
    """Without NUMBA_CPU_FEATURES numba compiles for the host's features, whatever the name; a
    feature it turns off is off (AVX-512 needs F16C, so -f16c takes both)."""
    assert choice(tmp_path, NUMBA_CPU_NAME="haswell") == choice(tmp_path)
    assert choice(tmp_path, NUMBA_CPU_FEATURES="-f16c")[:2] == ["portable", False]


def test_the_path_is_logged_once_and_can_be_forced_down_not_up(tmp_path):
    """On this machine's own target, nothing forced (the suite itself may run with a path forced)."""
    allowed = choice(tmp_path)[0]
    done = run(["-c", "import logging; logging.basicConfig(level='INFO'); import model.quant.cpu"], tmp_path)
    logged = [line for line in done.stderr.splitlines() if "CPU path" in line]
    assert len(logged) == 1 and logged[0].startswith(f"INFO:spool.model:CPU path {allowed}: numba's target"
                                                     f" {llvm.get_host_cpu_name()} ")
    for asked in cpu.PATHS[:cpu.PATHS.index(allowed) + 1]:
        path, _, pmaddwd = choice(tmp_path, SPOOL_CPU_PATH=asked)
        assert path == asked and pmaddwd == (asked != "portable")
    for asked in list(cpu.PATHS[cpu.PATHS.index(allowed) + 1:]) + ["turbo"]:  # more than the CPU has, or no path
        done = run(["-c", CHOICE], tmp_path, SPOOL_CPU_PATH=asked)
        assert done.returncode == 0 and json.loads(done.stdout)[0] == allowed
        assert len([line for line in done.stderr.splitlines() if f"SPOOL_CPU_PATH={asked}" in line]) == 1


def test_the_default_dtype_is_q8_0_only_where_the_path_has_its_gemv():
    from model.backend import resolve

    assert resolve("cpu").dtype == ("q8_0" if cpu.PMADDWD else "float32")
    assert resolve("cpu", "q8_0").dtype == "q8_0"


PARITY = """
import numpy as np
from model.quant import cpu, pack
from model.quant.matmul import matmul
rng = np.random.default_rng(0)
for out_dim, in_dim in [(1, 32), (7, 64), (1030, 576)]:
    w = rng.standard_normal((out_dim, in_dim), dtype=np.float32)
    levels = rng.integers(0, 16, (out_dim, in_dim // 32, 32)).astype(np.float32)
    levels[..., 0], levels[..., 1] = 0, 15  # as tests/test_q8.py's q4_1: exactly Q4_1, both ends used
    scale = rng.uniform(1e-3, 0.05, (out_dim, in_dim // 32, 1)).astype(np.float16).astype(np.float32)
    low = rng.uniform(-0.4, 0.0, (out_dim, in_dim // 32, 1)).astype(np.float16).astype(np.float32)
    exact = (levels * scale + low).reshape(out_dim, in_dim)
    for strips in [pack.quantize(w), pack.exact_q4_1(exact)]:
        dense = strips.dequantize()
        for tokens in [1, 2, 17, 32, 33, 64, 100]:
            x = rng.standard_normal((tokens, in_dim), dtype=np.float32)
            want, got = x @ dense.T, matmul(x, strips)
            assert got.shape == want.shape and got.flags.c_contiguous
            # int16 activations err by a share of the products' magnitudes, which a sum that
            # cancels (one output of exactly-Q4_1 weights, all near one sign) can hide
            magnitude = (np.abs(x) @ np.abs(dense).T).max()
            np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * magnitude)
print(cpu.PATH)
"""


@pytest.mark.slow
@pytest.mark.parametrize("path", cpu.PATHS)
def test_the_packed_matmul_is_the_dequantized_one_on_every_path(path):
    """The packed matmul (the portable path's slabs above 32 rows) against dequantize-then-matmul
    at ragged shapes, 1 to 100 rows, with the path forced (Q4_1 too where the path keeps it)."""
    if cpu.PATHS.index(path) > cpu.PATHS.index(cpu.PATH):
        pytest.skip(f"this CPU does not run the {path} path")
    done = run(["-c", PARITY], None, SPOOL_CPU_PATH=path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == [path]


@pytest.fixture(scope="module")
def generic_cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("numba-generic")


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["auto", "q8_0"])
def test_a_cpu_without_avx_or_f16c_generates(generic_cache, dtype):
    """numba's generic target (SSE2 only, no F16C) compiles every kernel it uses and generates:
    float32 by default there, and q8_0 weights with float32 K/V when asked."""
    args = ["-m", "app", "generate", "--max-tokens", "4", "--dtype", dtype, "Say hi"]
    done = run(args, generic_cache, timeout=400, NUMBA_CPU_NAME="generic")
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip()
