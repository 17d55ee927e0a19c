"""GGUF vocabularies against llama.cpp's own tokenizer vectors: each vocabulary-only GGUF of
llama.cpp's tests, built into a tokenizer as Spool builds one from a GGUF, encodes every case to
the ids llama.cpp wrote down (tests/llama_cpp_source.py fetches them)."""

import gguf
import pytest

from llama_cpp_source import vocab_cases
from model.gguf.tokenizer import build_tokenizer
from model.gguf.vocab import read_vocab

# the pre-tokenizers Spool reads (model/gguf/tokenizer.py) that llama.cpp has vectors for
NAMES = ["gpt-2", "llama-bpe", "llama-spm", "qwen2", "qwen35", "refact", "starcoder"]


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
