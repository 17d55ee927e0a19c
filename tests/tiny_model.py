"""A tiny random Llama-family model, made on disk in the test: config, fp32 safetensors, and a
byte-level BPE tokenizer trained with `tokenizers` on a few sentences."""

import json
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

CORPUS = [
    "The capital of France is Paris. The capital of Italy is Rome.",
    "Hello world! How are you today? I am fine, thank you.",
    "def add(a, b):\n    return a + b\n",
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000",
    "Café, naïve, Straße, 東京, 😀 and ünïcödé text.",
] * 20

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
THINKING_CHATML = CHATML.replace("'<|im_start|>assistant\n'", "'<|im_start|>assistant\n<think>\n'")


def train_tokenizer(vocab_size: int = 400) -> Tokenizer:
    tok = Tokenizer(models.BPE(byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    return tok


def random_weights(variant: str, tie: bool, vocab: int, seed: int = 0, layers: int = 2, hidden: int = 64,
                   heads: int = 4, kv_heads: int = 2, intermediate: int = 128) -> dict[str, np.ndarray]:
    """Random float32 tensors under Hugging Face names, scaled so logits are neither flat nor
    one-hot."""
    head_dim = hidden // heads
    rng = np.random.default_rng(seed)

    def linear(out_dim, in_dim):
        return (rng.standard_normal((out_dim, in_dim)) / np.sqrt(in_dim)).astype(np.float32)

    def norm(dim):
        return (1.0 + 0.1 * rng.standard_normal(dim)).astype(np.float32)

    t = {"model.embed_tokens.weight": (0.25 * rng.standard_normal((vocab, hidden))).astype(np.float32),
         "model.norm.weight": norm(hidden)}
    if not tie:
        t["lm_head.weight"] = linear(vocab, hidden)
    for i in range(layers):
        p = f"model.layers.{i}."
        t[p + "input_layernorm.weight"] = norm(hidden)
        t[p + "post_attention_layernorm.weight"] = norm(hidden)
        t[p + "self_attn.q_proj.weight"] = linear(heads * head_dim, hidden)
        t[p + "self_attn.k_proj.weight"] = linear(kv_heads * head_dim, hidden)
        t[p + "self_attn.v_proj.weight"] = linear(kv_heads * head_dim, hidden)
        t[p + "self_attn.o_proj.weight"] = linear(hidden, heads * head_dim)
        t[p + "mlp.gate_proj.weight"] = linear(intermediate, hidden)
        t[p + "mlp.up_proj.weight"] = linear(intermediate, hidden)
        t[p + "mlp.down_proj.weight"] = linear(hidden, intermediate)
        if variant == "qwen2":
            for name, dim in (("q", heads), ("k", kv_heads), ("v", kv_heads)):
                t[p + f"self_attn.{name}_proj.bias"] = (0.5 * rng.standard_normal(dim * head_dim)).astype(np.float32)
        if variant == "qwen3":
            t[p + "self_attn.q_norm.weight"] = norm(head_dim)
            t[p + "self_attn.k_norm.weight"] = norm(head_dim)
    return t


def pad_vocabulary(t: dict[str, np.ndarray], vocab: int, extra: int) -> None:
    """extra rows past the tokenizer's ids, as checkpoints pad theirs (Qwen2.5's 151,936 for
    about 151,670 tokens): copies of real rows, tripled, so a sampler or a mask that let them
    through would pick them often."""
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        if name in t:
            t[name] = np.concatenate([t[name], 3.0 * t[name][np.arange(extra) % vocab]])


def make_tiny_model(path: Path, variant: str = "llama", tie: bool = True, seed: int = 0,
                    layers: int = 2, hidden: int = 64, heads: int = 4, kv_heads: int = 2,
                    intermediate: int = 128, max_pos: int = 1024, thinking: bool = False,
                    tokens: tuple[str, ...] = (), chat_template: str | None = None, padded_vocab: int = 0) -> Path:
    """thinking: a reasoning model's tokenizer (<think> and </think> tokens) and a template
    whose generation prompt opens the thinking, as DeepSeek-R1's does. tokens: more added
    tokens (a tool-call format's markers); chat_template: in place of ChatML. padded_vocab:
    embedding (and LM head) rows past the tokenizer's tokens (pad_vocabulary)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tok = train_tokenizer()
    if thinking:
        tok.add_tokens(["<think>", "</think>"])
    tok.add_tokens(list(tokens))
    tok.save(str(path / "tokenizer.json"))
    vocab = tok.get_vocab_size()
    head_dim = hidden // heads
    t = random_weights(variant, tie, vocab, seed, layers, hidden, heads, kv_heads, intermediate)
    pad_vocabulary(t, vocab, padded_vocab)
    save_file(t, str(path / "model.safetensors"))

    eos = tok.token_to_id("<|im_end|>")
    config = {
        "architectures": [{"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                           "qwen3": "Qwen3ForCausalLM"}[variant]],
        "model_type": variant, "vocab_size": vocab + padded_vocab, "hidden_size": hidden,
        "intermediate_size": intermediate, "num_hidden_layers": layers,
        "num_attention_heads": heads, "num_key_value_heads": kv_heads, "head_dim": head_dim,
        "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "max_position_embeddings": max_pos,
        "tie_word_embeddings": tie, "bos_token_id": tok.token_to_id("<|im_start|>"),
        "eos_token_id": eos, "torch_dtype": "float32",
    }
    (path / "config.json").write_text(json.dumps(config, indent=2))
    (path / "generation_config.json").write_text(json.dumps(
        {"eos_token_id": [eos, tok.token_to_id("<|endoftext|>")]}))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "chat_template": chat_template or (THINKING_CHATML if thinking else CHATML), "bos_token": "<|im_start|>",
        "eos_token": "<|im_end|>", "add_bos_token": False, "model_max_length": max_pos}))
    return path
