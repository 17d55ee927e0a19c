"""AWQ and GPTQ int4 checkpoints made in the test from known float weights, each quantized by its
format's own rule and packed in its own layout (written here from the formats' descriptions, apart
from model/quant/awq_gptq.py's reader): what AutoAWQ and GPTQModel save."""

import json
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

from tiny_model import make_tiny_model

AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def quantize(w: np.ndarray, group: int, sym: bool):
    """w (out, in) in groups of `group` inputs (-1: the row): (codes (in, out), zeros (groups, out)
    integers, scales (groups, out) float16, the dequantized weight (out, in) float32). Asymmetric:
    scale (max - min) / 15, zero round(-min / scale); symmetric (GPTQ's sym): scale max|w| x 2 / 15,
    zero 8. Codes round(w / scale) + zero, clipped to 0..15, against the float16 scale."""
    out, columns = w.shape
    group = columns if group == -1 else group
    g = w.reshape(out, columns // group, group).astype(np.float32)
    if sym:
        top = np.abs(g).max(axis=2)
        scales = (2 * top / 15).astype(np.float16)
        zeros = np.full(top.shape, 8)
    else:
        low, high = np.minimum(g.min(axis=2), 0), np.maximum(g.max(axis=2), 0)
        scales = ((high - low) / 15).astype(np.float16)
        zeros = np.clip(np.rint(-low / scales.astype(np.float32)), 0, 15).astype(np.int64)
    s = np.maximum(scales.astype(np.float32), np.float32(1e-8))[..., None]
    codes = np.clip(np.rint(g / s) + zeros[..., None], 0, 15).astype(np.int64)
    deq = (codes - zeros[..., None]).astype(np.float32) * scales.astype(np.float32)[..., None]
    return (*(np.ascontiguousarray(m.T) for m in (codes.reshape(out, columns), zeros, scales)),
            deq.reshape(out, columns))


def words(nibbles: np.ndarray) -> np.ndarray:
    """(..., 8) nibbles, nibble s in bits 4s, as int32 words."""
    packed = np.zeros(nibbles.shape[:-1], dtype=np.uint32)
    for s in range(8):
        packed |= (nibbles[..., s].astype(np.uint32) & 15) << np.uint32(4 * s)
    return packed.view(np.int32)


def pack_awq(codes, zeros, scales) -> dict:
    """AutoAWQ's GEMM layout: codes (in, out) -> qweight (in, out / 8), nibble s of word c holding
    output 8c + AWQ_ORDER[s]; zeros the same; scales (groups, out)."""
    def columns(m):
        return words(m.reshape(m.shape[0], -1, 8)[..., AWQ_ORDER])

    return {"qweight": columns(codes), "qzeros": columns(zeros), "scales": scales}


def pack_gptq(codes, zeros, scales, g_idx, v1: bool) -> dict:
    """GPTQ's layout: qweight (in / 8, out), nibble s of word (r, o) holding input 8r + s; qzeros
    (groups, out / 8) by output as AWQ's without the reorder, each zero minus one in v1; g_idx
    each input's group."""
    columns = codes.shape[0]
    qweight = words(codes.reshape(columns // 8, 8, -1).transpose(0, 2, 1))
    stored = (zeros - 1) & 15 if v1 else zeros
    return {"qweight": qweight, "qzeros": words(stored.reshape(stored.shape[0], -1, 8)), "scales": scales,
            "g_idx": g_idx}


def make_int4_model(path: Path, method: str, group: int = 64, sym: bool = False, v1: bool = True,
                    seed: int = 0, variant: str = "llama", act_order: bool = False) -> tuple[Path, dict]:
    """A tiny llama (or qwen2, with q/k/v biases) of hidden 128 and MLP 256 whose projections are
    AWQ or GPTQ int4, the embedding, LM head and biases float16 as those checkpoints keep them; and
    the dequantized projections by name. act_order (GPTQ's desc_act): each layer's inputs taken in
    a random order, groups of `group` in that order, so g_idx scatters them."""
    from safetensors.numpy import load_file

    make_tiny_model(path, variant, tie=False, seed=seed, hidden=128, heads=4, kv_heads=2, intermediate=256, layers=2)
    floats = load_file(str(path / "model.safetensors"))
    tensors, dequantized, rng = {}, {}, np.random.default_rng(seed)
    for name, w in floats.items():
        base, layer = name.removesuffix(".weight"), name.split(".")[-2]
        if layer not in LINEARS or not name.endswith(".weight"):
            tensors[name] = w.astype(np.float16)
            continue
        order = rng.permutation(w.shape[1]) if act_order else np.arange(w.shape[1])
        at = np.argsort(order)  # input i is the at[i]-th quantized
        codes, zeros, scales, values = quantize(w[:, order], group, sym)
        codes, dequantized[name] = np.ascontiguousarray(codes[at]), values[:, at]
        g_idx = (at // (w.shape[1] if group == -1 else group)).astype(np.int32)
        packed = pack_awq(codes, zeros, scales) if method == "awq" else pack_gptq(codes, zeros, scales, g_idx, v1)
        tensors.update({f"{base}.{field}": np.ascontiguousarray(t) for field, t in packed.items()})
    save_file(tensors, str(path / "model.safetensors"))
    config = json.loads((path / "config.json").read_text())
    config["torch_dtype"] = "float16"
    config["quantization_config"] = (
        {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True, "version": "gemm"}
        if method == "awq" else
        {"quant_method": "gptq", "bits": 4, "group_size": group, "sym": sym, "desc_act": act_order,
         "checkpoint_format": "gptq" if v1 else "gptq_v2"})
    (path / "config.json").write_text(json.dumps(config))
    return path, dequantized
