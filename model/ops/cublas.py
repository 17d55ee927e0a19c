"""One cuBLAS handle bound to the stream it runs on, with a workspace of Spool's own.

cublasSetStream resets the handle's workspace to cuBLAS's default pool (cuBLAS's documentation
of cublasSetStream), so a GEMM after it would allocate its own workspace: inside a CUDA graph
capture that is an allocation the graph does not own. The handle therefore sets its workspace
again after every change of stream, and sets the stream only when it changes. No CuPy here: the
library is passed in (model/ops/cupy_ops.py loads the one CuPy loaded), so the call sequence is
testable without a GPU.
"""

import ctypes

# cublas_api.h: CUBLAS_OP_N, CUBLAS_OP_T, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT
OP_N, OP_T, COMPUTE_32F, GEMM_DEFAULT = 0, 1, 68, -1


def check(call: str, status: int) -> None:
    if status != 0:
        raise RuntimeError(f"{call} failed: cublasStatus_t {status}")


class CublasHandle:
    def __init__(self, lib, workspace: int, workspace_bytes: int):
        p, i = ctypes.c_void_p, ctypes.c_int
        lib.cublasGemmEx.argtypes = [p, i, i, i, i, i, p, p, i, i, p, i, i, p, p, i, i, i, i]
        lib.cublasSetStream_v2.argtypes = [p, p]
        lib.cublasSetWorkspace_v2.argtypes = [p, p, ctypes.c_size_t]
        self.lib, self.workspace, self.workspace_bytes = lib, workspace, workspace_bytes
        self.handle = p()
        check("cublasCreate_v2", lib.cublasCreate_v2(ctypes.byref(self.handle)))
        self.stream = None  # the stream the handle is bound to; None until the first GEMM

    def bind(self, stream: int) -> None:
        """Run on stream (a cudaStream_t as an int), with Spool's workspace."""
        if stream == self.stream:
            return
        check("cublasSetStream_v2", self.lib.cublasSetStream_v2(self.handle, stream))
        self.stream = None  # until the workspace is back
        check("cublasSetWorkspace_v2", self.lib.cublasSetWorkspace_v2(self.handle, self.workspace,
                                                                     self.workspace_bytes))
        self.stream = stream

    def gemm(self, stream: int, m: int, n: int, k: int, alpha: int, w: int, x: int, storage: int, beta: int,
             out: int, out_type: int) -> None:
        """Row-major out (m, n) = x (m, k) @ w (n, k).T on stream, accumulating in fp32: as
        column-major, out.T = w @ x.T, hence OP_T on w. alpha and beta point to host floats."""
        self.bind(stream)
        check("cublasGemmEx", self.lib.cublasGemmEx(self.handle, OP_T, OP_N, n, m, k, alpha, w, storage, k, x,
                                                    storage, k, beta, out, out_type, n, COMPUTE_32F, GEMM_DEFAULT))
