"""Weights from memory-mapped safetensors files, or from a GGUF file in place
(model/gguf/tensors.py), fused the way the forward pass wants and prepared for the ops (packed,
or copied to a device) one layer at a time.

The reader is our own (the format is a JSON header and raw bytes) for two reasons: NumPy has no
bfloat16, which most Hugging Face checkpoints use, and a truncated or corrupt file must become
one clear line rather than a deep library traceback. No float32 copy of the whole model ever
exists: a tensor is converted only when taken, into the array that goes to the ops, and its
mapped pages are handed back to the page cache once read. A GGUF's quantized tensors go to the
ops as their blocks (model/quant/quantized.py), never as float32 unless the ops want that; a
safetensors embedding and LM head go unread (FloatRows), for packing ops to read a slab of rows
at a time.
"""

import json
import mmap
import struct
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

import numpy as np

from model.config import ModelConfig
from model.errors import ModelError
from model.quant.quantized import FloatRows, float32, fuse, take_rows
from model.rope import rotary_dim, rotary_row_order

GGUF_NAME = "model.gguf"  # in a model directory: the GGUF its weights are read from, in place

_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16, "F64": np.float64}
# safetensors dtypes that hold quantized weights (FP8, or integers packing GPTQ, AWQ,
# bitsandbytes or compressed-tensors codes): refused by name, not as corruption
_QUANTIZED_DTYPES = {"F8_E4M3": "FP8", "F8_E5M2": "FP8", "I8": "8-bit integer",
                     "U8": "packed integer", "I32": "packed integer"}


def _corrupt(path: Path, why: str) -> ModelError:
    return ModelError(
        f"{path} is corrupt or truncated ({why}); delete it and re-download or re-convert the model"
    )


@dataclass(frozen=True)
class _Entry:
    path: Path
    dtype: str  # the file's name for it: F32, F16, BF16, F64
    shape: tuple
    begin: int  # byte offsets in the file
    end: int


def _read_header(path: Path) -> dict[str, _Entry]:
    """Every tensor's place in one file, checked against the file's size."""
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
    entries = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype = info["dtype"]
            if dtype in _QUANTIZED_DTYPES:
                raise ModelError(
                    f"{path} holds {_QUANTIZED_DTYPES[dtype]} weights (tensor {name!r} is {dtype}),"
                    " which Spool cannot load; use the original F16/BF16 checkpoint or a GGUF file"
                )
            itemsize = np.dtype(_DTYPES[dtype]).itemsize
            begin, end = info["data_offsets"]
            shape = tuple(int(n) for n in info["shape"])
        except (KeyError, TypeError, ValueError):
            raise _corrupt(path, f"bad entry for tensor {name!r}") from None
        if data_start + end > size:
            raise _corrupt(path, f"tensor {name!r} runs past the end of the file")
        if end - begin != int(np.prod(shape, dtype=np.int64)) * itemsize:
            raise _corrupt(path, f"tensor {name!r} has {end - begin} bytes for shape {shape}")
        entries[name] = _Entry(path, dtype, shape, data_start + begin, data_start + end)
    return entries


# where other checkpoints keep the causal LM's "model." tensors: a base model's (Qwen3-Embedding
# saves its Qwen3Model), and a vision-language model's language model (Gemma 3 4B-27B, as
# transformers 4 and 5 save it; the vision tower's tensors are left unread)
_MODEL_PREFIXES = ("", "language_model.model.", "model.language_model.")


def _causal_lm_names(entries: dict) -> dict:
    if "model.embed_tokens.weight" in entries:
        return entries
    for prefix in _MODEL_PREFIXES:
        if prefix + "embed_tokens.weight" in entries:
            return {name if name == "lm_head.weight" else "model." + name[len(prefix):]: e
                    for name, e in entries.items() if name.startswith(prefix) or name == "lm_head.weight"}
    return entries


class ModelTensors:
    """The tensors of a model directory's safetensors files (one or sharded), memory-mapped;
    read_into converts one tensor at a time. Use as a context manager: the maps close on exit."""

    def __init__(self, model_dir: Path):
        files = sorted(Path(model_dir).glob("*.safetensors"))
        if not files:
            raise ModelError(
                f"{model_dir} has no .safetensors weights; convert the checkpoint to safetensors"
                " or pass --model with a .gguf file"
            )
        self.entries: dict[str, _Entry] = {}
        for path in files:
            self.entries.update(_read_header(path))
        self.entries = _causal_lm_names(self.entries)
        self.maps: dict[Path, mmap.mmap] = {}

    norms_include_one = False  # Gemma's norms as its checkpoints store them: w, for 1 + w

    def __enter__(self) -> "ModelTensors":
        return self

    def __exit__(self, *_) -> None:
        for m in self.maps.values():
            m.close()
        self.maps.clear()

    def read_into(self, name: str, out: np.ndarray, first: int = 0) -> None:
        """Tensor `name` (its rows first .. first + len(out), where out holds fewer), converted to
        out's dtype (float32 from BF16 with no temporary), then those mapped pages dropped from
        this process (the page cache keeps them)."""
        e = self.entries[name]
        m = self.maps.get(e.path)
        if m is None:
            with open(e.path, "rb") as f:
                m = self.maps[e.path] = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        dtype = np.dtype(_DTYPES[e.dtype])
        begin = e.begin + first * int(np.prod(e.shape[1:], dtype=np.int64)) * dtype.itemsize
        end = begin + out.size * dtype.itemsize
        raw = np.frombuffer(m, dtype=dtype, count=out.size, offset=begin).reshape(out.shape)
        if e.dtype == "BF16":
            bits = out.view(np.uint32)
            bits[...] = raw
            bits <<= 16
        else:
            out[...] = raw
        del raw  # the buffer export, so that the map can close
        if hasattr(m, "madvise"):
            start = begin - begin % mmap.PAGESIZE
            m.madvise(mmap.MADV_DONTNEED, start, end - start)

    def rows(self, name: str) -> FloatRows:
        """Tensor `name` unread, for ops.weight to take a slab of rows at a time."""
        return FloatRows(self.entries[name].shape, lambda first, out: self.read_into(name, out, first))

    def quantized(self, name: str) -> bool:
        """Never: safetensors hold float tensors only."""
        return False

    def read(self, name: str) -> np.ndarray:
        out = np.empty(self.entries[name].shape, dtype=np.float32)
        self.read_into(name, out)
        return out


def open_tensors(model_dir: Path):
    """The directory's tensors: its model.gguf (the file itself, or a link to it) where it has
    one, else its safetensors files."""
    gguf_file = Path(model_dir) / GGUF_NAME
    if gguf_file.is_symlink() and not gguf_file.exists():
        raise ModelError(
            f"{gguf_file} links to {gguf_file.readlink()}, which no longer exists; Spool reads a GGUF's weights"
            " in place: pass --model with the .gguf file again"
        )
    if gguf_file.exists():
        from model.gguf.tensors import GGUFTensors

        return GGUFTensors(gguf_file.resolve())  # errors name the file the user gave
    return ModelTensors(model_dir)


def read_model_tensors(model_dir: Path) -> dict[str, np.ndarray]:
    """Every tensor as float32 at once: for references in tests, never for serving."""
    with open_tensors(model_dir) as tensors:
        return {name: float32(tensors.read(name)) for name in tensors.entries}


def expert_tensor_names(model_type: str, layer: int) -> tuple[str, dict[str, str]]:
    """Where a checkpoint keeps layer's router (prefix + "gate.weight") and expert e's matrices
    (prefix + f"experts.{e}.{names[part]}.weight" for part gate, up, down): Mixtral's w1, w3, w2."""
    if model_type == "mixtral":
        return f"model.layers.{layer}.block_sparse_moe.", {"gate": "w1", "up": "w3", "down": "w2"}
    return f"model.layers.{layer}.mlp.", {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}


@dataclass
class Experts:
    """A mixture of experts in place of the MLP: the router, and every expert's gate/up and down
    stacked along their rows (expert e's gate then up rows from e x 2 x intermediate, its down
    rows from e x hidden), so that a backend multiplies the rows routed to an expert as one GEMM
    and every expert's as one grouped call."""

    router: np.ndarray  # (experts, hidden), float32 on every backend as llama.cpp keeps it
    gate_up: np.ndarray  # (experts x 2 x intermediate, hidden)
    down: np.ndarray  # (experts x hidden, intermediate)
    top_k: int
    normalize: bool  # the top k's weights rescaled to sum to 1

    @property
    def count(self) -> int:
        return self.router.shape[0]

    @property
    def nbytes(self) -> int:
        return self.router.nbytes + self.gate_up.nbytes + self.down.nbytes

    def prepared(self, prepare: Callable, keep_float: Callable) -> "Experts":
        """The experts' matrices through prepare (ops.weight), the router through keep_float
        (ops.asarray): routing on rounded weights would choose other experts than the checkpoint's."""
        return replace(self, router=keep_float(float32(self.router)), gate_up=prepare(self.gate_up),
                       down=prepare(self.down))


@dataclass
class LayerWeights:
    attn_norm: np.ndarray  # (hidden,)
    wqkv: np.ndarray  # (q + 2 kv, hidden): q, k and v projections in one GEMM
    bqkv: np.ndarray | None  # (q + 2 kv,) for Qwen2
    q_norm: np.ndarray | None  # (head_dim,) for Qwen3; (q,) for OLMoE
    k_norm: np.ndarray | None
    wo: np.ndarray  # (hidden, q)
    mlp_norm: np.ndarray
    w_gate_up: np.ndarray | None  # (2 * intermediate, hidden): gate and up in one GEMM; None with experts
    w_down: np.ndarray | None  # (hidden, intermediate)
    post_attn_norm: np.ndarray | None = None  # Gemma: the attention's output normalised before the residual add
    post_mlp_norm: np.ndarray | None = None  # Gemma: the same for the MLP's
    experts: Experts | None = None  # a mixture of experts' layer: in place of w_gate_up and w_down


@dataclass
class Weights:
    embed: np.ndarray  # (vocab, hidden)
    layers: list[LayerWeights]
    norm: np.ndarray
    lm_head: np.ndarray  # (vocab, hidden); the embedding itself when tied


def prepared(layer: LayerWeights, prepare: Callable, keep_float: Callable = float32) -> LayerWeights:
    """A layer as read (float32 arrays, a GGUF's blocks) as the ops keep it (ops.weight on each;
    a router through keep_float, ops.asarray: Experts.prepared)."""
    return replace(layer, **{k: v.prepared(prepare, keep_float) if isinstance(v, Experts) else prepare(v)
                             for k, v in vars(layer).items() if v is not None})


def load_weights(model_dir: Path, config: ModelConfig, prepare: Callable = float32,
                 progress: bool | None = None, keep_float: Callable = float32) -> Weights:
    """The model's weights through prepare (ops.weight; float32 arrays by default), one layer's
    tensors at a time; routers through keep_float (ops.asarray).
    progress: a bar on stderr; None shows it only when stderr is a terminal."""
    from tqdm import tqdm

    with open_tensors(model_dir) as tensors:
        bar = tqdm(total=config.num_layers + 1, desc=f"Loading {Path(model_dir).name}", unit="layer",
                   disable=None if progress is None else not progress, leave=False)
        reader = _LayerReader(tensors, model_dir, config)
        layers = []
        for i in range(config.num_layers):
            layers.append(prepared(reader.layer(i), prepare, keep_float))
            bar.update()
        embed, norm, lm_head = reader.outer(prepare)
        bar.update()
        bar.close()
    return Weights(embed=embed, layers=layers, norm=norm, lm_head=lm_head)


class _LayerReader:
    """Reads a layer's tensors, checked against config.json's shapes, fused into their GEMMs."""

    def __init__(self, tensors, model_dir: Path, config: ModelConfig):  # ModelTensors or GGUFTensors
        self.tensors, self.model_dir, self.config = tensors, model_dir, config

    def check(self, name: str, shape: tuple) -> None:
        if name not in self.tensors.entries:
            raise ModelError(
                f"tensor {name} is missing from {self.model_dir}; the checkpoint does not match its"
                " config.json: re-download or re-convert it"
            )
        if self.tensors.entries[name].shape != shape:
            raise ModelError(
                f"tensor {name} has shape {self.tensors.entries[name].shape}, config.json implies {shape};"
                " re-download or re-convert the model"
            )

    def take(self, name: str, shape: tuple) -> np.ndarray:
        self.check(name, shape)
        return self.tensors.read(name)

    def norm(self, name: str, shape: tuple) -> np.ndarray:
        """An RMSNorm's weight as the ops multiply by it: Gemma's checkpoints store w for a scale
        of 1 + w (llama.cpp's GGUFs store 1 + w already)."""
        w = self.take(name, shape)
        return w + np.float32(1.0) if self.config.gemma and not self.tensors.norms_include_one else w

    def fused(self, parts: list[tuple[str, tuple]]):
        """The parts stacked along their first axis, each read straight into its rows; where any
        is quantized, their blocks stacked, or a Fused of parts of different kinds (quantized.fuse)."""
        for name, shape in parts:
            self.check(name, shape)
        if any(self.tensors.quantized(name) for name, _ in parts):
            return fuse([self.tensors.read(name) for name, _ in parts])
        out = np.empty((sum(shape[0] for _, shape in parts), *parts[0][1][1:]), dtype=np.float32)
        row = 0
        for name, shape in parts:
            self.tensors.read_into(name, out[row:row + shape[0]])
            row += shape[0]
        return out

    def layer(self, i: int) -> LayerWeights:
        c = self.config
        H, Q, KV, D, I = c.hidden_size, c.q_size, c.kv_size, c.head_dim, c.intermediate_size
        p = f"model.layers.{i}."
        a = p + "self_attn."
        bias = None
        if c.attention_bias:
            bias = self.fused([(a + "q_proj.bias", (Q,)), (a + "k_proj.bias", (KV,)), (a + "v_proj.bias", (KV,))])
        experts, w_gate_up, w_down = None, None, None
        if c.fused_tensors:
            wqkv = self.take(a + "qkv_proj.weight", (Q + 2 * KV, H))
            w_gate_up = self.take(p + "mlp.gate_up_proj.weight", (2 * I, H))
        else:
            wqkv = self.fused([(a + "q_proj.weight", (Q, H)), (a + "k_proj.weight", (KV, H)),
                               (a + "v_proj.weight", (KV, H))])
        if c.sparse(i):
            experts = self.experts(i)
        else:
            if not c.fused_tensors:
                w_gate_up = self.fused([(p + "mlp.gate_proj.weight", (I, H)), (p + "mlp.up_proj.weight", (I, H))])
            w_down = self.take(p + "mlp.down_proj.weight", (H, I))
        norm = (Q, KV) if c.qk_norm_whole else (D, D)
        layer = LayerWeights(
            attn_norm=self.norm(p + "input_layernorm.weight", (H,)),
            wqkv=wqkv,
            bqkv=bias,
            q_norm=self.norm(a + "q_norm.weight", (norm[0],)) if c.qk_norm else None,
            k_norm=self.norm(a + "k_norm.weight", (norm[1],)) if c.qk_norm else None,
            wo=self.take(a + "o_proj.weight", (H, Q)),
            mlp_norm=self.norm(p + ("pre_feedforward_layernorm.weight" if c.gemma else
                                    "post_attention_layernorm.weight"), (H,)),
            w_gate_up=w_gate_up,
            w_down=w_down,
            experts=experts,
        )
        if c.gemma:
            layer.post_attn_norm = self.norm(p + "post_attention_layernorm.weight", (H,))
            layer.post_mlp_norm = self.norm(p + "post_feedforward_layernorm.weight", (H,))
        order = rotary_row_order(D, rotary_dim(c))
        if order is None:
            return layer
        # A partial rotation: each q/k head's rotated pairs moved to where the kernels rotate
        # (model/rope.py); v's rows stay.
        rows = np.concatenate([(np.arange(n)[:, None] * D + order).ravel() + first
                               for n, first in ((c.num_heads, 0), (c.num_kv_heads, Q))] + [Q + KV + np.arange(KV)])
        return replace(layer, wqkv=take_rows(layer.wqkv, rows),
                       bqkv=None if bias is None else take_rows(bias, rows),
                       q_norm=None if layer.q_norm is None else layer.q_norm[order],
                       k_norm=None if layer.k_norm is None else layer.k_norm[order])

    def experts(self, i: int) -> Experts:
        """Layer i's router and experts, each expert's tensors read into its rows of the stack
        (Mixtral's w1, w3 and w2 are gate, up and down)."""
        c = self.config
        E, H, I = c.num_experts, c.hidden_size, c.expert_intermediate_size
        moe, names = expert_tensor_names(c.model_type, i)
        return Experts(
            router=self.take(moe + "gate.weight", (E, H)),
            gate_up=self.fused([(f"{moe}experts.{e}.{names[part]}.weight", (I, H))
                                for e in range(E) for part in ("gate", "up")]),
            down=self.fused([(f"{moe}experts.{e}.{names['down']}.weight", (H, I)) for e in range(E)]),
            top_k=c.experts_per_token, normalize=c.norm_topk_prob)

    def unread(self, name: str, shape: tuple):
        """The tensor for prepare to read in slabs of rows (tensors.rows)."""
        self.check(name, shape)
        return self.tensors.rows(name)

    def outer(self, prepare: Callable) -> tuple:
        """The embedding, final norm and LM head (the embedding itself when tied), prepared; the
        two large ones handed over unread, so that ops that pack them never hold their float32."""
        c = self.config
        shape = (c.vocab_size, c.hidden_size)
        embed = prepare(self.unread("model.embed_tokens.weight", shape))
        if c.tie_word_embeddings or "lm_head.weight" not in self.tensors.entries:
            lm_head = embed
        else:
            lm_head = prepare(self.unread("lm_head.weight", shape))
        return embed, prepare(self.norm("model.norm.weight", (c.hidden_size,))), lm_head
