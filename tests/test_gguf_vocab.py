"""GGUF vocabularies against llama.cpp's own tokenizer vectors: each vocabulary-only GGUF of
llama.cpp's tests, built into a tokenizer as Spool builds one from a GGUF, encodes every case to
the ids llama.cpp wrote down (tests/llama_cpp_source.py fetches them); and every pre-tokenizer
name llama.cpp's loader knows either builds or is refused by name."""

import re
from pathlib import Path

import gguf
import pytest

from llama_cpp_source import vocab_cases
from model.errors import ModelError
from model.gguf import pretok
from model.gguf.tokenizer import build_tokenizer
from model.gguf.vocab import CONTROL, NORMAL, UNKNOWN, GGUFVocab, read_vocab

# every vocabulary llama.cpp has vectors for (models/ggml-vocab-NAME.gguf.inp and .out)
NAMES = ["bert-bge", "command-r", "deepseek-coder", "deepseek-llm", "falcon", "gemma-4", "gpt-2", "llama-bpe",
         "llama-spm", "mpt", "phi-3", "qwen2", "qwen35", "refact", "starcoder"]

# the names llama.cpp's loader accepts for tokenizer.ggml.pre (src/llama-vocab.cpp, llama-cpp-python 0.3.36)
LLAMA_CPP_PRE_NAMES = """
default minicpm5 llama3 llama-v3 llama-bpe falcon3 falcon-h1 pixtral midm-2.0 lfm2 jina-v5-nano deepseek-llm
deepseek-coder deepseek-v3 spark2_5 youtu falcon mpt starcoder gpt-2 phi-2 jina-es jina-de gigachat jina-v2-es
jina-v2-de a.x-4.0 mellum modern-bert jais-2 gemma4 granite-embed-multi-311m sarvam-moe jina-v1-en jina-v2-code
roberta-bpe whitespace refact command-r qwen2 deepseek-r1-qwen kormo f2llmv2 qwen35 stablelm2 olmo dbrx smaug-bpe
poro-chat chatglm-bpe glm4 glm5 viking jais tekken smollm codeshell bloom gpt3-finnish exaone exaone4 exaone-moe
chameleon minerva-7b megrez gpt-4o llama4 kanana2 talkie granite-embed-multi-97m tiny_aya cohere2moe superbpe
trillion granite-docling bailingmoe bailingmoe2 llada-moe seed-coder hunyuan hunyuan-dense hy_v4 joyai-llm kimi-k2
ufakzeka grok-2 afmoe laguna minimax-m2 solar-open mellum2
""".split()

TEXT = "Hello World, it's 1234567 ÀÉ 你好 こんにちは 한국어 🦙\n\n  \tx <b>FOO</b>bar\r\n"


@pytest.mark.slow
@pytest.mark.parametrize("name", NAMES)
def test_a_gguf_vocabulary_encodes_as_llama_cpp_does(name):
    path, cases = vocab_cases(name)
    reader = gguf.GGUFReader(path)

    def field(key, default=None):
        f = reader.get_field(key)
        return default if f is None else f.contents()

    tok = build_tokenizer(read_vocab(field, path), path)
    wrong = [(text, ids) for text, ids in cases if tok.encode(text, add_special_tokens=False).ids != ids]
    assert len(cases) > 30 and not wrong, f"{len(wrong)} of {len(cases)}: {wrong[:3]}"


def tiny_vocab(pre: str) -> GGUFVocab:
    """A small vocabulary of every byte (GPT-2's byte map, or SentencePiece's <0xXX> tokens for the
    families that keep the text's characters) and a few merges."""
    fam = pretok.family(pre)
    if fam is not None and fam.raw:
        pieces = [f"<0x{b:02X}>" for b in range(256)] + ["▁", "H", "e", "l", "o", "He", "ll", "llo"]
        types = [6] * 256 + [NORMAL] * 8
    else:
        from tokenizers import pre_tokenizers

        pieces = sorted(pre_tokenizers.ByteLevel.alphabet()) + ["He", "ll", "llo"]
        types = [NORMAL] * len(pieces)
    tokens = ("<unk>", "<s>") + tuple(pieces)
    return GGUFVocab(kind="gpt2", tokens=tokens, types=(UNKNOWN, CONTROL, *types), bos_id=1, eos_id=1, unk_id=0,
                     pad_id=None, extra_eos_ids=(), add_bos=False, add_eos=False,
                     merges=(("H", "e"), ("l", "l"), ("ll", "o")), pre=pre, scores=(), add_space_prefix=False,
                     sep_id=None, add_sep=False, lowercase=True, strip_accents=True, chat_template=None)


@pytest.mark.parametrize("pre", LLAMA_CPP_PRE_NAMES)
def test_every_pre_tokenizer_llama_cpp_knows_builds_or_is_refused_by_name(pre):
    path = Path(f"m-{pre}.gguf")
    if pre in pretok.REFUSED:
        with pytest.raises(ModelError) as caught:
            build_tokenizer(tiny_vocab(pre), path)
        assert f"{pre!r}" in str(caught.value) and "\n" not in str(caught.value)
        return
    assert pre in pretok.SERVED
    tok = build_tokenizer(tiny_vocab(pre), path)
    ids = tok.encode(TEXT, add_special_tokens=False).ids
    assert tok.decode(ids) == TEXT
    assert tok.encode("Hello", add_special_tokens=False).tokens[:1] == ["He"]


def test_an_unknown_pre_tokenizer_is_one_line_naming_the_served_count():
    with pytest.raises(ModelError) as caught:
        build_tokenizer(tiny_vocab("no-such-pre"), Path("m.gguf"))
    line = str(caught.value)
    assert "\n" not in line and len(line) < 300, line
    assert "'no-such-pre'" in line and f"{len(pretok.SERVED)} of llama.cpp's names" in line
    assert "docs/models.md" in line


def test_the_served_and_refused_names_are_apart_and_documented():
    assert not pretok.SERVED & set(pretok.REFUSED)
    assert set(LLAMA_CPP_PRE_NAMES) == pretok.SERVED | set(pretok.REFUSED)
    page = (Path(__file__).resolve().parent.parent / "docs" / "models.md").read_text(encoding="utf-8")
    listed = set(re.findall(r"`([^`\s]+)`", page))
    assert pretok.SERVED <= listed, sorted(pretok.SERVED - listed)
    assert set(pretok.REFUSED) <= listed


def test_a_wordpiece_vocabulary_adds_cls_and_sep():
    path, _ = vocab_cases("bert-bge")
    reader = gguf.GGUFReader(path)
    v = read_vocab(lambda key, default=None: default if reader.get_field(key) is None
                   else reader.get_field(key).contents(), path)
    tok = build_tokenizer(v, path)
    assert tok.encode("Hello, World!").tokens == ["[CLS]", "hello", ",", "world", "!", "[SEP]"]
    assert tok.encode("a", "b").tokens == ["[CLS]", "a", "[SEP]", "b", "[SEP]"]
    assert tok.decode(tok.encode("unaffable tokenizer").ids, skip_special_tokens=True) == "unaffable tokenizer"
