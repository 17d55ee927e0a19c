"""The compile check: every kernel file compiles with nvcc for sm_80 and sm_90, every kernel
instance of model/ops/kernels.py is emitted, ptxas reports no register spills and no stack
frame, and each kernel's registers stay under its ceiling in cuda/registers.toml. Runs where
nvcc is installed (the CUDA toolkit; no GPU needed) and skips with the reason elsewhere.

Each nvcc run keeps to one core, so the files compile side by side, one per core (CI has two)."""

import os
import re
import shutil
import subprocess
import tomllib
from concurrent.futures import Future, ThreadPoolExecutor

import pytest

from model.ops.kernels import CUDA_DIR, KERNELS, name_expressions

REGISTERS = tomllib.loads((CUDA_DIR / "registers.toml").read_text())

NVCC = shutil.which("nvcc")
pytestmark = pytest.mark.skipif(NVCC is None, reason="nvcc is not installed (the CUDA toolkit); nothing to check")


def ptxas_report(file: str, arch: str, tmp_path) -> str:
    """nvcc's verbose ptxas output for the file with every instance taken by address, so each
    is compiled (CuPy's name_expressions do the same at run time)."""
    unit = tmp_path / f"{file}.{arch}.cu"
    keep = ", ".join(f"(void*)&{e}" for e in name_expressions(file))
    unit.write_text(f'#include "{CUDA_DIR / file}"\nvoid* spool_instances[] = {{{keep}}};\n')
    done = subprocess.run([NVCC, f"-arch={arch}", "--cubin", "-std=c++17", "-Xptxas", "-v", f"-I{CUDA_DIR}",
                           "-o", str(tmp_path / f"{file}.{arch}.cubin"), str(unit)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-4000:]
    return done.stderr


def kernel_of(mangled: str, file: str) -> str:
    """The kernel of KERNELS[file] an entry is an instance of: Itanium mangling spells a name as
    its length then its letters (_Z6sample..., _Z16decode_attentionI...)."""
    return next(k for k in KERNELS[file] if mangled.startswith(f"_Z{len(k)}{k}"))


def test_every_kernel_has_a_register_ceiling():
    assert set(REGISTERS) == {k for kernels in KERNELS.values() for k in kernels}


@pytest.fixture(scope="module")
def reports(request, tmp_path_factory) -> dict[tuple[str, str], Future]:
    """(file, arch) -> the future ptxas report for every compile the selected tests below check,
    all started on first use."""
    selected = [item.callspec.params for item in request.session.items
                if item.module is request.module and hasattr(item, "callspec")]
    wanted = [(params["file"], params["arch"]) for params in selected if "arch" in params]
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        yield {(file, arch): pool.submit(ptxas_report, file, arch, tmp_path_factory.mktemp("nvcc"))
               for file, arch in wanted}


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
@pytest.mark.parametrize("file", sorted(KERNELS))
def test_kernel_file_compiles_without_spills_under_its_register_ceiling(file, arch, reports):
    report = reports[file, arch].result()
    functions = re.findall(r"Compiling entry function '(\w+)'", report)
    assert len(functions) == len(name_expressions(file)), report
    frames = re.findall(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", report)
    assert len(frames) >= len(functions) and all(f == ("0", "0", "0") for f in frames), report
    used = re.findall(r"Compiling entry function '(\w+)'.*?Used (\d+) registers", report, re.S)
    assert len(used) == len(functions), report
    over = [(name, int(n)) for name, n in used if int(n) > REGISTERS[kernel_of(name, file)]]
    assert not over, f"over the ceiling in cuda/registers.toml: {over}"



@pytest.mark.parametrize("file", ["sampling.cu", "moe.cu"])
def test_the_warp_intrinsic_kernels_compile_for_turing(file, tmp_path):
    """sm_75 (a T4) has __match_any_sync but not __reduce_add_sync: the sampler's histograms
    take each lane's own atomic there (the same integer sums)."""
    ptxas_report(file, "sm_75", tmp_path)
