"""Byte-level BPE pre-tokenizers by tokenizer.ggml.pre: every name llama.cpp's vocabulary loader
knows (src/llama-vocab.cpp), each mapped to the splits its model's tokenizer.json makes, or
refused by name. A family is a list of regexes, each splitting off what it matches from every
piece the ones before it left (as llama.cpp and a `tokenizers` Split "isolated" both do), then
the GPT-2 byte map. Where llama.cpp hand-expands a regex its C++ regex engine cannot run, the
model's own form is kept (`tokenizers` runs Oniguruma, which can)."""

from __future__ import annotations

from dataclasses import dataclass

_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_CONTRACTIONS = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)"
_LLAMA3 = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
           r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
          r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# Qwen3.5's: Qwen2's with combining marks (\p{M}) kept inside words, and no NFC before it
_QWEN35 = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
           r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# words split at case changes (an upper-case run, then a lower-case one), as tiktoken's o200k
_UPPER, _LOWER = r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]", r"[\p{Ll}\p{Lm}\p{Lo}\p{M}]"


def _cased(contraction: str, number: str) -> str:
    word = r"[^\r\n\p{L}\p{N}]?"
    return (word + _UPPER + "*" + _LOWER + "+" + contraction + "|" + word + _UPPER + "+" + _LOWER + "*" + contraction
            + "|" + number + r"| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")


_TEKKEN = _cased("", r"\p{N}")
_GPT4O = _cased(_CONTRACTIONS + "?", r"\p{N}{1,3}")
_GRANITE_MULTI = (  # GPT-4o's with combining marks counted as letters
    r"[^\r\n\p{L}\p{N}]?((?=[\p{L}\p{M}])([^a-z]))*((?=[\p{L}\p{M}])([^A-Z]))+" + _CONTRACTIONS + "?"
    r"|[^\r\n\p{L}\p{N}]?((?=[\p{L}\p{M}])([^a-z]))+((?=[\p{L}\p{M}])([^A-Z]))*" + _CONTRACTIONS + "?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# Kimi K2's (its tokenization_kimi.py): Han runs apart from other letters
_KIMI_K2 = (rf"\p{{Han}}+|[^\r\n\p{{L}}\p{{N}}]?[{_UPPER[1:-1]}&&[^\p{{Han}}]]*[{_LOWER[1:-1]}&&[^\p{{Han}}]]+"
            rf"{_CONTRACTIONS}?|[^\r\n\p{{L}}\p{{N}}]?[{_UPPER[1:-1]}&&[^\p{{Han}}]]+[{_LOWER[1:-1]}&&[^\p{{Han}}]]*"
            rf"{_CONTRACTIONS}?|\p{{N}}{{1,3}}| ?[^\s\p{{L}}\p{{N}}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_CJK = r"[\x{4E00}-\x{9FA5}\x{800}-\x{4E00}\x{AC00}-\x{D7FF}]+"
_DEEPSEEK_PUNCT = r"\s?[!-/:-~\x{FF01}-\x{FF0F}\x{FF1A}-\x{FF5E}\x{2018}-\x{201F}\x{3000}-\x{3002}]+"
_YOUTU_CJK = (r"[\x{AC00}-\x{D7A3}\x{3131}-\x{318E}]+|[\x{FF01}\x{2026}\x{201C}\x{201D}\x{2018}\x{2019}\x{2014}"
              r"\x{FF1A}\x{FF1B}\x{FF0C}\x{3001}-\x{303F}\x{FE30}-\x{FE4F}]+|[\x{3105}-\x{312F}]+"
              r"|[\x{4E00}-\x{9FA5}\x{3040}-\x{309F}\x{30A0}-\x{30FF}]+")
_AFMOE_ASIAN = (r"[\x{4E00}-\x{9FFF}\x{3400}-\x{4DBF}\x{8C48}-\x{FAFF}\x{3040}-\x{309F}\x{30A0}-\x{30FF}"
                r"\x{FF65}-\x{FF9F}\x{2F00}-\x{2FDF}\x{E40}-\x{E7F}\x{E80}-\x{EFF}\x{1780}-\x{17FF}\x{1000}-\x{109F}"
                r"\x{AA60}-\x{AA7F}\x{A9E0}-\x{A9FF}\x{AC00}-\x{D7AF}\x{1100}-\x{11FF}]+")
_CJK_KANA = r"[\x{4E00}-\x{9FA5}\x{3040}-\x{309F}\x{30A0}-\x{30FF}]+"
_LATIN = (r"\s?[A-Za-z\x{B5}\x{C0}-\x{D6}\x{D8}-\x{F6}\x{F8}-\x{1BA}\x{1BC}-\x{1BF}\x{1C4}-\x{293}\x{295}-"
          r"\x{2AF}\x{370}-\x{373}\x{376}\x{377}\x{37B}-\x{37D}\x{37F}\x{386}\x{388}-\x{38A}\x{38C}\x{38E}"
          r"-\x{3A1}\x{3A3}-\x{3F5}\x{3F7}-\x{481}\x{48A}-\x{52F}\x{531}-\x{556}\x{10A0}-\x{10C5}\x{13A0}-"
          r"\x{13F5}\x{13F8}-\x{13FD}\x{1C90}-\x{1CBA}\x{1CBD}-\x{1CBF}\x{1D00}-\x{1D2B}\x{1D6B}-\x{1D77}"
          r"\x{1D79}-\x{1D9A}\x{1E00}-\x{1F15}\x{1F18}-\x{1F1D}\x{1F20}-\x{1F45}\x{1F48}-\x{1F4D}\x{1F50}-"
          r"\x{1F57}\x{1F59}\x{1F5B}\x{1F5D}\x{1F5F}-\x{1F7D}\x{1F80}-\x{1FB4}\x{1FB6}-\x{1FBC}\x{1FBE}"
          r"\x{1FC2}-\x{1FC4}\x{1FC6}-\x{1FCC}\x{1FD0}-\x{1FD3}\x{1FD6}-\x{1FDB}\x{1FE0}-\x{1FEC}\x{1FF2}-"
          r"\x{1FF4}\x{1FF6}-\x{1FFC}\x{2102}\x{2107}\x{210A}-\x{2113}\x{2115}\x{2119}-\x{211D}\x{2124}"
          r"\x{2126}\x{2128}\x{212A}-\x{212D}\x{212F}-\x{2134}\x{2139}\x{213C}-\x{213F}\x{2145}-\x{2149}"
          r"\x{214E}\x{2183}\x{2184}\x{2C00}-\x{2C7B}\x{2C7E}-\x{2CE4}\x{2CEB}-\x{2CEE}\x{2CF2}\x{2CF3}"
          r"\x{A640}-\x{A66D}\x{A680}-\x{A69B}\x{A722}-\x{A76F}\x{A771}-\x{A787}\x{A78B}-\x{A78E}\x{AB70}-"
          r"\x{ABBF}\x{FB00}-\x{FB06}\x{FB13}-\x{FB17}\x{FF21}-\x{FF3A}\x{FF41}-\x{FF5A}\x{10400}-"
          r"\x{1044F}\x{104B0}-\x{104D3}\x{104D8}-\x{104FB}\x{10C80}-\x{10CB2}\x{10CC0}-\x{10CF2}\x{118A0}"
          r"-\x{118DF}\x{1E900}-\x{1E943}]+")
_DEEPSEEK_V3 = (r"\p{N}{1,3}", _CJK_KANA,
                r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"
                r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_BLOOM = r" ?[^(\s|.,!?\x{2026}\x{3002}\x{FF0C}\x{3001}\x{964}\x{6D4}\x{60C})]+"
_DIGIT_GROUPS = r"\p{N}{1,3}(?=(?:\p{N}{3})*(?!\p{N}))"  # 1234567 -> 1 234 567


@dataclass(frozen=True)
class Family:
    splits: tuple[str, ...]
    ignore_merges: bool = False  # a piece that is a whole token is that token
    nfc: bool = False  # the model's tokenizer composes (NFC) before splitting
    raw: bool = False  # SentencePiece-style: "▁" for spaces, UTF-8 text with <0xXX> byte tokens


FAMILIES = {
    "gpt2": Family((_GPT2,)),
    "digits": Family((r"\p{N}", _GPT2)),
    "command-r": Family((r"\p{N}", _GPT2), nfc=True),
    "llama3": Family((_LLAMA3,), ignore_merges=True),
    "llama3-merges": Family((_LLAMA3,)),
    "jais2": Family((_LLAMA3.replace(r"\s+(?!\S)|\s+", "".join(
        rf"\s{{{n}}}(?!\S)|" for n in (512, 256, 128, 64, 32, 16, 8, 4)) + r"\s{1,2}(?!\S)|\s{1}"),)),
    "qwen2": Family((_QWEN2,), nfc=True),
    "qwen2-raw": Family((_QWEN2,)),
    "qwen35": Family((_QWEN35,)),
    "deepseek-llm": Family((r"[\r\n]", _LATIN, _DEEPSEEK_PUNCT, r"\s+$", _CJK, r"\p{N}+")),
    "deepseek-coder": Family((r"[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", _CJK, r"\p{N}")),
    "deepseek-v3": Family(_DEEPSEEK_V3),
    "spark2_5": Family(_DEEPSEEK_V3[:2] + (_DEEPSEEK_V3[2].replace(r"[\r\n]*|\s*[\r\n]+", r"|[\r\n]"), r"\p{N}")),
    "youtu": Family((_YOUTU_CJK, _GPT4O.replace(r"{1,3}", "")), ignore_merges=True),
    "falcon": Family((r"[\p{P}\$\+<=>\^~\|`]+", _GPT2, "[0-9][0-9][0-9]")),
    "bloom": Family((_BLOOM,)),
    "viking": Family((_BLOOM, r"\p{N}")),
    "chatglm": Family((_LLAMA3,)),
    "glm4": Family((_LLAMA3,), ignore_merges=True),
    "tekken": Family((_TEKKEN,), ignore_merges=True),
    "chameleon": Family(("<sentinel:[0-9]+>", "(IMGIMG)((A|B|C|D|E|F|G|H|I){1,4})Z", "([\\t\\n]|    |  )",
                         r"\p{N}", r"[\p{P}!-/:-@\[-`{-~]", _GPT2)),
    "gpt4o": Family((_GPT4O,)),
    "granite-multi": Family((_GRANITE_MULTI,), ignore_merges=True),
    "tiny-aya": Family((r"\d{1,3}(?=(?:\d{3})*\b)", _GPT4O)),
    "kimi-k2": Family((_KIMI_K2,)),
    "superbpe": Family((r"\p{N}+", r"(?=(\d{3})+(?!\d))")),
    "bailingmoe": Family((r"'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                          r"|\s*[\r\n]|\s+(?!\S)|\s+",)),
    "seed-coder": Family((_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1}| ?[^\s\p{L}\p{N}\r\n]+"
                          r"|\s*[\r\n]+|\s+(?!\S)|\s+",)),
    "ufakzeka": Family((_QWEN2.removeprefix(_CONTRACTIONS + "|"),)),
    "afmoe": Family((_DIGIT_GROUPS, _AFMOE_ASIAN, _DEEPSEEK_V3[2])),
    "laguna": Family(("[^\\n]+|[\\n]+", _QWEN2)),
    "exaone-moe": Family((_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?(?:\p{L}\p{M}*(?: \p{L}\p{M}*)*)+|\p{N}"
                          r"| ?[^\s\p{L}\p{N}]+[\r\n/]?|\s*[\r\n]|\s+(?!\S)|\s+",)),
    "minicpm5": Family((r"\p{N}{1,3}", _LLAMA3.replace(r"\p{N}{1,3}", r"\p{N}+")), ignore_merges=True),
    "spm-bpe": Family(("\n+",), raw=True),
}

# tokenizer.ggml.pre -> family, for every name llama.cpp's loader accepts
_NAMES = {
    "default": "gpt2",  # Spool's choice since its first GGUF reader: no name, no better guess
    "minicpm5": "minicpm5",
    "llama3": "llama3", "llama-v3": "llama3", "llama-bpe": "llama3", "falcon3": "llama3", "falcon-h1": "llama3",
    "pixtral": "llama3", "midm-2.0": "llama3", "lfm2": "llama3", "jina-v5-nano": "llama3",
    "dbrx": "llama3-merges", "smaug-bpe": "llama3-merges",
    "deepseek-llm": "deepseek-llm", "deepseek-coder": "deepseek-coder",
    "deepseek-v3": "deepseek-v3", "hunyuan-dense": "deepseek-v3", "hy_v4": "deepseek-v3", "joyai-llm": "deepseek-v3",
    "spark2_5": "spark2_5", "youtu": "youtu", "falcon": "falcon",
    "gpt-2": "gpt2", "mpt": "gpt2", "olmo": "gpt2", "jais": "gpt2", "trillion": "gpt2",
    "granite-docling": "gpt2", "phi-2": "gpt2", "jina-es": "gpt2", "jina-de": "gpt2", "gigachat": "gpt2",
    "jina-v2-es": "gpt2", "jina-v2-de": "gpt2", "a.x-4.0": "gpt2", "mellum": "gpt2", "modern-bert": "gpt2",
    "jina-v1-en": "gpt2", "jina-v2-code": "gpt2", "roberta-bpe": "gpt2", "exaone4": "gpt2",
    "jais-2": "jais2",
    "gemma4": "spm-bpe", "granite-embed-multi-311m": "spm-bpe", "sarvam-moe": "spm-bpe",
    "starcoder": "digits", "refact": "digits", "smollm": "digits", "codeshell": "digits", "exaone": "digits",
    "minerva-7b": "digits", "mellum2": "digits", "command-r": "command-r",
    "qwen2": "qwen2", "deepseek-r1-qwen": "qwen2", "stablelm2": "qwen2",
    "kormo": "qwen2-raw", "f2llmv2": "qwen2", "megrez": "qwen2-raw", "hunyuan": "qwen2-raw",
    "solar-open": "qwen2-raw", "grok-2": "qwen2-raw",
    "qwen35": "qwen35",
    "poro-chat": "bloom", "bloom": "bloom", "gpt3-finnish": "bloom", "viking": "viking",
    "chatglm-bpe": "chatglm", "glm4": "glm4", "glm5": "glm4",
    "tekken": "tekken", "chameleon": "chameleon",
    "gpt-4o": "gpt4o", "llama4": "gpt4o", "kanana2": "gpt4o", "talkie": "gpt4o", "minimax-m2": "gpt4o",
    "granite-embed-multi-97m": "granite-multi", "tiny_aya": "tiny-aya", "cohere2moe": "tiny-aya",
    "kimi-k2": "kimi-k2", "superbpe": "superbpe",
    "bailingmoe": "bailingmoe", "bailingmoe2": "bailingmoe", "llada-moe": "bailingmoe",
    "seed-coder": "seed-coder", "ufakzeka": "ufakzeka", "afmoe": "afmoe", "laguna": "laguna",
    "exaone-moe": "exaone-moe",
}
# names llama.cpp knows that Spool refuses, and why
REFUSED = {
    "whitespace": "which splits at whitespace with no byte map (jina-embeddings-v2-base-zh's)",
}
# names whose llama.cpp loader adds BOS where the file does not say
BOS_BY_DEFAULT = frozenset({"llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0",
                            "lfm2", "jina-v5-nano", "tekken", "chameleon", "gemma4"})
BOS_ALWAYS = frozenset({"gemma4", "granite-embed-multi-311m"})  # llama.cpp adds it whatever the file says
SEP_BY_DEFAULT = frozenset({"jina-v1-en", "jina-v2-code", "roberta-bpe"})
SERVED = frozenset(_NAMES)


def family(pre: str) -> Family | None:
    """The family that tokenizer.ggml.pre names, or None where it is refused or unknown."""
    name = _NAMES.get(pre)
    return None if name is None else FAMILIES[name]


def refusal(pre: str) -> str:
    """One line: why pre is not served, and which names are."""
    why = REFUSED.get(pre, "which this converter does not know")
    return (f"uses the BPE pre-tokenizer {pre!r}, {why}; {len(SERVED)} of llama.cpp's names are served"
            " (docs/models.md lists them); use the Hugging Face model directory instead")
