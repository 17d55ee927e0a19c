"""A GGUF file's tensors, served in place: memory-mapped, under Hugging Face names, in
Hugging Face's row order. What model.safetensors_files.ModelTensors is for safetensors files.

Float tensors (F32, F16, BF16) come out as float32; quantized ones as their block rows
(model.quant.quantized.QuantizedTensor), copied out of the map one tensor at a time, so that its
pages go back to the page cache at once. llama.cpp stores the q/k rows of some architectures in
its rope order (Family.gguf_rope_order); they are put back by moving whole rows, which for a
quantized tensor are a fixed number of bytes each.
"""

import mmap
from pathlib import Path

import numpy as np

from model.errors import ModelError, one_line
from model.gguf.names import GGUFTensor, read_gguf_tensors
from model.quant.quantized import QuantizedTensor

_FLOATS = ("F32", "F16", "BF16")


def hf_row_order(rows: int, heads: int) -> np.ndarray:
    """Row i of the Hugging Face tensor is row order[i] of llama.cpp's: within each head, the
    (pair, 2) layout back to (2, pair)."""
    return np.arange(rows).reshape(heads, rows // heads // 2, 2).swapaxes(1, 2).reshape(rows)


class GGUFTensors:
    """The tensors of one .gguf file; read() takes one at a time. Use as a context manager: the
    map closes on exit."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.entries: dict[str, GGUFTensor] = {e.hf_name: e for e in read_gguf_tensors(self.path)}
        checked = set()
        for e in self.entries.values():
            kind = e.tensor.tensor_type
            if kind.name not in _FLOATS and len(e.shape) != 2:
                raise ModelError(f"tensor {e.tensor.name} in {self.path.name} is {kind.name} but not a matrix;"
                                 " the file is inconsistent")
            if kind not in checked:  # every backend may need the float32 values: gguf must know the type
                checked.add(kind)
                self._dequantizable(e)
        self.map: mmap.mmap | None = None

    norms_include_one = True  # llama.cpp's converter adds the 1 of unit-offset norms

    def __enter__(self) -> "GGUFTensors":
        with open(self.path, "rb") as f:
            self.map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        return self

    def __exit__(self, *_) -> None:
        self.map.close()
        self.map = None

    def quantized(self, name: str) -> bool:
        return self.entries[name].tensor.tensor_type.name not in _FLOATS

    def read(self, name: str) -> np.ndarray | QuantizedTensor:
        """Tensor name: float32, or its block rows; then its mapped pages dropped from this process."""
        e = self.entries[name]
        t = e.tensor
        offset, size = e.byte_range()
        raw = np.frombuffer(self.map, dtype=np.uint8, count=size, offset=offset)
        try:
            if self.quantized(name):
                rows = raw.reshape(e.shape[0], -1)
                rows = rows[hf_row_order(e.shape[0], e.permute_heads)] if e.permute_heads else rows.copy()
                out = QuantizedTensor(t.tensor_type.name.lower(), rows, e.shape)
            else:
                out = self._float32(raw, e)
        finally:
            del raw  # the buffer export, so that the map can close
        if hasattr(self.map, "madvise"):
            start = offset - offset % mmap.PAGESIZE
            self.map.madvise(mmap.MADV_DONTNEED, start, offset + size - start)
        return out

    def rows(self, name: str) -> np.ndarray | QuantizedTensor:
        """As read: a quantized tensor's blocks are what the packers take; a float one is read whole."""
        return self.read(name)

    def read_into(self, name: str, out: np.ndarray) -> None:
        out[...] = self.read(name)

    def _dequantizable(self, e: GGUFTensor) -> None:
        import gguf

        try:
            gguf.quants.dequantize(np.zeros(e.byte_range()[1] // e.shape[0], np.uint8), e.tensor.tensor_type)
        except NotImplementedError:
            raise ModelError(
                f"tensor {e.tensor.name} in {self.path.name} uses the quantization {e.tensor.tensor_type.name}, which"
                " the gguf package cannot dequantize; use a GGUF with another quantization (Q8_0, Q4_K, F16...)"
            ) from None

    def _float32(self, raw: np.ndarray, e: GGUFTensor) -> np.ndarray:
        import gguf

        try:
            w = np.asarray(gguf.quants.dequantize(raw, e.tensor.tensor_type)).reshape(e.shape)
        except Exception as exc:
            raise ModelError(f"tensor {e.tensor.name} in {self.path.name} is unreadable ({one_line(exc)});"
                             " re-download the file") from None
        if e.permute_heads:
            w = w[hf_row_order(e.shape[0], e.permute_heads)]
        return w.astype(np.float32)  # a copy: the map's pages are let go
