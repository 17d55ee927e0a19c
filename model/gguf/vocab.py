"""A GGUF's tokenizer fields, read once and checked into a typed value: the tokens and their
types, the special ids, the merges (byte-level BPE) or scores (SentencePiece), and the chat
template as tokenizer_config.json holds it (model/gguf/tokenizer.py builds the tokenizer)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from model.errors import ModelError
from model.gguf.pretok import BOS_ALWAYS, BOS_BY_DEFAULT, SEP_BY_DEFAULT

# GGUF token types (gguf.TokenType)
NORMAL, UNKNOWN, CONTROL, USER_DEFINED = 1, 2, 3, 4


@dataclass(frozen=True)
class GGUFVocab:
    kind: str  # tokenizer.ggml.model: "gpt2" (byte-level BPE), "llama" (SentencePiece), "gemma4"
    # (SentencePiece-style BPE with merges) or "bert" (WordPiece)
    tokens: tuple[str, ...]
    types: tuple[int, ...]  # one GGUF token type per token
    bos_id: int | None
    eos_id: int | None
    unk_id: int | None  # for "llama", the first UNKNOWN token where the file names none
    pad_id: int | None
    extra_eos_ids: tuple[int, ...]  # end-of-turn and end-of-message tokens
    add_bos: bool
    add_eos: bool
    merges: tuple[tuple[str, str], ...]  # "gpt2" and "gemma4"
    pre: str  # "gpt2" and "gemma4": tokenizer.ggml.pre
    scores: tuple[float, ...]  # "llama" only
    add_space_prefix: bool  # "llama" only
    sep_id: int | None  # "bert": [SEP], added after the text where add_sep
    add_sep: bool
    lowercase: bool  # "bert": the normalizer lowercases (and strips accents where strip_accents)
    strip_accents: bool
    chat_template: str | list[dict] | None  # as tokenizer_config.json holds it


def read_vocab(field: Callable, path: Path) -> GGUFVocab:
    """The vocabulary, checked; field(key, default=None) reads one metadata key."""
    kind = field("tokenizer.ggml.model")
    if kind is None:
        raise ModelError(f"{path.name} has no tokenizer (tokenizer.ggml.model); use a GGUF that embeds one")
    tokens = field("tokenizer.ggml.tokens")
    if not tokens:
        raise ModelError(f"{path.name} has no token list (tokenizer.ggml.tokens); use a GGUF that embeds one")
    n = len(tokens)
    types = field("tokenizer.ggml.token_type") or [NORMAL] * n
    if len(types) != n:
        raise ModelError(f"{path.name} has {n} tokens but {len(types)} token types; the file is inconsistent")

    def tok_id(key):
        v = field(key)
        if v is None:
            return None
        v = int(v)
        if not 0 <= v < n:
            raise ModelError(f"{path.name}: {key} = {v} is outside the vocabulary of {n}; the file is inconsistent")
        return v

    bos_id = tok_id("tokenizer.ggml.bos_token_id")
    if kind == "bert":  # [CLS] begins the text; llama.cpp's defaults where the file is silent
        bos_id = next((i for i in (tok_id("tokenizer.ggml.cls_token_id"), bos_id, 101 if n > 101 else None)
                       if i is not None), None)
    eos_id = tok_id("tokenizer.ggml.eos_token_id")
    unk_id = tok_id("tokenizer.ggml.unknown_token_id")
    pad_id = tok_id("tokenizer.ggml.padding_token_id")
    sep_id = tok_id("tokenizer.ggml.seperator_token_id")  # sic: gguf's key
    extra_eos = [i for i in (tok_id("tokenizer.ggml.eot_token_id"), tok_id("tokenizer.ggml.eom_token_id")) if i is not None]
    pre = field("tokenizer.ggml.pre", "default") if kind == "gpt2" else "gemma4" if kind == "gemma4" else ""
    add_bos = bool(field("tokenizer.ggml.add_bos_token", kind in ("llama", "bert") or pre in BOS_BY_DEFAULT)
                   or pre in BOS_ALWAYS)
    add_eos = bool(field("tokenizer.ggml.add_eos_token", False))
    add_sep = bool(field("tokenizer.ggml.add_sep_token", kind == "bert" or pre in SEP_BY_DEFAULT))
    lowercase = bool(field("tokenizer.ggml.normalizer.lowercase", True))
    strip_accents = bool(field("tokenizer.ggml.normalizer.strip_accents", lowercase))

    merges, scores, prefix = [], [], True
    if kind in ("gpt2", "gemma4"):
        merges_raw = field("tokenizer.ggml.merges")
        if not merges_raw:
            raise ModelError(f"{path.name} has a BPE tokenizer without merges; the file is incomplete")
        for m in merges_raw:
            cut = m.find(" ", 1)  # as llama.cpp reads them: a merge's left part may be a space
            if cut < 0:
                raise ModelError(f"{path.name} has a malformed BPE merge {m!r}; the file is inconsistent")
            merges.append((m[:cut], m[cut + 1:]))
    elif kind == "llama":
        scores = field("tokenizer.ggml.scores")
        if not scores or len(scores) != n:
            raise ModelError(f"{path.name} has a SentencePiece tokenizer without one score per token; the file is inconsistent")
        if unk_id is None:
            unk_id = next((i for i, ty in enumerate(types) if ty == UNKNOWN), None)
        prefix = bool(field("tokenizer.ggml.add_space_prefix", True))
    elif kind == "bert":
        if unk_id is None and n > 100:
            unk_id = 100
        if sep_id is None and n > 102:
            sep_id = 102
    else:
        raise ModelError(
            f"{path.name} uses the tokenizer type {kind!r}, which this converter does not support"
            " (supported: gpt2, llama, gemma4, bert); use the Hugging Face model directory instead"
        )

    template = field("tokenizer.chat_template")
    named = field("tokenizer.chat_templates") or []
    if named:
        chat_template = [{"name": "default", "template": template}] if template else []
        for name in named:
            t = field(f"tokenizer.chat_template.{name}")
            if t:
                chat_template.append({"name": name, "template": t})
    else:
        chat_template = template or None
    return GGUFVocab(
        kind=kind, tokens=tuple(tokens), types=tuple(types), bos_id=bos_id, eos_id=eos_id, unk_id=unk_id,
        pad_id=pad_id, extra_eos_ids=tuple(extra_eos), add_bos=add_bos, add_eos=add_eos, merges=tuple(merges),
        pre=pre, scores=tuple(scores), add_space_prefix=prefix, sep_id=sep_id, add_sep=add_sep and sep_id is not None,
        lowercase=lowercase, strip_accents=strip_accents, chat_template=chat_template,
    )
