"""Weights from safetensors files into float32 NumPy arrays, fused the way the forward pass wants.

The reader is our own (the format is a JSON header and raw bytes) for two reasons: NumPy has no
bfloat16, which most Hugging Face checkpoints use, and a truncated or corrupt file must become
one clear line rather than a deep library traceback.
"""

import json
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from model.config import ModelConfig
from model.errors import ModelError

_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16, "F64": np.float64}


def _corrupt(path: Path, why: str) -> ModelError:
    return ModelError(
        f"{path} is corrupt or truncated ({why}); delete it and re-download or re-convert the model"
    )


def read_safetensors(path: Path) -> dict[str, np.ndarray]:
    """All tensors of one file as float32 arrays."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise _corrupt(path, "no header")
            (header_len,) = struct.unpack("<Q", head)
            if header_len > min(size - 8, 100 << 20):
                raise _corrupt(path, "header length past the end of the file")
            header = json.loads(f.read(header_len))
    except (ValueError, UnicodeDecodeError) as e:
        raise _corrupt(path, f"unreadable header: {e}") from None
    except OSError as e:
        raise ModelError(f"cannot read {path} ({e.strerror}); check the path and its permissions") from None
    if not isinstance(header, dict):
        raise _corrupt(path, "header is not a JSON object")
    data_start = 8 + header_len
    raw = np.memmap(path, dtype=np.uint8, mode="r")
    tensors = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype = _DTYPES[info["dtype"]]
            begin, end = info["data_offsets"]
            shape = tuple(info["shape"])
        except (KeyError, TypeError, ValueError):
            raise _corrupt(path, f"bad entry for tensor {name!r}") from None
        if data_start + end > size:
            raise _corrupt(path, f"tensor {name!r} runs past the end of the file")
        count = int(np.prod(shape, dtype=np.int64))
        if end - begin != count * np.dtype(dtype).itemsize:
            raise _corrupt(path, f"tensor {name!r} has {end - begin} bytes for shape {shape}")
        arr = raw[data_start + begin : data_start + end].view(dtype).reshape(shape)
        if info["dtype"] == "BF16":
            arr = (arr.astype(np.uint32) << 16).view(np.float32)
        tensors[name] = arr.astype(np.float32)
    return tensors


def read_model_tensors(model_dir: Path) -> dict[str, np.ndarray]:
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise ModelError(
            f"{model_dir} has no .safetensors weights; convert the checkpoint to safetensors"
            " or pass --model with a .gguf file"
        )
    tensors = {}
    for path in files:
        tensors.update(read_safetensors(path))
    return tensors


@dataclass
class LayerWeights:
    attn_norm: np.ndarray  # (hidden,)
    wqkv: np.ndarray  # (q + 2 kv, hidden): q, k and v projections in one GEMM
    bqkv: np.ndarray | None  # (q + 2 kv,) for Qwen2
    q_norm: np.ndarray | None  # (head_dim,) for Qwen3
    k_norm: np.ndarray | None
    wo: np.ndarray  # (hidden, q)
    mlp_norm: np.ndarray
    w_gate_up: np.ndarray  # (2 * intermediate, hidden): gate and up in one GEMM
    w_down: np.ndarray  # (hidden, intermediate)


@dataclass
class Weights:
    embed: np.ndarray  # (vocab, hidden)
    layers: list[LayerWeights]
    norm: np.ndarray
    lm_head: np.ndarray  # (vocab, hidden); the embedding itself when tied


def load_weights(model_dir: Path, config: ModelConfig) -> Weights:
    t = read_model_tensors(model_dir)

    def take(name: str, shape: tuple) -> np.ndarray:
        if name not in t:
            raise ModelError(
                f"tensor {name} is missing from {model_dir}; the checkpoint does not match its"
                " config.json: re-download or re-convert it"
            )
        arr = t.pop(name)
        if arr.shape != shape:
            raise ModelError(
                f"tensor {name} has shape {arr.shape}, config.json implies {shape};"
                " re-download or re-convert the model"
            )
        return arr

    c = config
    H, Q, KV, D = c.hidden_size, c.q_size, c.kv_size, c.head_dim
    layers = []
    for i in range(c.num_layers):
        p = f"model.layers.{i}."
        a = p + "self_attn."
        bias = None
        if c.attention_bias:
            bias = np.concatenate([take(a + "q_proj.bias", (Q,)), take(a + "k_proj.bias", (KV,)),
                                   take(a + "v_proj.bias", (KV,))])
        layers.append(LayerWeights(
            attn_norm=take(p + "input_layernorm.weight", (H,)),
            wqkv=np.concatenate([take(a + "q_proj.weight", (Q, H)), take(a + "k_proj.weight", (KV, H)),
                                 take(a + "v_proj.weight", (KV, H))]),
            bqkv=bias,
            q_norm=take(a + "q_norm.weight", (D,)) if c.qk_norm else None,
            k_norm=take(a + "k_norm.weight", (D,)) if c.qk_norm else None,
            wo=take(a + "o_proj.weight", (H, Q)),
            mlp_norm=take(p + "post_attention_layernorm.weight", (H,)),
            w_gate_up=np.concatenate([take(p + "mlp.gate_proj.weight", (c.intermediate_size, H)),
                                      take(p + "mlp.up_proj.weight", (c.intermediate_size, H))]),
            w_down=take(p + "mlp.down_proj.weight", (H, c.intermediate_size)),
        ))
    embed = take("model.embed_tokens.weight", (c.vocab_size, H))
    if c.tie_word_embeddings or "lm_head.weight" not in t:
        lm_head = embed
    else:
        lm_head = take("lm_head.weight", (c.vocab_size, H))
    return Weights(embed=embed, layers=layers, norm=take("model.norm.weight", (H,)), lm_head=lm_head)
