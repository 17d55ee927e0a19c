"""Build tiny Llama-family GGUF files for tests, the way llama.cpp's converter lays them out.

The weights are random float32 in Hugging Face layout; q/k rows are written permuted into
llama.cpp's rope layout for architecture llama (not for qwen2/qwen3), so a converter that
forgets to undo it fails the comparison.
"""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from tiny_model import random_weights

HIDDEN, LAYERS, HEADS, KV_HEADS, FFN = 64, 2, 4, 2, 128
HEAD_DIM = HIDDEN // HEADS
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content']"
    " + '<|im_end|>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
CORPUS = [
    "The capital of France is Paris. The capital of Italy is Rome.",
    "Hello world! hello there, general Kenobi. 1234567890 and 42 and 3.14159",
    "def main():\n    print('hi')  # a comment\n\treturn 0\n",
    "Les élèves étudient à l'école. Über Größe. 東京は日本の首都です。",
    "Emoji 🎉🚀 and spaces    here, newlines\n\n\nthere. It's we're they've I'm you'll he'd",
] * 3


def permute_for_gguf(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's forward q/k permutation (Hugging Face halves -> interleaved pairs)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def reference_pre_tokenizer(pre: str):
    """The pre-tokenizer the original (Hugging Face) tokenizer of each family uses."""
    if pre == "smollm":
        return pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ])
    if pre == "llama-bpe":
        from tokenizers import Regex

        pattern = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                   r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
        return pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)


def train_bpe(pre: str = "smollm", vocab_size: int = 400) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = reference_pre_tokenizer(pre)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIALS, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(CORPUS, trainer)
    return tok


def export_vocab(tok: Tokenizer) -> tuple[list[str], list[str]]:
    model = json.loads(tok.to_str())["model"]
    vocab = model["vocab"]
    tokens = [None] * len(vocab)
    for t, i in vocab.items():
        tokens[i] = t
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    return tokens, merges


def hf_weights(arch: str = "llama", *, tied: bool = True, vocab: int = 400, seed: int = 0) -> dict[str, np.ndarray]:
    return random_weights(arch, tied, vocab, seed, LAYERS, HIDDEN, HEADS, KV_HEADS, FFN)


_TO_GGUF = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_proj.bias": "attn_q.bias", "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.q_norm.weight": "attn_q_norm.weight", "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


def gguf_name(hf_name: str) -> str:
    top = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}
    if hf_name in top:
        return top[hf_name]
    _, _, i, rest = hf_name.split(".", 3)
    return f"blk.{i}.{_TO_GGUF[rest]}"


def write_gguf(
    path: Path,
    weights: dict[str, np.ndarray],
    *,
    arch: str = "llama",
    tokens: list[str],
    merges: list[str] | None = None,
    token_types: list[int] | None = None,
    scores: list[float] | None = None,
    tokenizer_model: str = "gpt2",
    pre: str | None = "smollm",
    bos: int = 1,
    eos: int = 2,
    add_bos: bool = False,
    chat_template: str | None = CHAT_TEMPLATE,
    quant: gguf.GGMLQuantizationType | dict[str, gguf.GGMLQuantizationType] | None = None,
    extra_kv=None,
    extra_tensors: dict[str, np.ndarray] | None = None,
) -> Path:
    """Write `weights` (Hugging Face names and layout) as a GGUF file like llama.cpp would.
    quant: the type of every matrix, or a type per Hugging Face name (float32 for the others)."""
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(LAYERS)
    w.add_context_length(256)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_vocab_size(len(tokens))
    w.add_tokenizer_model(tokenizer_model)
    if pre is not None:
        w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    if token_types is None:
        token_types = [3 if t in SPECIALS else 1 for t in tokens]
    w.add_token_types(token_types)
    if merges is not None:
        w.add_token_merges(merges)
    if scores is not None:
        w.add_token_scores(scores)
    w.add_bos_token_id(bos)
    w.add_eos_token_id(eos)
    w.add_add_bos_token(add_bos)
    if chat_template is not None:
        w.add_chat_template(chat_template)
    if extra_kv:
        extra_kv(w)
    for name, arr in weights.items():
        arr = arr.astype(np.float32)
        if arch == "llama" and (".q_proj." in name or ".k_proj." in name):
            arr = permute_for_gguf(arr, HEADS if ".q_proj." in name else KV_HEADS)
        kind = quant.get(name) if isinstance(quant, dict) else quant
        if kind is not None and arr.ndim == 2:
            w.add_tensor(gguf_name(name), gguf.quants.quantize(arr, kind), raw_dtype=kind)
        else:
            w.add_tensor(gguf_name(name), arr)
    for name, arr in (extra_tensors or {}).items():
        w.add_tensor(name, arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def tiny_gguf(path: Path, *, arch: str = "llama", tied: bool = True, pre: str = "smollm", **kw):
    """A complete tiny model: trained BPE tokenizer + random weights. Returns (path, tokenizer, weights)."""
    tok = train_bpe(pre)
    tokens, merges = export_vocab(tok)
    weights = hf_weights(arch, tied=tied, vocab=len(tokens))
    write_gguf(path, weights, arch=arch, tokens=tokens, merges=merges, pre=pre, **kw)
    return path, tok, weights
