"""AWQ and GPTQ int4 checkpoints (what vLLM users run), read from their safetensors into int4
blocks every backend takes: packed on the GPU (cuda/dequant_gemv.cu's INT4_32 and INT4_128),
exact Q8_0 blocks on the CPU, float32 on NumPy.

The formats, as AutoAWQ and GPTQModel write them and vLLM reads them. A linear layer of
`in` inputs and `out` outputs becomes, in place of its `weight`:
- AWQ (quant_method "awq", version "gemm"): `qweight` int32 (in, out / 8), input row i's outputs
  8c .. 8c + 7 in word c, output 8c + AWQ_ORDER[s] in bits 4s .. 4s + 3 (AWQ_ORDER = 0, 2, 4,
  6, 1, 3, 5, 7); `qzeros` int32 (in / group, out / 8) packed the same way; `scales` float16
  (in / group, out). A weight is scale x (code - zero).
- GPTQ (quant_method "gptq"): `qweight` int32 (in / 8, out), input rows 8r .. 8r + 7 of output o
  in word (r, o), row 8r + s in bits 4s ..; `qzeros` int32 (in / group, out / 8), output 8c + s
  in bits 4s of word c; `scales` float16 (in / group, out); `g_idx` int32 (in,), each input row's
  group. The classic checkpoints (checkpoint_format "gptq", or none given) store each zero minus
  one (a symmetric 4-bit's 8 as 7; a zero of 0 wraps to 15 and reads back as 16, as their
  kernels read it); "gptq_v2" stores the zero itself. In act-order checkpoints (desc_act) a
  group's inputs are scattered along the row, so no block of contiguous inputs shares one scale:
  their weights are dequantized to float32 at load (scale and zero of g_idx's group), each backend
  then keeping them as it keeps float weights (Q8_0 on the CPU, the storage type on the GPU).
A group of -1 is the whole input row. Groups are multiples of 32 inputs.

The int4 block (kind int4_128 where groups are multiples of 128 inputs, else int4_32): the
group's float16 scale, its zero as a float16 (an integer 0..16), then VALUES / 2 bytes of codes,
byte i holding value i in its low nibble and value VALUES / 2 + i in its high one (Q4_0's order):
68 bytes a 128 (4.25 bits a weight, the checkpoint's 4.16), 20 a 32. Repacked at load rather than
read in the checkpoint's order so that the kernel's lanes take contiguous inputs of one output
row, as for every GGUF type, and one template serves Q4_0, Q4_1 and these. A weight is decoded
as scale x (code - zero): exact in float32 (at most 16 significant bits), and the same as a Q8_0
block of scale `scale` and codes code - zero, which is what the CPU keeps (pack_q8_0, bit for bit
the values; AutoAWQ's own torch dequantizer rounds the product to float16 instead).
"""

import json
import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from model.errors import ModelError
from model.quant.int4 import HEAD, KINDS, fields
from model.quant.quantized import QuantizedTensor
from model.safetensors_files import ModelTensors

log = logging.getLogger("spool.model")
AWQ_ORDER = np.array([0, 2, 4, 6, 1, 3, 5, 7])  # bits 4s of an AWQ word hold output 8c + AWQ_ORDER[s]


@dataclass(frozen=True)
class Int4Format:
    method: str  # "awq" or "gptq"
    group: int  # inputs a scale and zero cover; -1: the whole row
    zeros_minus_one: bool  # classic GPTQ stores each zero minus one
    act_order: bool = False  # GPTQ's desc_act: groups scattered along the input, as g_idx says

    @property
    def name(self) -> str:
        return self.method.upper()


def checkpoint_format(quantization, model_dir) -> Int4Format | None:
    """The int4 format config.json's quantization_config names, None for a method other than AWQ
    and GPTQ (refused by name elsewhere), or a one-line ModelError for a variant not loaded."""
    if not isinstance(quantization, dict) or quantization.get("quant_method") not in ("awq", "gptq"):
        return None
    method = quantization["quant_method"]
    name = method.upper()

    def refuse(why: str) -> ModelError:
        return ModelError(f"{model_dir} holds {name} weights {why}, which Spool cannot load; Spool loads 4-bit AWQ"
                          " (GEMM) and GPTQ checkpoints: use one of those, the F16/BF16 checkpoint or a GGUF file")

    bits = quantization.get("bits", quantization.get("w_bit"))
    if bits != 4:
        raise refuse(f"of {bits} bits")
    group = int(quantization.get("group_size", quantization.get("q_group_size", 128)))
    if group != -1 and (group <= 0 or group % 32):
        raise refuse(f"in groups of {group} inputs (not a multiple of 32)")
    if method == "awq":
        if str(quantization.get("version", "gemm")).lower() != "gemm":
            raise refuse(f"packed for AWQ's {quantization['version']} kernels")
        if not quantization.get("zero_point", True):
            raise refuse("without zero points")
        return Int4Format(method, group, zeros_minus_one=False)
    stored = quantization.get("checkpoint_format", quantization.get("format", "gptq"))
    if stored not in ("gptq", "gptq_v2"):
        raise refuse(f"in the {stored} layout")
    return Int4Format(method, group, zeros_minus_one=stored == "gptq", act_order=bool(quantization.get("desc_act")))


def quantization_config(model_dir: Path) -> dict | None:
    """The directory's config.json's quantization_config (ModelConfig.load has checked it)."""
    try:
        raw = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    return raw.get("quantization_config") if isinstance(raw, dict) else None


def nibbles(words: np.ndarray) -> np.ndarray:
    """Each int32 word's 8 nibbles, low first: shape (..., 8) uint8."""
    shifts = np.arange(0, 32, 4, dtype=np.uint32)
    return ((words.view(np.uint32)[..., None] >> shifts) & 15).astype(np.uint8)


def unpack(fmt: Int4Format, qweight, qzeros, scales) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(codes (out, in) uint8, zeros (out, groups) float32, scales (out, groups) float16) of one
    linear layer's tensors."""
    if fmt.method == "awq":
        codes = nibbles(qweight)[..., np.argsort(AWQ_ORDER)].reshape(qweight.shape[0], -1).T
        zeros = nibbles(qzeros)[..., np.argsort(AWQ_ORDER)].reshape(qzeros.shape[0], -1)
    else:
        codes = nibbles(qweight).transpose(0, 2, 1).reshape(-1, qweight.shape[1]).T
        zeros = nibbles(qzeros).reshape(qzeros.shape[0], -1)
    zeros = zeros.astype(np.float32) + np.float32(fmt.zeros_minus_one)
    return np.ascontiguousarray(codes), np.ascontiguousarray(zeros.T), np.ascontiguousarray(scales.T)


def kind_for(group: int, columns: int) -> str:
    """Blocks of 128 where every 128 inputs share a group and the row is whole 128s, else of 32."""
    whole = group == -1 or group >= columns
    return "int4_128" if (columns if whole else group) % 128 == 0 and columns % 128 == 0 else "int4_32"


def to_blocks(codes: np.ndarray, zeros: np.ndarray, scales: np.ndarray, group: int) -> QuantizedTensor:
    """Int4 blocks (the module docstring's) of codes (out, in), each input's group's zero and
    scale (group -1: one for the whole row)."""
    rows, columns = codes.shape
    kind = kind_for(group, columns)
    values = KINDS[kind]
    if columns % values:
        raise ModelError(f"an int4 weight of {columns} inputs, not a multiple of 32; the checkpoint is not loadable")
    first = np.arange(0, columns, values)  # each block's first input, and its group
    at = np.zeros_like(first) if group == -1 else first // group
    head = np.stack([scales[:, at].astype(np.float16), zeros[:, at].astype(np.float16)], axis=-1)
    halves = codes.reshape(rows, -1, 2, values // 2)
    body = halves[:, :, 0] | halves[:, :, 1] << 4
    blocks = np.concatenate([head.view(np.uint8).reshape(rows, -1, HEAD), body], axis=-1)
    return QuantizedTensor(kind, blocks.reshape(rows, -1), (rows, columns))


def to_q8_0(t: QuantizedTensor) -> QuantizedTensor:
    """The same values as Q8_0 blocks: each 32 inputs' group scale, codes code - zero as int8."""
    scales, zeros, codes = fields(t)
    per = KINDS[t.kind] // 32
    levels = (codes.astype(np.int16).reshape(t.shape[0], -1, per, 32) - zeros.astype(np.int16)[..., None, None])
    scale_bytes = np.repeat(scales, per, axis=1)[..., None].view(np.uint8)
    blocks = np.concatenate([scale_bytes, levels.astype(np.int8).reshape(t.shape[0], -1, 32).view(np.uint8)], axis=-1)
    return QuantizedTensor("q8_0", blocks.reshape(t.shape[0], -1), t.shape)


def int4_blocks(fmt: Int4Format, read, base: str) -> QuantizedTensor | np.ndarray:
    """Layer `base`'s int4 blocks from its checkpoint tensors (read(name) -> array); in act-order,
    its float32 values. A g_idx that scatters the groups where the config says no act-order is
    refused in one line."""
    qweight, qzeros, scales = read(base + ".qweight"), read(base + ".qzeros"), read(base + ".scales")
    codes, zeros, scale = unpack(fmt, qweight, qzeros, scales)
    contiguous = np.arange(codes.shape[1]) // (fmt.group if fmt.group != -1 else codes.shape[1])
    g_idx = read(base + ".g_idx") if fmt.method == "gptq" else None
    g_idx = contiguous if g_idx is None else g_idx.astype(np.int64)
    if fmt.act_order:
        return (codes.astype(np.float32) - zeros[:, g_idx]) * scale[:, g_idx].astype(np.float32)
    if not np.array_equal(g_idx, contiguous):
        raise ModelError(f"{base}.g_idx scatters the GPTQ groups along the input (act-order) but config.json's"
                         " desc_act is not true; the checkpoint is inconsistent: re-download or re-quantize it")
    return to_blocks(codes, zeros, scale, fmt.group)


@dataclass(frozen=True)
class Int4Entry:
    """A linear layer's weight as the loader asks for it, made of its int4 tensors."""

    dtype: str  # the kind its blocks will be; F32 in act-order
    shape: tuple[int, int]  # (out, in)
    base: str  # the tensors' common prefix


class Int4Tensors(ModelTensors):
    """A directory's safetensors with each int4 layer's qweight, qzeros, scales (and g_idx) shown
    as one `weight` entry (Int4Entry), read as its int4 blocks (float32 values in act-order)."""

    def __init__(self, model_dir: Path, fmt: Int4Format):
        super().__init__(model_dir, allowed=("I32",))
        self.fmt, self.packed = fmt, self.entries  # the file's tensors, int32 ones among them
        self.entries = {}
        for name, e in self.packed.items():
            base, _, field = name.rpartition(".")
            if field == "qweight":
                rows, columns = (e.shape[1], e.shape[0] * 8) if fmt.method == "gptq" else (e.shape[1] * 8, e.shape[0])
                kind = "F32" if fmt.act_order else kind_for(fmt.group, columns)
                self.entries[base + ".weight"] = Int4Entry(kind, (rows, columns), base)
            elif field not in ("qzeros", "scales", "g_idx") or base + ".qweight" not in self.packed:
                self.entries[name] = e  # a bias, a norm, a layer left in float
        if len(self.entries) == len(self.packed):
            raise ModelError(f"{model_dir}'s config.json names {fmt.name} weights but its safetensors hold no qweight"
                             " tensors; re-download the checkpoint")
        kinds = sorted({e.dtype for e in self.entries.values() if isinstance(e, Int4Entry)})
        if fmt.act_order:
            log.info(f"{fmt.name} int4 weights in act-order (groups of {fmt.group} inputs scattered by g_idx):"
                     " dequantized to float32 at load, then kept as float weights are (Q8_0 on the CPU, the"
                     " storage type on the GPU)")
            return
        log.info(f"{fmt.name} int4 weights (groups of {fmt.group} inputs): kept packed as {', '.join(kinds)} blocks"
                 " on --backend cuda, as Q8_0 blocks of the same values on the CPU (exact), float32 on numpy and"
                 " --dtype float32")

    def raw(self, name: str) -> np.ndarray | None:
        """A checkpoint tensor in its own type (int32, float16), None where it has none."""
        e = self.packed.get(name)
        if e is None:
            return None
        out = np.empty(e.shape, dtype={"I32": np.int32, "F16": np.float16}.get(e.dtype, np.float32))
        self.read_entry(e, out)
        return out

    def quantized(self, name: str) -> bool:
        return isinstance(self.entries[name], Int4Entry)

    def read(self, name: str):
        e = self.entries[name]
        return int4_blocks(self.fmt, self.raw, e.base) if isinstance(e, Int4Entry) else super().read(name)

    def rows(self, name: str):
        return self.read(name) if self.quantized(name) else super().rows(name)
