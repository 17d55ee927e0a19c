"""The `tokenizers` tokenizer and tokenizer_config.json that a GGUF's vocabulary implies: byte-level
BPE as is (its pre-tokenizer by name, model/gguf/pretok.py), Gemma 4's SentencePiece-style BPE,
SentencePiece rebuilt as a byte-fallback BPE with equivalent merges, and BERT's WordPiece."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from model.errors import ModelError, one_line
from model.gguf.pretok import Family, family, refusal
from model.gguf.vocab import CONTROL, NORMAL, UNKNOWN, USER_DEFINED, GGUFVocab


def build_tokenizer(v: GGUFVocab, path: Path):
    """The tokenizer, with its special and user-defined tokens and its BOS/EOS template."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

    tokens = _wordpiece_tokens(v.tokens) if v.kind == "bert" else v.tokens
    vocab: dict[str, int] = {}
    for i, t in enumerate(tokens):
        vocab.setdefault(t, i)

    default_post = None
    if v.kind in ("gpt2", "gemma4"):
        fam = family(v.pre)
        if fam is None:
            raise ModelError(f"{path.name} {refusal(v.pre)}")
        tok = _raw_bpe(v, vocab, fam, path) if fam.raw else _byte_level_bpe(v, vocab, fam, path)
        if not fam.raw:
            default_post = processors.ByteLevel(trim_offsets=False)
    elif v.kind == "bert":
        tok = Tokenizer(models.WordPiece(vocab, unk_token=tokens[v.unk_id] if v.unk_id is not None else "[UNK]",
                                         continuing_subword_prefix="##"))
        tok.normalizer = normalizers.BertNormalizer(clean_text=True, handle_chinese_chars=True,
                                                    strip_accents=v.strip_accents, lowercase=v.lowercase)
        tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
        tok.decoder = decoders.WordPiece(prefix="##")
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

    specials = [AddedToken(tokens[i], special=True, normalized=False)
                for i, ty in enumerate(v.types) if ty in (CONTROL, UNKNOWN) and tokens[i]]
    user = [AddedToken(tokens[i], special=False, normalized=False)
            for i, ty in enumerate(v.types) if ty == USER_DEFINED and tokens[i]]
    tok.add_special_tokens(specials)
    if user:
        tok.add_tokens(user)

    added = [i for i, on in ((v.bos_id, v.add_bos), (v.eos_id, v.add_eos), (v.sep_id, v.add_sep))
             if on and i is not None]
    if added:
        bos_id = v.bos_id if v.add_bos else None
        ends = [i for i in (v.eos_id if v.add_eos else None, v.sep_id if v.add_sep else None) if i is not None]

        def around(seq: str, type_id: int, first: bool = True) -> str:  # BERT's second text has no [CLS]
            head = [tokens[bos_id]] if bos_id is not None and (first or v.kind != "bert") else []
            return " ".join(f"{p}:{type_id}" for p in head + [seq] + [tokens[i] for i in ends])

        single = around("$A", 0)
        tok.post_processor = processors.TemplateProcessing(
            single=single, pair=f"{single} {around('$B', 1, first=False)}",
            special_tokens=[(tokens[i], i) for i in dict.fromkeys(added)])
    elif default_post is not None:
        tok.post_processor = default_post
    return tok


def _byte_level_bpe(v: GGUFVocab, vocab: dict[str, int], fam: Family, path: Path):
    """GPT-2 style: the family's regex splits, then every byte as a printable character."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

    try:
        model = models.BPE(vocab=vocab, merges=list(v.merges), byte_fallback=False, ignore_merges=fam.ignore_merges)
    except Exception as exc:
        raise ModelError(f"{path.name} has an invalid BPE vocabulary ({one_line(exc)});"
                         " the file is inconsistent") from None
    tok = Tokenizer(model)
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(r), behavior="isolated", invert=False) for r in fam.splits]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    if fam.nfc:
        tok.normalizer = normalizers.NFC()
    tok.decoder = decoders.ByteLevel()
    return tok


def _raw_bpe(v: GGUFVocab, vocab: dict[str, int], fam: Family, path: Path):
    """SentencePiece style with merges (Gemma 4): "▁" for each space, the text's own characters,
    <0xXX> tokens for any byte of a character the vocabulary lacks."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

    try:
        model = models.BPE(vocab=vocab, merges=list(v.merges), byte_fallback=True, ignore_merges=fam.ignore_merges,
                           unk_token=v.tokens[v.unk_id] if v.unk_id is not None else None)
    except Exception as exc:
        raise ModelError(f"{path.name} has an invalid BPE vocabulary ({one_line(exc)});"
                         " the file is inconsistent") from None
    tok = Tokenizer(model)
    tok.normalizer = normalizers.Replace(" ", "▁")
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(r), behavior="isolated", invert=False) for r in fam.splits])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    return tok


def _wordpiece_tokens(tokens: tuple[str, ...]) -> list[str]:
    """A BERT vocabulary as WordPiece spells it: llama.cpp's GGUF marks a word's first piece with
    a leading "▁" and leaves continuations bare, where WordPiece marks continuations with "##"."""
    return [t[1:] if t.startswith("▁") else t if t.startswith("[") and t.endswith("]") else "##" + t
            for t in tokens]


def tokenizer_config(v: GGUFVocab, max_length: int) -> dict[str, Any]:
    """tokenizer_config.json: the special tokens, add_bos_token and the chat template."""
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": v.add_bos,
        "add_eos_token": v.add_eos,
        "clean_up_tokenization_spaces": False,
    }
    cls_id = v.bos_id if v.kind == "bert" else None
    for key, i in (("bos_token", v.bos_id), ("eos_token", v.eos_id), ("unk_token", v.unk_id), ("pad_token", v.pad_id),
                   ("sep_token", v.sep_id), ("cls_token", cls_id)):
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
