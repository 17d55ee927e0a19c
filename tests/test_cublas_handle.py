"""The cuBLAS handle's call sequence, recorded without a GPU: cublasSetStream resets the
workspace to cuBLAS's own pool, so every GEMM must run on Spool's workspace, set again after the
last change of stream (model/ops/cublas.py). A GEMM inside a graph capture would otherwise
allocate a workspace the graph does not own."""

import pytest

from model.ops.cublas import CublasHandle

WORKSPACE, BYTES = 0x7000, 32 << 20


class RecordedCublas:
    """The three cuBLAS entry points the handle calls, each appending (name, args) to calls."""

    def __init__(self, fail: str | None = None):
        self.calls: list[tuple] = []
        self.fail = fail
        for name in ("cublasCreate_v2", "cublasSetStream_v2", "cublasSetWorkspace_v2", "cublasGemmEx"):
            setattr(self, name, self._entry(name))

    def _entry(self, name):
        class Entry:
            argtypes = None

            def __call__(_, *args):
                self.calls.append((name, args))
                return 7 if name == self.fail else 0
        return Entry()


def gemm(handle, stream):
    handle.gemm(stream, 2, 3, 4, 0x100, 0x200, 0x300, 14, 0x400, 0x500, 0)


def workspace_at_each_gemm(calls) -> list[tuple[int, int | None]]:
    """For each GEMM, (the stream set last, the workspace set since that stream was set)."""
    stream, workspace, seen = None, None, []
    for name, args in calls:
        if name == "cublasSetStream_v2":
            stream, workspace = args[1], None  # cuBLAS forgets the workspace here
        elif name == "cublasSetWorkspace_v2":
            workspace = (args[1], args[2])
        elif name == "cublasGemmEx":
            seen.append((stream, workspace))
    return seen


def test_every_gemm_runs_on_its_stream_with_spools_workspace():
    lib = RecordedCublas()
    handle = CublasHandle(lib, WORKSPACE, BYTES)
    for stream in (0, 0, 11, 11, 0, 22):  # the legacy stream, a capture stream, back, a side stream
        gemm(handle, stream)
    assert workspace_at_each_gemm(lib.calls) == [(s, (WORKSPACE, BYTES)) for s in (0, 0, 11, 11, 0, 22)]
    names = [name for name, _ in lib.calls]
    assert names.count("cublasSetStream_v2") == 4  # only when the stream changes
    assert names.count("cublasGemmEx") == 6


def test_a_failed_call_raises_and_the_next_gemm_binds_again():
    lib = RecordedCublas(fail="cublasSetWorkspace_v2")
    handle = CublasHandle(lib, WORKSPACE, BYTES)
    with pytest.raises(RuntimeError, match="cublasSetWorkspace_v2 failed: cublasStatus_t 7"):
        gemm(handle, 5)
    assert "cublasGemmEx" not in [name for name, _ in lib.calls]
    lib.fail = None
    gemm(handle, 5)  # the stream was set but the workspace not: it must be set before this GEMM
    assert workspace_at_each_gemm(lib.calls) == [(5, (WORKSPACE, BYTES))]
