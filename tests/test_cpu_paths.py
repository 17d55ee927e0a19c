"""The CPU path (model/quant/cpu.py): it follows numba's target settings, never aborts on a CPU
it does not know, and every target this machine can compile for runs the same integer kernels
to the same bits.

Each target runs in subprocesses with a numba cache of its own (under tmp_path), so that code
compiled for one CPU never serves another here whatever numba's cache keys hold."""

import json
import os
import platform
import shutil
import subprocess
import sys
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import llvmlite.binding as llvm
import numpy as np
import pytest
from numba.core.codegen import get_host_cpu_features

from model.quant import cpu
from reference import int8_activations

ROOT = Path(__file__).resolve().parent.parent
SETTINGS = ("NUMBA_CPU_NAME", "NUMBA_CPU_FEATURES")
CHOICE = ("import json; from model.quant import cpu;"
          " print(json.dumps([cpu.PATH, cpu.F16C, cpu.VNNI]))")
# numba's settings that compile for each path's CPU on this one (an empty features string: the
# name's own features, not the host's)
# (avx512 and avx2 without VNNI: pmaddubsw for the nibble schemes; avx2-vnni: AVX-VNNI's 256-bit
# vpdpbusd; the host, where it has AVX-512 VNNI, the 512-bit one)
TARGETS = {"avx512": {"NUMBA_CPU_NAME": "x86-64-v4", "NUMBA_CPU_FEATURES": ""},
           "avx2": {"NUMBA_CPU_NAME": "haswell", "NUMBA_CPU_FEATURES": ""},
           "avx2-vnni": {"NUMBA_CPU_NAME": "alderlake", "NUMBA_CPU_FEATURES": ""},
           "portable": {"NUMBA_CPU_NAME": "generic"}}
x86 = pytest.mark.skipif(platform.machine() != "x86_64", reason="x86 CPU names and features")


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


@x86
@pytest.mark.parametrize("name, features, want", [
    ("generic", None, ["portable", False, 0]),  # numba adds no features to generic
    ("x86-64-v2", "", ["portable", False, 0]),  # as QEMU's kvm64 guests: no F16C
    ("haswell", "", ["avx2", True, 0]),  # AVX2 and F16C, no AVX-512
    ("alderlake", "", ["avx2", True, 256]),  # AVX-VNNI
    ("haswell", "+avxvnni", ["avx2", True, 256]),
    ("skylake-avx512", "", ["avx512", True, 0]),
    ("x86-64-v4", "", ["avx512", True, 0]),
    ("icelake-server", "", ["avx512", True, 512]),  # AVX-512 VNNI
    ("x86-64-v4", "+avx512vnni", ["avx512", True, 512]),
])
def test_the_path_is_what_numbas_target_has(tmp_path, name, features, want):
    settings = {"NUMBA_CPU_NAME": name} | ({} if features is None else {"NUMBA_CPU_FEATURES": features})
    assert choice(tmp_path, **settings) == want


@x86
def test_the_features_string_decides_what_it_names(tmp_path):
    """Without NUMBA_CPU_FEATURES numba compiles for the host's features, whatever the name; a
    feature it turns off is off (AVX-512 needs F16C, so -f16c takes both)."""
    assert choice(tmp_path, NUMBA_CPU_NAME="haswell") == choice(tmp_path)
    path, f16c, _ = choice(tmp_path, NUMBA_CPU_FEATURES="-f16c")
    assert path != "avx512" and not f16c


@pytest.mark.parametrize("name, features, has", [
    ("apple-m1", "", True), ("neoverse-n1", "", True), ("cortex-a76", "", True),
    ("cortex-a72", "", False), ("generic", "", False), ("generic", "+dotprod", True),
])
def test_the_probe_finds_arms_dot_product(name, features, has):
    """The probe behind cpu.SDOT, asked of ARM CPUs through LLVM's AArch64 back end on this machine:
    sdot where the CPU has the dot product, the generic intrinsic expanded where it has not."""
    llvm.initialize_all_targets()
    llvm.initialize_all_asmprinters()
    marker, probe = cpu._PROBES["dotprod"]
    assembly = cpu._assembly(probe, "aarch64-unknown-linux-gnu", name, features)
    assert (marker in assembly) == has and ("smull" in assembly) == (not has)


def test_the_path_is_logged_once(tmp_path):
    done = run(["-c", "import logging; logging.basicConfig(level='INFO'); import model.quant.cpu"], tmp_path)
    logged = [line for line in done.stderr.splitlines() if "CPU path" in line]
    assert len(logged) == 1 and logged[0].startswith(f"INFO:spool.model:CPU path {choice(tmp_path)[0]}: numba's"
                                                     f" target {llvm.get_host_cpu_name()} ")


def test_the_default_dtype_is_q8_0_on_every_path():
    from model.backend import resolve

    assert resolve("cpu").dtype == "q8_0"
    assert resolve("cpu", "float32").dtype == "float32"


def host_can_run(target: str) -> bool:
    path, _, vnni = target.partition("-")
    return (platform.machine() == "x86_64" and cpu.PATHS.index(path) <= cpu.PATHS.index(cpu.PATH)
            and (not vnni or "+avxvnni" in get_host_cpu_features().split(",")))


# Every kept type (tests/test_kblocks.py's K-quant and 5-bit packers, Q4_0 and MXFP4 through
# blocks.py, and pack.py's Q8_0 and Q4_1) at ragged shapes, times 1 to 100 activation rows.
PARITY = """
import sys
import numpy as np
sys.path.insert(0, "tests")
from test_cpu_paths import kept_weights
from model.quant import cpu
from model.quant.matmul import matmul
x = np.random.default_rng(5).standard_normal((100, 768), dtype=np.float32)
outs = {f"{kind}-{tokens}": matmul(x[:tokens, :strips.shape[1]], strips)
        for kind, strips in kept_weights() for tokens in (1, 2, 17, 32, 33, 64, 100)}
np.savez(sys.argv[1], **outs)
print(cpu.PATH, cpu.VNNI)
"""


def kept_weights():
    """(kind, strips) of every kept type, at ragged shapes."""
    import gguf

    from model.quant import blocks, pack
    from model.quant.quantized import QuantizedTensor
    import test_mxfp4
    from test_kblocks import PACKERS, packed
    from test_q8 import q4_1

    rng = np.random.default_rng(0)
    yield "q8_0", pack.quantize(rng.standard_normal((1030, 576), dtype=np.float32))
    yield "q4_1", pack.exact_q4_1(q4_1(rng, 7, 64))
    w = rng.standard_normal((33, 96), dtype=np.float32)
    q4_0 = gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q4_0)
    yield "q4_0", blocks.from_gguf(QuantizedTensor("q4_0", q4_0.view(np.uint8), w.shape))
    for qtype in PACKERS:
        yield qtype.name.lower(), packed(qtype, 17, 768)
    yield "mxfp4", test_mxfp4.packed(17, 768)


# The default model's generation, less the --dtype's value and the prompt
GENERATE = ["-c", "import logging, runpy, sys; logging.basicConfig(level='INFO'); sys.argv = sys.argv[1:];"
            " runpy.run_module('app', run_name='__main__')", "app", "generate", "--max-tokens", "4", "--dtype"]


def settings_of(target: str) -> dict[str, str]:
    """numba's settings for a target: TARGETS', or no-f16c's, the host's target with F16C off."""
    return {"NUMBA_CPU_FEATURES": "-f16c"} if target == "no-f16c" else TARGETS[target]


@pytest.fixture(scope="module")
def forced(request, tmp_path_factory) -> dict[str, tuple[Path, Future]]:
    """target -> (its directory, the future {"parity" or a --dtype: that finished subprocess}) for
    every target the selected tests below ask for, started on first use. Nearly all of each run
    is numba compiling every kernel for the target, on one core, so the targets run side by side,
    one per core (CI has two); a target's runs go one after another in its own numba cache, so
    its generations compile only what its products (PARITY, into products.npz) did not."""
    runs: dict[str, list[str]] = {}  # target -> "parity" first, then the --dtype of each generation
    for params in (item.callspec.params for item in request.session.items
                   if item.module is request.module and hasattr(item, "callspec")):
        if "path" in params and host_can_run(params["path"]):  # a parity test
            runs.setdefault(params["path"], []).insert(0, "parity")
        elif "dtype" in params:  # a generation test
            runs.setdefault(params["target"], []).append(params["dtype"])
    directories = {target: tmp_path_factory.mktemp(f"forced-{target}") for target in runs}

    def run_all(target: str) -> dict[str, subprocess.CompletedProcess]:
        products = ["-c", PARITY, str(directories[target] / "products.npz")]
        return {name: run(products if name == "parity" else [*GENERATE, name, "Say hi"], directories[target] / "numba",
                          timeout=900, **settings_of(target)) for name in runs[target]}

    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:  # in the tests' order
        yield {target: (directories[target], pool.submit(run_all, target)) for target in runs}


@x86
@pytest.mark.slow
@pytest.mark.parametrize("path", list(TARGETS))
def test_every_kept_type_multiplies_the_same_bits_on_every_path(forced, path):
    """Against gguf-py's dequantize times the activations (rounded to int8 as the GEMV does),
    and bit for bit what this process computes (the integer sums are exact and the float work
    the same order on every target: vpdpbusd at 512 or 256 bits, pmaddubsw, or int16 pair
    sums, TARGETS)."""
    if not host_can_run(path):
        pytest.skip(f"this CPU cannot run the {path} path's code")
    directory, runs = forced[path]
    done = runs.result()["parity"]
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == [path.partition("-")[0], "256" if path == "avx2-vnni" else "0"]
    there = np.load(directory / "products.npz")
    from model.quant.matmul import matmul

    x = np.random.default_rng(5).standard_normal((100, 768), dtype=np.float32)
    for kind, strips in kept_weights():
        weights = strips.dequantize()
        for tokens in (1, 2, 17, 32, 33, 64, 100):
            rows = x[:tokens, :strips.shape[1]]
            got, want = there[f"{kind}-{tokens}"], int8_activations(rows) @ weights.T
            np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max(), err_msg=kind)
            np.testing.assert_array_equal(got, matmul(rows, strips), err_msg=kind)


@x86
@pytest.mark.slow
@pytest.mark.parametrize("target, dtype", [("avx2", "auto"), ("no-f16c", "auto"), ("portable", "auto"),
                                           ("portable", "float32")])
def test_the_default_model_generates_on_every_path(forced, target, dtype):
    """numba's haswell target (AVX2, no AVX-512), the host's with F16C masked off (so AVX-512 too:
    float32 K/V) and its generic one (SSE2 only, no F16C) compile every kernel they use and
    generate: q8_0 weights by default on each (float32 K/V without F16C), and float32 weights on
    generic when asked."""
    path = "avx2" if target == "no-f16c" else target
    done = forced[target][1].result()[dtype]
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip()
    assert f"CPU path {path}:" in done.stderr
    assert ("float32 K/V" in done.stderr) == (target != "avx2")


# The same multiplications on 64-bit ARM, emulated (tools/arm64_emulated.sh): strips packed here,
# multiplied there, the products compared bit for bit.
ARM64 = Path(os.environ.get("SPOOL_ARM64_ROOT", "/tmp/spool-arm64"))
ARM_PRODUCTS = """
import sys
import numpy as np
from model.quant import cpu
from model.quant.gemv import gemv
from model.quant.strips import SCHEMES
given = np.load(sys.argv[1])
outs = {}
for kind, scheme in zip(given["kinds"], given["schemes"]):
    w = SCHEMES[str(scheme)](given[f"{kind}-q"], given[f"{kind}-factors"], int(given[f"{kind}-rows"]))
    for activations in (np.int8, np.int16):
        for tokens in (1, 2, 3, 17, 100):
            x = np.ascontiguousarray(given["x"][:tokens, :w.shape[1]])
            outs[f"{kind}-{activations.__name__}-{tokens}"] = gemv(x, (w,), activations)
np.savez(sys.argv[2], **outs)
print(cpu.PATH, cpu.SDOT)
"""


@pytest.mark.slow
@pytest.mark.skipif(not (ARM64 / "site" / "numba").is_dir() or shutil.which("qemu-aarch64-static") is None,
                    reason="no emulated arm64 Python here (tools/arm64_emulated.sh setup makes one)")
@pytest.mark.parametrize("arm_cpu, sdot", [("neoverse-n1", True), ("cortex-a72", False)])
def test_arm_multiplies_the_same_bits(tmp_path, arm_cpu, sdot):
    """Every kept type at 1 to 100 rows, int8 and int16 activations, on an emulated ARM CPU with the
    dot product (sdot) and one without (plain IR): the same bits as this machine's."""
    from model.quant.gemv import gemv

    weights = dict(kept_weights())
    x = np.random.default_rng(5).standard_normal((100, 768), dtype=np.float32)
    given = {"kinds": np.array(list(weights)), "schemes": np.array([w.kind for w in weights.values()]), "x": x}
    for kind, w in weights.items():
        given |= {f"{kind}-q": w.q, f"{kind}-factors": w.factors, f"{kind}-rows": np.array(w.rows)}
    np.savez(tmp_path / "given.npz", **given)
    done = subprocess.run(["bash", "tools/arm64_emulated.sh", "run", "-c", ARM_PRODUCTS, str(tmp_path / "given.npz"),
                           str(tmp_path / "out.npz")], cwd=ROOT, capture_output=True, text=True, timeout=1800,
                          env=os.environ | {"ARM_CPU": arm_cpu, "NUMBA_CACHE_DIR": str(tmp_path / "numba")})
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["neon", str(sdot)]
    there = np.load(tmp_path / "out.npz")
    for kind, w in weights.items():
        for activations in (np.int8, np.int16):
            for tokens in (1, 2, 3, 17, 100):
                rows = np.ascontiguousarray(x[:tokens, :w.shape[1]])
                np.testing.assert_array_equal(there[f"{kind}-{activations.__name__}-{tokens}"],
                                              gemv(rows, (w,), activations), err_msg=f"{kind} {tokens}")
