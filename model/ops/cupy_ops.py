"""CudaOps on an NVIDIA GPU: CuPy arrays, GEMMs by cuBLAS, and Spool's kernels compiled from
cuda/*.cu by NVRTC through CuPy's RawModule, once per process (CuPy caches the binaries on disk,
under CUPY_CACHE_DIR). Needs the `cuda12` or `cuda13` extra and a device."""

import ctypes

import cupy
import cupyx
import numpy as np
from cuda.pathfinder import DynamicLibNotFoundError, load_nvidia_dynamic_lib

from model.errors import one_line
from model.ops.cublas import CublasHandle
from model.ops.cuda_ops import CudaOps
from model.ops.dtypes import dtype_name
from model.ops.kernels import CUDA_DIR, name_expressions

# cudaDataType_t of each storage type (library_types.h: CUDA_R_32F, CUDA_R_16F, CUDA_R_16BF).
CUDA_TYPES = {"float32": 0, "float16": 2, "bfloat16": 14}


class Gemm:
    """cublasGemmEx on a handle of Spool's own (model/ops/cublas.py), called through ctypes on the
    cuBLAS library CuPy loads. CuPy's cuBLAS wrappers refuse every call while a stream is being
    captured (their setStream raises NotImplementedError), and a decode graph must hold its
    GEMMs. The handle keeps the default pointer mode (alpha and beta on the host) and a workspace
    allocated once, so that cuBLAS allocates none per captured graph."""

    WORKSPACE = 32 << 20  # NVIDIA's size for Hopper; smaller GPUs need less

    def __init__(self):
        loaded = load_nvidia_dynamic_lib("cublas")  # what CuPy itself loaded: cached, the same handle
        lib = ctypes.CDLL(loaded.abs_path or "libcublas.so", handle=loaded._handle_uint)
        self.workspace = cupy.empty(self.WORKSPACE, dtype=np.uint8)
        self.handle = CublasHandle(lib, self.workspace.data.ptr, self.WORKSPACE)
        self.one, self.zero = np.ones(1, dtype=np.float32), np.zeros(1, dtype=np.float32)

    def __call__(self, x, w, bias, out) -> None:
        """out = x @ w.T (+ bias), accumulating in fp32 whatever the storage (CuPy's matmul knows
        no bfloat16)."""
        m, k = x.shape
        if bias is not None:
            out[...] = bias
        beta = self.one if bias is not None else self.zero
        self.handle.gemm(cupy.cuda.get_current_stream().ptr, m, w.shape[0], k, self.one.ctypes.data, w.data.ptr,
                         x.data.ptr, CUDA_TYPES[dtype_name(x.dtype)], beta.ctypes.data, out.data.ptr,
                         CUDA_TYPES[dtype_name(out.dtype)])


class RawModuleLauncher:
    """The Launcher protocol (model/ops/protocol.py) on a GPU: kernels and GEMMs, memory sizing,
    and for CUDA graphs (model/cuda_graphs.py), the overlapped step loop and the spill pool
    (model/swap.py) pinned memory, uploads, downloads, captures and side-stream copies."""

    def __init__(self):
        self.linear = Gemm()  # DynamicLibNotFoundError where cuBLAS is missing
        self.multiprocessors = cupy.cuda.Device().attributes["MultiProcessorCount"]
        self.modules: dict[str, cupy.RawModule] = {}
        self.graph_pool = None  # the memory every captured graph allocates from, and nothing else
        self.capture_stream = None  # the one stream every graph is captured on
        self.side_stream = None  # spills' copies to the host

    def function(self, file: str, expression: str):
        if file not in self.modules:
            self.modules[file] = cupy.RawModule(code=(CUDA_DIR / file).read_text(),
                                                options=("-std=c++17", f"-I{CUDA_DIR}"),
                                                name_expressions=name_expressions(file))
        return self.modules[file].get_function(expression)

    @staticmethod
    def memory_info() -> tuple[int, int]:
        return cupy.cuda.runtime.memGetInfo()

    @staticmethod
    def synchronize() -> None:
        cupy.cuda.get_current_stream().synchronize()

    @staticmethod
    def release_cached() -> None:
        """Memory CuPy's pool holds but no array uses goes back to the device."""
        cupy.get_default_memory_pool().free_all_blocks()

    @staticmethod
    def pinned(size: int, dtype) -> np.ndarray:
        """A host array in page-locked memory, so a copy from it is asynchronous."""
        return cupyx.empty_pinned(size, dtype)

    @staticmethod
    def upload(device, host):
        """Queued on the current stream, reading host when the copy runs: the event after it says
        when host may be written again."""
        stream = cupy.cuda.get_current_stream()
        device.set(host, stream=stream)
        return stream.record()

    @staticmethod
    def download(device) -> tuple[np.ndarray, object]:
        """(a pinned host array, the event after the copy into it), queued on the current stream."""
        host = cupyx.empty_pinned(device.shape, device.dtype)
        stream = cupy.cuda.get_current_stream()
        cupy.cuda.runtime.memcpyAsync(host.ctypes.data, device.data.ptr, device.nbytes,
                                      cupy.cuda.runtime.memcpyDeviceToHost, stream.ptr)
        return host, stream.record()

    def copy_to_host(self, device, hosts) -> object:
        """device[i] into hosts[i] (pinned) on a side stream, once the work queued so far is done;
        returns the event after the copies. The host and the step stream go on meanwhile."""
        if self.side_stream is None:
            self.side_stream = cupy.cuda.Stream(non_blocking=True)
        side, kind = self.side_stream, cupy.cuda.runtime.memcpyDeviceToHost
        side.wait_event(cupy.cuda.get_current_stream().record())
        for i, host in enumerate(hosts):
            cupy.cuda.runtime.memcpyAsync(host.ctypes.data, device[i].data.ptr, host.nbytes, kind, side.ptr)
        return side.record()

    @staticmethod
    def copy_to_device(hosts, after) -> "cupy.ndarray":
        """The hosts (pinned, of one shape) stacked on the device, on the step stream, after the
        event `after` (the copy that filled them)."""
        stream, kind = cupy.cuda.get_current_stream(), cupy.cuda.runtime.memcpyHostToDevice
        if after is not None:
            stream.wait_event(after)
        out = cupy.empty((len(hosts), *hosts[0].shape), dtype=hosts[0].dtype)
        for i, host in enumerate(hosts):
            cupy.cuda.runtime.memcpyAsync(out[i].data.ptr, host.ctypes.data, host.nbytes, kind, stream.ptr)
        return out

    def capture(self, fn) -> "CapturedGraph":
        """fn's kernels as a CUDA graph. fn runs once eagerly first (compiling its kernels and
        filling the graph pool), then under capture on a side stream. Its allocations come from
        a pool of their own: memory a graph uses as scratch must never be handed to eager code,
        which may hold it across a replay. Every graph is captured on one stream with that one
        pool, as vLLM does, so the graphs (replayed one at a time) share their scratch memory."""
        if self.graph_pool is None:
            self.graph_pool = cupy.cuda.MemoryPool()
            self.capture_stream = cupy.cuda.Stream(non_blocking=False)  # ordered with the legacy stream
        stream = self.capture_stream
        with cupy.cuda.using_allocator(self.graph_pool.malloc), stream:
            fn()
            stream.synchronize()
            stream.begin_capture()
            try:
                output = fn()
            finally:
                graph = stream.end_capture()
        graph.upload()
        return CapturedGraph(graph, output)


class CapturedGraph:
    def __init__(self, graph, output):
        self.graph, self.output = graph, output

    def replay(self) -> None:
        self.graph.launch(stream=cupy.cuda.get_current_stream())


def available() -> bool:
    """A device CuPy can use: import alone succeeds without one (FIELD-NOTES)."""
    try:
        return cupy.cuda.is_available()
    except Exception:
        return False


def create(dtype: str = "bfloat16", kv: str = "f16") -> CudaOps:
    try:
        launcher = RawModuleLauncher()
    except DynamicLibNotFoundError as e:
        raise ValueError(f"CuPy cannot load cuBLAS ({one_line(e)}); install the CUDA libraries with the cuda12 or cuda13"
                         " extra, which brings CuPy's [ctk]") from None
    return CudaOps(cupy, launcher, dtype, kv)
