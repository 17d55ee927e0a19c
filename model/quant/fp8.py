"""FP8 (e4m3) checkpoints (quant_method "fp8", as vLLM's and llm-compressor's FP8 models hold
them), dequantized to float32 at load: each backend then keeps them as it keeps float weights
(Q8_0 on the CPU, the storage type on the GPU). No FP8 GEMM yet (cuBLASLt on sm_89 and later), so
on a GPU they take the storage type's memory.

A linear layer's `weight` is F8_E4M3 (out, in) with `weight_scale` float32: one for the tensor
(shape () or (1,)), one per output row ((out,) or (out, 1)), or, with `weight_block_size` [bo, bi]
in the config, `weight_scale_inv` (ceil(out / bo), ceil(in / bi)) per block (DeepSeek-V3's,
Qwen3's FP8). A weight is its e4m3 value times its scale. `input_scale` (static activation
scales) is not needed: activations stay in the backend's own types.
"""

import logging
from pathlib import Path

import numpy as np

from model.errors import ModelError
from model.quant.e4m3 import E4M3
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
    """A directory's safetensors whose F8_E4M3 weights read as float32 times their scales; the
    scale tensors hidden."""

    def __init__(self, model_dir: Path, block: tuple[int, int] | None):
        super().__init__(model_dir, allowed=("F8_E4M3",))
        self.block, self.files = block, self.entries
        self.entries = {name: e for name, e in self.files.items() if not name.endswith(SCALES)}
        if not any(e.dtype == "F8_E4M3" for e in self.entries.values()):
            raise ModelError(f"{model_dir}'s config.json names FP8 weights but its safetensors hold no F8_E4M3"
                             " tensors; re-download the checkpoint")
        log.info("FP8 (e4m3) weights, " + (f"scales per {block[0]} x {block[1]} block" if block else
                 "scales per tensor or row") + ": dequantized to float32 at load, then kept as float weights are"
                 " (Q8_0 on the CPU, the storage type on the GPU; no FP8 GEMM yet)")

    def read_into(self, name: str, out: np.ndarray, first: int = 0) -> None:
        e = self.entries[name]
        if e.dtype != "F8_E4M3":
            return super().read_into(name, out, first)
        codes = np.empty(e.shape, np.uint8)
        self.read_entry(e, codes)
        out[...] = self.scaled(name, E4M3[codes])[first:first + len(out)]

    def scaled(self, name: str, values: np.ndarray) -> np.ndarray:
        """values times the weight's scales (per tensor, row or block)."""
        base = name.removesuffix(".weight")
        scale_name = base + (".weight_scale_inv" if self.block else ".weight_scale")
        entry = self.files.get(scale_name)
        if entry is None:
            raise ModelError(f"FP8 tensor {name} has no {scale_name}; re-download the checkpoint")
        scale = np.empty(entry.shape, np.float32)
        self.read_entry(entry, scale)
        if self.block:
            rows, columns = values.shape
            scale = np.repeat(np.repeat(scale, self.block[0], axis=0)[:rows], self.block[1], axis=1)[:, :columns]
        elif scale.size == values.shape[0] and values.ndim == 2 and scale.size > 1:
            scale = scale.reshape(-1, 1)
        else:
            scale = scale.reshape(())
        return values * scale
