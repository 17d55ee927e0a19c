"""The CPU harness: runs Spool's unmodified .cu kernels on NumPy buffers, so CI tests every kernel
without a GPU. A kernel file is compiled with g++ and cuda/shim/spool_shim.h (which emulates
CUDA's execution model with one fiber per CUDA thread), once per source version, into the cache;
its kernels are then called the way CuPy's RawKernel is: kernel(grid, block, args, shared_mem).

Its launcher also does the GEMMs, as cuBLAS would: in fp32, the result rounded once to the
output's storage type.
"""

import ctypes
import hashlib
import os
import subprocess
import tempfile

import numpy as np

from model.default import cache_root
from model.ops.dtypes import dtype_name, to_float32, to_storage
from model.ops.kernels import CUDA_DIR, SHIM_DIR, name_expressions, sources

BUILD_DIR = cache_root() / "cuda-harness"


SCALARS = {"int32": ctypes.c_int32, "int64": ctypes.c_int64, "uint32": ctypes.c_uint32, "uint64": ctypes.c_uint64,
           "float32": ctypes.c_float}  # uint64: a null pointer (cuda_ops.NULL)


class KernelFailed(RuntimeError):
    pass


def storage(x: np.ndarray, dtype: str) -> np.ndarray:
    """A float32 array in a kernel's storage type: float32, float16, or bfloat16 as uint16 bits."""
    return to_storage(np.asarray(x, dtype=np.float32), dtype)


def as_float(x: np.ndarray, dtype: str) -> np.ndarray:
    return to_float32(x, dtype)


def poisoned(shape, dtype: str) -> np.ndarray:
    """An output buffer full of NaN, so an element a kernel never writes fails the comparison."""
    return storage(np.full(shape, np.nan, dtype=np.float32), dtype)


class Poisoned:
    """NumPy for CudaOps, but its empty arrays come full of 0xff bytes (NaN in every float type),
    so an output element a kernel never writes fails the comparison."""

    def __getattr__(self, name):
        return getattr(np, name)

    @staticmethod
    def empty(shape, dtype=np.float32):
        out = np.empty(shape, dtype)
        out.view(np.uint8).fill(0xff)
        return out

    @staticmethod
    def asnumpy(x):
        return np.asarray(x)


class CpuKernel:
    max_dynamic_shared_size_bytes = 48 << 10  # a GPU's default (less the static); a launch past it fails

    def __init__(self, function, name: str):
        self.function, self.name = function, name

    def __call__(self, grid, block, args, shared_mem: int = 0) -> None:
        if shared_mem > self.max_dynamic_shared_size_bytes:
            raise KernelFailed(f"{self.name}: {shared_mem} bytes of dynamic shared memory, past the kernel's limit"
                               f" ({self.max_dynamic_shared_size_bytes}); raise max_dynamic_shared_size_bytes first")
        grid, block = (tuple(grid) + (1, 1))[:3], (tuple(block) + (1, 1))[:3]
        keep, pointers = [], (ctypes.c_void_p * max(1, len(args)))()
        for i, a in enumerate(args):
            if isinstance(a, np.ndarray):
                assert a.flags.c_contiguous, f"{self.name}: argument {i} is not contiguous"
                value = ctypes.c_void_p(a.ctypes.data)
            elif isinstance(a, np.generic) and a.dtype.name in SCALARS:
                value = SCALARS[a.dtype.name](a.item())
            else:
                raise TypeError(f"{self.name}: pass NumPy arrays or NumPy scalars (np.int32, np.float32), not {a!r}")
            keep.append(value)
            pointers[i] = ctypes.cast(ctypes.pointer(value), ctypes.c_void_p)
        rc = self.function((ctypes.c_uint * 3)(*grid), (ctypes.c_uint * 3)(*block), ctypes.c_size_t(shared_mem),
                           pointers)
        if rc != 0:
            raise KernelFailed(f"{self.name} deadlocked in the CPU shim (a barrier some threads never reach)")


class CpuModule:
    """One .cu file built for the CPU, with every kernel instance of model/ops/kernels.py."""

    def __init__(self, file: str):
        self.expressions = name_expressions(file)
        unit = "\n".join([f'#include "{CUDA_DIR / file}"', *(
            f'extern "C" int launch_{i}(const unsigned* g, const unsigned* b, size_t s, void** a)'
            f" {{ return spool_shim::launch(&{e}, g, b, s, a); }}" for i, e in enumerate(self.expressions))])
        digest = hashlib.sha256(unit.encode())
        for path in [*sources(file), SHIM_DIR / "spool_shim.h"]:
            digest.update(path.read_bytes())
        library = BUILD_DIR / f"{file.removesuffix('.cu')}-{digest.hexdigest()[:16]}.so"
        if not library.exists():
            build(unit, library)
        self.library = ctypes.CDLL(str(library))

    def get_function(self, expression: str) -> CpuKernel:
        function = getattr(self.library, f"launch_{self.expressions.index(expression)}")
        function.restype = ctypes.c_int
        return CpuKernel(function, expression)


def build(unit: str, library) -> None:
    library.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=library.parent) as tmp:
        source, out = os.path.join(tmp, "unit.cc"), os.path.join(tmp, "unit.so")
        with open(source, "w") as f:
            f.write(unit)
        cmd = ["g++", "-std=c++20", "-O1", "-fPIC", "-shared", "-w", f"-I{SHIM_DIR}", f"-I{CUDA_DIR}",
               "-include", str(SHIM_DIR / "spool_shim.h"), "-x", "c++", source, "-o", out]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"g++ failed on the CPU shim build:\n{done.stderr[-4000:]}")
        os.replace(out, library)


class ReplayedGraph:
    """A CUDA graph's stand-in: replay runs the captured function again on the same buffers and
    writes its result into the output captured first, where a graph's kernels would write."""

    def __init__(self, fn):
        self.fn, self.output = fn, fn()

    def replay(self) -> None:
        self.output[...] = self.fn()


class CpuLauncher:
    """The Launcher protocol (model/ops/protocol.py) of CudaOps, on the CPU: function(file,
    name_expression) for the kernels, linear(x, w, bias, out) for the GEMMs, a stand-in for CUDA
    graphs, and memory_info() reporting `memory` ((free, total) bytes, set by a test)."""

    multiprocessors = 4  # a small GPU's, so that long contexts split (model/ops/decode_attention.decode_splits)

    def __init__(self, memory: tuple[int, int] | None = None):
        self.modules: dict[str, CpuModule] = {}
        self.memory = memory
        self.released = 0  # release_cached() calls

    def memory_info(self) -> tuple[int, int]:
        assert self.memory is not None, "this CpuLauncher was made without a memory size"
        return self.memory

    def synchronize(self) -> None:
        pass

    def release_cached(self) -> None:
        self.released += 1

    @staticmethod
    def pinned(size: int, dtype) -> np.ndarray:
        return np.zeros(size, dtype)

    @staticmethod
    def upload(device, host) -> None:
        device[...] = host  # done at once: no event to wait for

    @staticmethod
    def download(device) -> tuple[np.ndarray, None]:
        return device.copy(), None

    @staticmethod
    def copy_to_host(device, hosts) -> None:
        for i, host in enumerate(hosts):
            host[...] = device[i]

    @staticmethod
    def copy_to_device(hosts, after) -> np.ndarray:
        return np.stack(hosts)

    def capture(self, fn) -> ReplayedGraph:
        fn()  # the warm-up run a GPU capture makes too
        return ReplayedGraph(fn)

    def function(self, file: str, expression: str) -> CpuKernel:
        if file not in self.modules:
            self.modules[file] = CpuModule(file)
        return self.modules[file].get_function(expression)

    @staticmethod
    def linear(x, w, bias, out) -> None:
        """out = x @ w.T (+ bias), in fp32, rounded once to out's storage type."""
        dtype = dtype_name(x.dtype)
        result = to_float32(x, dtype) @ to_float32(w, dtype).T
        if bias is not None:
            result += to_float32(bias, dtype)
        out[...] = to_storage(result, dtype_name(out.dtype))


class DeviceKernel:
    """A CuPy kernel called on NumPy arrays: copied to the device, and every array argument
    copied back after the launch, so the CPU harness's tests run unchanged on a GPU."""

    def __init__(self, function):
        self.function = function

    @property
    def max_dynamic_shared_size_bytes(self) -> int:
        return self.function.max_dynamic_shared_size_bytes

    @max_dynamic_shared_size_bytes.setter
    def max_dynamic_shared_size_bytes(self, size: int) -> None:
        self.function.max_dynamic_shared_size_bytes = size

    def __call__(self, grid, block, args, shared_mem: int = 0) -> None:
        import cupy

        device = [cupy.asarray(a) if isinstance(a, np.ndarray) else a for a in args]
        self.function(tuple(grid), tuple(block), tuple(device), shared_mem=shared_mem)
        for host, dev in zip(args, device):
            if isinstance(host, np.ndarray):
                host[...] = dev.get()


class DeviceLauncher:
    def __init__(self):
        from model.ops.cupy_ops import RawModuleLauncher

        self.launcher = RawModuleLauncher()
        self.multiprocessors = self.launcher.multiprocessors

    def function(self, file: str, expression: str) -> DeviceKernel:
        return DeviceKernel(self.launcher.function(file, expression))


def gpu_available() -> bool:
    try:
        from model.ops.cupy_ops import available
    except ImportError:  # no CuPy installed
        return False
    return available()
