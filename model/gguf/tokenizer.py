"""The `tokenizers` tokenizer and tokenizer_config.json that a GGUF's vocabulary implies: byte-level
BPE as is, SentencePiece rebuilt as a byte-fallback BPE with equivalent merges."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from model.errors import ModelError, one_line
from model.gguf.vocab import CONTROL, NORMAL, UNKNOWN, USER_DEFINED, GGUFVocab

# Pre-tokenizer regexes, as the models' own tokenizer.json files state them (llama.cpp runs
# equivalent hand-expanded forms, selected by tokenizer.ggml.pre).
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Qwen3.5's: Qwen2's with combining marks (\p{M}) kept inside words, and no NFC before it
_QWEN35_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
    r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# tokenizer.ggml.pre -> pre-tokenizer family
_PRE_FAMILIES = {
    "smollm": "digits", "starcoder": "digits", "refact": "digits", "codeshell": "digits",
    "llama-bpe": "llama3", "llama3": "llama3", "llama-v3": "llama3", "dbrx": "llama3",
    "smaug-bpe": "llama3",
    "qwen2": "qwen2", "stablelm2": "qwen2", "qwen35": "qwen35",
    "default": "gpt2", "gpt-2": "gpt2", "gpt2": "gpt2", "mpt": "gpt2", "olmo": "gpt2",
    "jais": "gpt2",
}


def build_tokenizer(v: GGUFVocab, path: Path):
    """The tokenizer, with its special and user-defined tokens and its BOS/EOS template."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers
    from tokenizers import pre_tokenizers, processors

    tokens = v.tokens
    vocab: dict[str, int] = {}
    for i, t in enumerate(tokens):
        vocab.setdefault(t, i)

    if v.kind == "gpt2":
        family = _PRE_FAMILIES.get(v.pre)
        if family is None:
            raise ModelError(
                f"{path.name} uses the BPE pre-tokenizer {v.pre!r}, which this converter does not know;"
                " use the Hugging Face model directory instead"
            )
        try:
            model = models.BPE(vocab=vocab, merges=list(v.merges), byte_fallback=False,
                               ignore_merges=(family == "llama3"))
        except Exception as exc:
            raise ModelError(f"{path.name} has an invalid BPE vocabulary ({one_line(exc)}); the file is inconsistent") from None
        tok = Tokenizer(model)
        if family == "digits":
            tok.pre_tokenizer = pre_tokenizers.Sequence([
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ])
        elif family in ("llama3", "qwen2", "qwen35"):
            pattern = {"llama3": _LLAMA3_SPLIT, "qwen2": _QWEN2_SPLIT, "qwen35": _QWEN35_SPLIT}[family]
            tok.pre_tokenizer = pre_tokenizers.Sequence([
                pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ])
            if family == "qwen2":  # Qwen3.5's keeps combining marks as written
                tok.normalizer = normalizers.NFC()
        else:
            tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        tok.decoder = decoders.ByteLevel()
        default_post = processors.ByteLevel(trim_offsets=False)
    else:  # "llama": vocab.py admits no other kind
        merges = _spm_merges(tokens, v.scores, v.types, vocab)
        try:
            model = models.BPE(vocab=vocab, merges=merges, unk_token=tokens[v.unk_id] if v.unk_id is not None else None,
                               fuse_unk=True, byte_fallback=True)
        except Exception as exc:
            raise ModelError(f"{path.name} has an invalid SentencePiece vocabulary ({one_line(exc)}); the file is inconsistent") from None
        tok = Tokenizer(model)
        steps = [normalizers.Prepend("▁")] if v.add_space_prefix else []
        tok.normalizer = normalizers.Sequence(steps + [normalizers.Replace(" ", "▁")])
        dec = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
        if v.add_space_prefix:
            dec.append(decoders.Strip(" ", 1, 0))
        tok.decoder = decoders.Sequence(dec)
        default_post = None

    specials = [AddedToken(tokens[i], special=True, normalized=False)
                for i, ty in enumerate(v.types) if ty in (CONTROL, UNKNOWN) and tokens[i]]
    user = [AddedToken(tokens[i], special=False, normalized=False)
            for i, ty in enumerate(v.types) if ty == USER_DEFINED and tokens[i]]
    tok.add_special_tokens(specials)
    if user:
        tok.add_tokens(user)

    bos_id, eos_id = v.bos_id, v.eos_id
    if (v.add_bos and bos_id is not None) or (v.add_eos and eos_id is not None):
        single, pair, special = "$A:0", "$B:1", []
        if v.add_bos and bos_id is not None:
            single, pair = f"{tokens[bos_id]}:0 {single}", f"{tokens[bos_id]}:1 {pair}"
            special.append((tokens[bos_id], bos_id))
        if v.add_eos and eos_id is not None:
            single, pair = f"{single} {tokens[eos_id]}:0", f"{pair} {tokens[eos_id]}:1"
            if eos_id != bos_id:
                special.append((tokens[eos_id], eos_id))
        tok.post_processor = processors.TemplateProcessing(single=single, pair=f"{single} {pair}", special_tokens=special)
    elif default_post is not None:
        tok.post_processor = default_post
    return tok


def tokenizer_config(v: GGUFVocab, max_length: int) -> dict[str, Any]:
    """tokenizer_config.json: the special tokens, add_bos_token and the chat template."""
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": v.add_bos,
        "add_eos_token": v.add_eos,
        "clean_up_tokenization_spaces": False,
    }
    for key, i in (("bos_token", v.bos_id), ("eos_token", v.eos_id), ("unk_token", v.unk_id), ("pad_token", v.pad_id)):
        if i is not None:
            config[key] = v.tokens[i]
    if v.chat_template is not None:
        config["chat_template"] = v.chat_template
    config["model_max_length"] = max_length
    return config


def _spm_merges(tokens, scores, types, vocab) -> list[tuple[str, str]]:
    """BPE merges equivalent to SentencePiece's score-driven merging.

    Every normal token that splits into two vocabulary pieces yields a merge; a merge ranks by
    the merged token's score (higher first), then by the pieces' ids, as SentencePiece prefers
    the highest-scoring merged piece at each step.
    """
    ranked = []
    for i, (piece, score, ty) in enumerate(zip(tokens, scores, types)):
        if ty not in (NORMAL, USER_DEFINED) or len(piece) < 2:
            continue
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            li, ri = vocab.get(left), vocab.get(right)
            if li is not None and ri is not None:
                ranked.append((-float(score), li, ri, left, right))
    ranked.sort(key=lambda r: r[:3])
    return [(r[3], r[4]) for r in ranked]
