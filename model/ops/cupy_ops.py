"""CudaOps on an NVIDIA GPU: CuPy arrays, GEMMs by cuBLAS (cupy.matmul), and Spool's kernels
compiled from cuda/*.cu by NVRTC through CuPy's RawModule, once per process (CuPy caches the
binaries on disk, under CUPY_CACHE_DIR). Needs the `cuda12` or `cuda13` extra and a device."""

import cupy

from model.ops.cuda_ops import CudaOps
from model.ops.kernels import CUDA_DIR, name_expressions


class RawModuleLauncher:
    """The launcher interface of cuda_ops on a GPU: function(file, name_expression)."""

    def __init__(self):
        self.modules: dict[str, cupy.RawModule] = {}

    def function(self, file: str, expression: str):
        if file not in self.modules:
            self.modules[file] = cupy.RawModule(code=(CUDA_DIR / file).read_text(),
                                                options=("-std=c++17", f"-I{CUDA_DIR}"),
                                                name_expressions=name_expressions(file))
        return self.modules[file].get_function(expression)


def available() -> bool:
    """A device CuPy can use: import alone succeeds without one (FIELD-NOTES)."""
    try:
        return cupy.cuda.is_available()
    except Exception:
        return False


def create(dtype: str = "float32") -> CudaOps:
    return CudaOps(cupy, RawModuleLauncher(), dtype)
