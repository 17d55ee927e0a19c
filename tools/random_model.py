"""A model of a real shape with random weights made where the ops keep them, for benchmarks on a
machine with no network: nothing is downloaded, and an 8B model's 16 GB of bfloat16 weights are
drawn on the GPU layer by layer (a float32 layer at a time, then rounded by ops.weight).

The directory it writes holds config.json and a word-level tokenizer.json with one token per id
("t0", "t1", ...), so the engine can detokenize whatever ids random weights produce. Timings of
such a model are those of the real shape: the kernels do not look at the values.
"""

import json
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer, models, pre_tokenizers

from model.config import ModelConfig
from model.llama import Llama
from model.weights import LayerWeights, Weights, prepared

SHAPES = {
    "llama3-8b": {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128256,
                  "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
                  "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "rms_norm_eps": 1e-5,
                  "rope_theta": 500000.0, "max_position_embeddings": 8192, "tie_word_embeddings": False,
                  "torch_dtype": "bfloat16"},
    "tiny": {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 512, "hidden_size": 64,
             "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
             "head_dim": 16, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "max_position_embeddings": 2048,
             "tie_word_embeddings": False, "torch_dtype": "float32"},
}


def write_model_dir(path: Path, shape: str) -> Path:
    """config.json and a tokenizer for SHAPES[shape], with no weights."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config = dict(SHAPES[shape], eos_token_id=SHAPES[shape]["vocab_size"] - 1)
    (path / "config.json").write_text(json.dumps(config, indent=2))
    tokenizer = Tokenizer(models.WordLevel({f"t{i}": i for i in range(config["vocab_size"])}, unk_token="t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(str(path / "tokenizer.json"))
    return path


def random_model(model_dir: Path, ops, seed: int = 0) -> Llama:
    """The model of model_dir's config.json on ops, with weights drawn by ops' array module
    (CuPy's generator on a GPU), scaled so activations neither vanish nor blow up."""
    config = ModelConfig.load(model_dir)
    xp = ops.xp
    rng = xp.random.default_rng(seed)
    c = config
    qkv = c.q_size + 2 * c.kv_size

    def linear(rows, cols):
        return (rng.standard_normal((rows, cols), dtype=np.float32) * np.float32(cols ** -0.5))

    def layer(_):
        ones = xp.ones(c.hidden_size, dtype=np.float32)
        return LayerWeights(attn_norm=ones, wqkv=linear(qkv, c.hidden_size), bqkv=None, q_norm=None, k_norm=None,
                            wo=linear(c.hidden_size, c.q_size), mlp_norm=ones,
                            w_gate_up=linear(2 * c.intermediate_size, c.hidden_size),
                            w_down=linear(c.hidden_size, c.intermediate_size))

    embed = ops.weight(linear(c.vocab_size, c.hidden_size))
    lm_head = ops.weight(linear(c.vocab_size, c.hidden_size))
    weights = Weights(embed=embed, layers=[prepared(layer(i), ops.weight) for i in range(c.num_layers)],
                      norm=ops.weight(xp.ones(c.hidden_size, dtype=np.float32)), lm_head=lm_head)
    return Llama(config, weights, ops)
