"""SmolLM3: Llama with some layers not rotating q and k (no_rope_layers, or every
no_rope_layer_interval-th; llama.cpp fixes every 4th)."""

from model.errors import ModelError
from model.families.family import Family


class SmolLM3(Family):
    model_type, architecture, gguf_arch = "smollm3", "SmolLM3ForCausalLM", "smollm3"
    gguf_rope_order = True

    def switches(self, raw: dict, layers: int) -> dict:
        """no_rope_layers (1: the layer rotates), or every interval-th layer not rotating."""
        flags = raw.get("no_rope_layers")
        if flags is None:
            interval = int(raw.get("no_rope_layer_interval", 4))
            flags = [int((i + 1) % interval != 0) for i in range(layers)]
        if len(flags) != layers:
            raise ModelError(f"config.json's no_rope_layers has {len(flags)} entries for {layers} layers")
        rotates = tuple(bool(f) for f in flags)
        return {"rope_layers": None if all(rotates) else rotates}

    def gguf_switches(self, field, layers: int, hidden: int, heads: int, head_dim: int) -> dict:
        return {"rope_layers": tuple((i + 1) % 4 != 0 for i in range(layers))}  # n_no_rope_layer_step


FAMILY = SmolLM3()
