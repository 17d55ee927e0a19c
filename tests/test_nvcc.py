"""The compile check: every kernel file compiles with nvcc for sm_80 and sm_90, every kernel
instance of model/ops/kernels.py is emitted, and ptxas reports no register spills. Runs where
nvcc is installed (the CUDA toolkit; no GPU needed) and skips with the reason elsewhere."""

import re
import shutil
import subprocess

import pytest

from model.ops.kernels import CUDA_DIR, KERNELS, name_expressions

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


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
@pytest.mark.parametrize("file", sorted(KERNELS))
def test_kernel_file_compiles_without_spills(file, arch, tmp_path):
    report = ptxas_report(file, arch, tmp_path)
    functions = re.findall(r"Compiling entry function '(\w+)'", report)
    assert len(functions) == len(name_expressions(file)), report
    spills = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", report)
    assert len(spills) >= len(functions) and all(s == ("0", "0") for s in spills), report

