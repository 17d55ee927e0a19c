"""LoRA adapters: read from PEFT's safetensors or llama.cpp's GGUF, held in slots beside the
base weights, and applied per token, so that several adapters and the base model share a step.

A projection W of an adapted module computes y = W x + s B (A x) (A: (r, in), B: (out, r),
s = alpha / r, or alpha / sqrt(r) with rsLoRA, times the request's scale). The base GEMM runs
once for every token; the adapter's two small products run per token, each reading its own
slot (Punica's BGMV, S-LoRA's segmented GEMM by another name), in one fixed order whatever the
company, so a row's output is the same bits alone and in a batch. Spool's projections are fused
(q/k/v, gate/up), so each adapted module adds into its own column range of the fused output,
its B's rows in the order the fused weight keeps (weights.qkv_rows).

Slots hold every loaded adapter at the server's rank limit (smaller ranks zero-padded), float32,
allocated per (layer, module) the first time an adapter targets it.
"""

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from model.config import ModelConfig
from model.errors import ModelError
from model.weights import qkv_rows

# a Hugging Face projection -> (the fused weight it is part of, its part: 0 first)
MODULES = {"q_proj": ("wqkv", 0), "k_proj": ("wqkv", 1), "v_proj": ("wqkv", 2), "o_proj": ("wo", 0),
           "gate_proj": ("w_gate_up", 0), "up_proj": ("w_gate_up", 1), "down_proj": ("w_down", 0)}
FUSED = {"qkv_proj": ("wqkv", None), "gate_up_proj": ("w_gate_up", None)}  # Phi-3's own fused names
ADAPTER_CONFIG, ADAPTER_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"


@dataclass(frozen=True)
class AdapterUse:
    """A request's adapter: where its weights sit, its scale, and the load it came from (unique
    per process: the prefix cache's root for its tokens, so no other adapter's K/V matches)."""

    slot: int
    scale: float = 1.0
    ident: int = 0

    @property
    def cache_root(self) -> tuple:
        return "lora", self.ident, self.scale


@dataclass
class Adapter:
    """An adapter as read: per layer, module name -> (A (r, in), B (out, r) times s), float32,
    B's rows in the fused weight's order."""

    name: str
    path: str
    rank: int
    layers: list[dict[str, tuple[np.ndarray, np.ndarray]]] = field(default_factory=list)


def module_span(config: ModelConfig, i: int, module: str) -> tuple[str, int, int, int]:
    """(fused weight, first output row, output rows, input width) of layer i's module; a
    ModelError where the layer has no such projection (a delta-net or MoE layer's)."""
    c = config
    H, Q, KV, I = c.hidden_size, c.q_size_of(i), c.kv_size_of(i), c.width_of(i)
    weight, part = (MODULES | FUSED)[module]
    if weight == "wqkv":
        if c.linear(i) or c.kv_source(i) != i and module != "q_proj":
            raise ModelError(f"layer {i} of this model has no {module} for a LoRA adapter to adapt")
        q_rows = 2 * Q if c.attention_gate else Q
        sizes = (q_rows, KV, KV)
        return (weight, 0, sum(sizes), H) if part is None else (weight, sum(sizes[:part]), sizes[part], H)
    if c.sparse(i) and not c.experts_beside_mlp and weight != "wo":
        raise ModelError(f"layer {i} of this model is a mixture of experts; Spool's LoRA adapts dense projections only")
    if weight == "wo":
        if c.linear(i):
            raise ModelError(f"layer {i} of this model has no o_proj for a LoRA adapter to adapt")
        return weight, 0, H, Q
    if weight == "w_down":
        return weight, 0, H, I
    return (weight, 0, 2 * I, H) if part is None else (weight, part * I, I, H)


def fused_order(config: ModelConfig, i: int, module: str, b: np.ndarray) -> np.ndarray:
    """B's rows put in the order the fused q/k/v weight keeps its module's rows."""
    rows = qkv_rows(config, i)
    if rows is None or module not in ("q_proj", "k_proj", "qkv_proj"):
        return b
    _, first, count, _ = module_span(config, i, module)
    return b[rows[first:first + count] - first] if module != "qkv_proj" else b[rows]


def _checked(config: ModelConfig, i: int, module: str, a: np.ndarray, b: np.ndarray, source: str) -> None:
    _, _, out, width = module_span(config, i, module)
    if a.ndim != 2 or b.ndim != 2 or a.shape != (a.shape[0], width) or b.shape != (out, a.shape[0]):
        raise ModelError(f"{source}: layer {i}'s {module} has lora_A {a.shape} and lora_B {b.shape}; this model"
                         f" needs ({a.shape[0]}, {width}) and ({out}, {a.shape[0]}): an adapter for another model?")


def read_peft(name: str, path: Path, config: ModelConfig) -> Adapter:
    """A PEFT adapter directory (adapter_config.json, adapter_model.safetensors)."""
    from model.safetensors_files import ModelTensors

    path = Path(path)
    if not (path / ADAPTER_CONFIG).is_file():
        raise ModelError(f"{path} has no {ADAPTER_CONFIG}: give a PEFT adapter's directory or a GGUF adapter file")
    settings = json.loads((path / ADAPTER_CONFIG).read_text())
    refused = [k for k in ("use_dora", "modules_to_save", "layers_to_transform") if settings.get(k)]
    if settings.get("bias", "none") != "none":
        refused.append("bias")
    if settings.get("peft_type", "LORA") != "LORA" or refused:
        raise ModelError(f"{path}: Spool serves plain LoRA adapters; this one uses "
                         f"{', '.join(refused) or settings.get('peft_type')}")
    rank, alpha = int(settings["r"]), float(settings.get("lora_alpha", settings["r"]))
    scale = alpha / math.sqrt(rank) if settings.get("use_rslora") else alpha / rank
    adapter = Adapter(name, str(path), rank, [{} for _ in range(config.num_layers)])
    with ModelTensors(path) as tensors:
        for tensor in tensors.entries:
            if ".lora_A." not in tensor:
                if ".lora_B." not in tensor:
                    raise ModelError(f"{path}: tensor {tensor} is not a LoRA matrix; Spool adapts linear layers only")
                continue
            i, module = _layer_module(tensor.split(".lora_A.")[0], path)
            a, b = tensors.read(tensor), tensors.read(tensor.replace(".lora_A.", ".lora_B."))
            adapter.layers[i][module] = _prepared(config, i, module, a, b, scale, str(path))
    return adapter


def read_gguf_adapter(name: str, path: Path, config: ModelConfig) -> Adapter:
    """A llama.cpp LoRA adapter (convert_lora_to_gguf.py's): blk.N.<tensor>.weight.lora_a and
    .lora_b, adapter.lora.alpha; q/k's B rows back from llama.cpp's rope order where the family
    stores that order."""
    import gguf
    from model.gguf.names import layer_names
    from model.gguf.tensors import hf_row_order

    try:
        reader = gguf.GGUFReader(str(path))
    except Exception as e:  # noqa: BLE001 -- gguf raises anything on a bad file
        raise ModelError(f"{path} is not a readable GGUF file ({type(e).__name__})") from None
    kind = reader.fields.get("general.type")
    if kind is None or kind.contents() != "adapter" or reader.fields["adapter.type"].contents() != "lora":
        raise ModelError(f"{path} is a GGUF but not a LoRA adapter (general.type should be 'adapter')")
    alpha_field = reader.fields.get("adapter.lora.alpha")
    names = layer_names(config.family)
    tensors = {t.name: t for t in reader.tensors}
    adapter = Adapter(name, str(path), 0, [{} for _ in range(config.num_layers)])
    for tname, t in tensors.items():
        if not tname.endswith(".lora_a"):
            continue
        parts = tname[:-len(".lora_a")].split(".", 2)
        hf = names.get(parts[2]) if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() else None
        if hf is None or not hf.endswith("_proj.weight"):
            raise ModelError(f"{path}: tensor {tname} is not a LoRA matrix of a projection Spool adapts")
        i, module = _layer_module(f"model.layers.{parts[1]}.{hf[:-len('.weight')]}", path)
        a, b = _float32(t), _float32(tensors[tname[:-1] + "b"])
        if config.family.gguf_rope_order and module in ("q_proj", "k_proj"):
            heads = config.num_heads if module == "q_proj" else config.kv_heads_of(i)
            b = b[hf_row_order(b.shape[0], heads)]
        rank = a.shape[0]
        alpha = float(alpha_field.contents()) if alpha_field is not None else rank
        adapter.rank = max(adapter.rank, rank)
        adapter.layers[i][module] = _prepared(config, i, module, a, b, alpha / rank, str(path))
    return adapter


def _float32(t) -> np.ndarray:
    import gguf

    data = gguf.quants.dequantize(t.data, t.tensor_type)
    return np.asarray(data, dtype=np.float32).reshape(tuple(int(d) for d in reversed(t.shape.tolist())))


def _layer_module(prefix: str, path: Path) -> tuple[int, str]:
    """(layer, module) of '...layers.N.self_attn.q_proj'."""
    parts = prefix.split(".")
    if "layers" not in parts or parts[-1] not in MODULES | FUSED:
        raise ModelError(f"{path}: {prefix} is not a projection Spool adapts ({', '.join(MODULES)})")
    return int(parts[parts.index("layers") + 1]), parts[-1]


def _prepared(config, i, module, a, b, scale: float, source: str) -> tuple[np.ndarray, np.ndarray]:
    _checked(config, i, module, a, b, source)
    return np.ascontiguousarray(a, np.float32), np.ascontiguousarray(fused_order(config, i, module, b) * np.float32(scale))


def read_adapter(name: str, path: Path, config: ModelConfig) -> Adapter:
    """A PEFT directory or a GGUF file, by what path is."""
    path = Path(path).expanduser()
    if not path.exists():
        raise ModelError(f"LoRA adapter {name!r}: {path} does not exist")
    return read_gguf_adapter(name, path, config) if path.is_file() else read_peft(name, path, config)


class AdapterSlots:
    """The loaded adapters' weights on the ops' device: per (layer, module), A stacked as
    (slots, rank, in) and B as (slots, out, rank); a step's rows pick slots per token."""

    def __init__(self, config: ModelConfig, ops, slots: int, max_rank: int):
        self.config, self.ops, self.slots, self.max_rank = config, ops, slots, max_rank
        # per layer, module -> (a, b, the fused weight it adds into, its first column there)
        self.stacks: list[dict[str, tuple]] = [{} for _ in range(config.num_layers)]

    def load(self, adapter: Adapter, slot: int) -> None:
        """The adapter into slot, every module's rows of it written (zeros where it adapts none)."""
        if adapter.rank > self.max_rank:
            raise ModelError(f"LoRA adapter {adapter.name!r} has rank {adapter.rank}, above --max-lora-rank"
                             f" {self.max_rank}")
        for i, modules in enumerate(adapter.layers):
            for module in modules:
                self.stack(i, module)
        for i, stacks in enumerate(self.stacks):
            for module, (a_stack, b_stack, _, _) in stacks.items():
                a, b = adapter.layers[i].get(module, (np.zeros((0, a_stack.shape[2]), np.float32), None))
                padded_a = np.zeros(a_stack.shape[1:], np.float32)
                padded_a[:a.shape[0]] = a
                padded_b = np.zeros(b_stack.shape[1:], np.float32)
                if b is not None:
                    padded_b[:, :b.shape[1]] = b
                a_stack[slot] = self.ops.asarray(padded_a)
                b_stack[slot] = self.ops.asarray(padded_b)

    def stack(self, i: int, module: str) -> tuple:
        """Layer i's stacks for module, made (zeros: no adapter adapts it) when first asked for."""
        if module not in self.stacks[i]:
            weight, first, out, width = module_span(self.config, i, module)
            self.stacks[i][module] = (self.ops.zeros((self.slots, self.max_rank, width), np.float32),
                                      self.ops.zeros((self.slots, out, self.max_rank), np.float32), weight, first)
        return self.stacks[i][module]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for stacks in self.stacks for a, b, _, _ in stacks.values())

    def step(self, uses, counts) -> "StepAdapters | None":
        """A step's per-token slots and scales: uses[r] (an AdapterUse or None) for counts[r]
        tokens; None when no row has an adapter."""
        if all(u is None for u in uses):
            return None
        slots = np.repeat([-1 if u is None else u.slot for u in uses], counts).astype(np.int32)
        scales = np.repeat([0.0 if u is None else u.scale for u in uses], counts).astype(np.float32)
        return StepAdapters(self, self.ops.asarray(slots, np.int32), self.ops.asarray(scales))


@dataclass
class StepAdapters:
    """What the forward pass adds to a projection's output for a step's adapted tokens."""

    slots: AdapterSlots
    token_slots: object  # (tokens,) int32 on the device: each token's slot, -1 for the base model
    token_scales: object  # (tokens,) float32: each token's request's scale

    def add(self, y, x, i: int, weight: str):
        """y (the fused weight's output for x) with every adapted module of it added."""
        for a, b, adds_to, first in self.slots.stacks[i].values():
            if adds_to == weight:
                y = self.slots.ops.lora(y, x, a, b, self.token_slots, self.token_scales, first)
        return y
