"""FP8 (e4m3) checkpoints (quant_method "fp8", as vLLM's and llm-compressor's FP8 models hold
them): each linear layer's e4m3 bytes repacked at load into blocks of 32 or 128 with a float32
scale (model/quant/e4m3.py), which CudaOps keeps packed on the device and multiplies in
cuda/dequant_gemv.cu (W8A16: an 8B's weights plan at 9.3 GB there, not bf16's 16.1), the CPU as
Q8_0 strips of their values (as float weights, model/quant/blocks.py), NumPy as float32. FP8 GEMMs
on FP8 tensor cores (cuBLASLt on sm_89 and later) are a later step.

A linear layer's `weight` is F8_E4M3 (out, in) with `weight_scale` float32: one for the tensor
(shape () or (1,)), one per output row ((out,) or (out, 1)), or, with `weight_block_size` [bo, bi]
in the config, `weight_scale_inv` (ceil(out / bo), ceil(in / bi)) per block (DeepSeek-V3's,
Qwen3's FP8). A weight is its e4m3 value times its scale. A weight whose scales do not stay one
for each 32 inputs (bi not a multiple of 32, or a row not whole 32s) is dequantized to float32 at
load instead, and kept as float weights are. `input_scale` (static activation scales) is not
needed: activations stay in the backend's own types.
"""

import logging
from dataclasses import replace
from pathlib import Path

import numpy as np

from model.errors import ModelError
from model.quant.e4m3 import E4M3, KINDS, kind_for, to_blocks
from model.quant.quantized import QuantizedTensor
from model.safetensors_files import ModelTensors

log = logging.getLogger("spool.model")
SCALES = (".weight_scale", ".weight_scale_inv", ".input_scale")


def fp8_block(quantization, model_dir) -> tuple[int, int] | None | bool:
    """False where quantization_config is not FP8; else its weight_block_size (None: per tensor
    or per channel), refusing an FP8 of another kind in one line."""
    if not isinstance(quantization, dict) or quantization.get("quant_method") != "fp8":
        return False
    block = quantization.get("weight_block_size")
    if block is not None and (len(block) != 2 or min(block) <= 0):
        raise ModelError(f"{model_dir} holds FP8 weights in blocks of {block}, which Spool cannot load; use the"
                         " F16/BF16 checkpoint or a GGUF file")
    if quantization.get("fmt", "e4m3") != "e4m3":
        raise ModelError(f"{model_dir} holds FP8 weights in {quantization['fmt']}, which Spool cannot load (e4m3"
                         " only); use the F16/BF16 checkpoint or a GGUF file")
    return None if block is None else tuple(block)


class FP8Tensors(ModelTensors):
    """A directory's safetensors whose F8_E4M3 weights read as e4m3 blocks (an entry of their kind:
    fp8_32, fp8_128), or, where their scales do not allow blocks, as float32 times their scales;
    the scale tensors hidden."""

    def __init__(self, model_dir: Path, block: tuple[int, int] | None):
        super().__init__(model_dir, allowed=("F8_E4M3",))
        self.block, self.files = block, self.entries
        self.entries = {name: e for name, e in self.files.items() if not name.endswith(SCALES)}
        fp8 = [name for name, e in self.entries.items() if e.dtype == "F8_E4M3"]
        if not fp8:
            raise ModelError(f"{model_dir}'s config.json names FP8 weights but its safetensors hold no F8_E4M3"
                             " tensors; re-download the checkpoint")
        for name in fp8:
            e = self.entries[name]
            kind = kind_for(e.shape[1], block and block[1]) if len(e.shape) == 2 else None
            if kind:
                self.entries[name] = replace(e, dtype=kind)
        kinds = sorted({e.dtype for e in self.entries.values() if e.dtype in KINDS})
        floats = sum(self.entries[name].dtype == "F8_E4M3" for name in fp8)
        log.info("FP8 (e4m3) weights, " + (f"scales per {block[0]} x {block[1]} block" if block else
                 "scales per tensor or row") + (f": kept packed as {', '.join(kinds)} blocks (e4m3 and a float32"
                 " scale) on --backend cuda, as Q8_0 on the CPU, float32 on numpy" if kinds else "") +
                 (f"; {floats} of {len(fp8)} weights, whose scales change within 32 inputs, dequantized to float32"
                  " at load and kept as float weights are" if floats else ""))

    def quantized(self, name: str) -> bool:
        return self.entries[name].dtype in KINDS

    def read(self, name: str):
        if not self.quantized(name):
            return super().read(name)
        e = self.files[name]
        codes = np.empty(e.shape, np.uint8)
        self.read_entry(e, codes)
        kind = self.entries[name].dtype
        rows, columns = e.shape
        scales = self.scales(name, e.shape, KINDS[kind])
        blocks = to_blocks(kind, codes, np.broadcast_to(scales, (rows, columns // KINDS[kind])))
        return QuantizedTensor(kind, blocks, e.shape)

    def rows(self, name: str):
        return self.read(name) if self.quantized(name) else super().rows(name)

    def read_into(self, name: str, out: np.ndarray, first: int = 0) -> None:
        e = self.files[name]
        if e.dtype != "F8_E4M3":
            return super().read_into(name, out, first)
        codes = np.empty(e.shape, np.uint8)
        self.read_entry(e, codes)
        out[...] = (E4M3[codes] * self.scales(name, e.shape))[first:first + len(out)]

    def scales(self, name: str, shape: tuple, step: int = 1) -> np.ndarray:
        """The weight's scales at each row and every step-th input (a block's first), broadcastable
        to (rows, inputs / step): one for the tensor, one a row, or its [bo, bi] block's."""
        base = name.removesuffix(".weight")
        scale_name = base + (".weight_scale_inv" if self.block else ".weight_scale")
        entry = self.files.get(scale_name)
        if entry is None:
            raise ModelError(f"FP8 tensor {name} has no {scale_name}; re-download the checkpoint")
        scale = np.empty(entry.shape, np.float32)
        self.read_entry(entry, scale)
        if self.block:
            rows, columns = shape
            return scale[np.arange(rows) // self.block[0]][:, np.arange(0, columns, step) // self.block[1]]
        if len(shape) == 2 and scale.size == shape[0] and scale.size > 1:
            return scale.reshape(-1, 1)
        return scale.reshape(())
