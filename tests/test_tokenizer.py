"""Tokenizer, chat template, end-of-generation set, and the incremental detokenizer."""

import json
import shutil

import pytest

from model.errors import ModelError
from model.tokenizer import ChatTemplateError, IncrementalDetokenizer, Tokenizer


@pytest.fixture(scope="module")
def tok(tiny_dir):
    return Tokenizer(tiny_dir)


def test_round_trip(tok):
    for text in ["Hello world!", "def add(a, b):\n    return a + b\n", "  spaces   and\ttabs ",
                 "東京 😀 Straße", "1234567890", ""]:
        assert tok.decode(tok.encode(text)) == text


def test_chat_template_renders_like_transformers(tok):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    text = tok.render_chat(messages)
    assert text == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    assert not tok.render_chat(messages, add_generation_prompt=False).endswith("assistant\n")
    ids = tok.encode_chat(messages)
    assert ids[0] == tok.hf.token_to_id("<|im_start|>")
    assert ids == tok.encode(text, add_special_tokens=False)


def test_eos_set_includes_generation_config_list(tok):
    assert tok.eos_token_ids == {tok.hf.token_to_id("<|im_end|>"), tok.hf.token_to_id("<|endoftext|>")}


def test_template_exception_is_a_clear_error(tiny_dir, tmp_path):
    d = tmp_path / "m"
    shutil.copytree(tiny_dir, d)
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg["chat_template"] = "{% if messages[0]['role'] != 'user' %}{{ raise_exception('first must be user') }}{% endif %}x"
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    with pytest.raises(ChatTemplateError, match="first must be user"):
        Tokenizer(d).render_chat([{"role": "assistant", "content": "hi"}])


def test_missing_tokenizer_is_one_clear_line(tiny_dir, tmp_path):
    d = tmp_path / "m"
    shutil.copytree(tiny_dir, d)
    (d / "tokenizer.json").unlink()
    with pytest.raises(ModelError, match="no tokenizer.json") as e:
        Tokenizer(d)
    assert "\n" not in str(e.value)


def test_detokenizer_never_emits_broken_utf8(tok):
    text = "Café 東京 😀😀 naïve ünïcödé, then ascii."
    ids = tok.encode(text)
    # the tiny vocabulary splits these characters into byte tokens
    assert any("\ufffd" in tok.decode([i]) for i in ids)
    detok = IncrementalDetokenizer(tok)
    deltas = [detok.add(i) for i in ids] + [detok.flush()]
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == text
    assert "" in deltas[:-1]  # something was held back until its character was whole


def test_detokenizer_flush_releases_an_unfinished_character(tok):
    ids = tok.encode("😀")
    detok = IncrementalDetokenizer(tok)
    assert "".join(detok.add(i) for i in ids[:-1]) == ""
    assert detok.flush() == tok.decode(ids[:-1])


def with_template(tiny_dir, tmp_path, template: str, **bounds) -> Tokenizer:
    d = tmp_path / "m"
    shutil.copytree(tiny_dir, d, dirs_exist_ok=True)
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    (d / "tokenizer_config.json").write_text(json.dumps({**cfg, "chat_template": template}))
    return Tokenizer(d, **bounds)


def test_what_real_templates_use_renders(tiny_dir, tmp_path):
    """tojson with json.dumps's keywords (GLM's ensure_ascii) and over what map yields
    (llama.cpp's DeepSeek-R1), {% generation %} blocks (LFM2.5's, Laguna's), and a list the
    template grows and shrinks (Kimi K2's queue of call ids)."""
    tok = with_template(tiny_dir, tmp_path, (
        "{{ messages[0] | tojson(ensure_ascii=False, separators=(',', ':'), sort_keys=True) }}|"
        "{{ messages | map(attribute='role') | tojson }}|"
        "{%- generation -%}in{%- endgeneration -%}|"
        "{% set q = namespace(ids=[]) %}{% set _ = q.ids.append('a') %}{% set _ = q.ids.append('b') %}"
        "{{ q.ids.pop(0) }}{{ q.ids | length }}"))
    text = tok.render_chat([{"role": "user", "content": "Café"}])
    assert text == '{"content":"Café","role":"user"}|["user"]|in|a1'


def test_a_growing_list_is_held_to_the_render_size(tiny_dir, tmp_path):
    tok = with_template(tiny_dir, tmp_path, "{% set q = namespace(ids=[]) %}"
                        "{% for i in range(100000) %}{% set _ = q.ids.append(i) %}{% endfor %}", render_chars=1000)
    with pytest.raises(ChatTemplateError, match="more than 1000 characters"):
        tok.render_chat([{"role": "user", "content": "hi"}])


@pytest.mark.parametrize("writes, objects", [
    ("{{ c.function.arguments | tojson }}", True),
    ("{% for k, v in c.function.arguments | items %}{{ k }}={{ v }}{% endfor %}", True),
    ("{{ '>>>' + c.function.name + '\\n' + c.function.arguments }}", False),  # Functionary 3.2's
    ("{{ c.function.arguments }}", False),  # bare: an object would be written as Python's repr
])
def test_arguments_go_to_the_template_as_it_writes_them(tiny_dir, tmp_path, writes, objects):
    template = "{% for m in messages %}{% for c in m.tool_calls or [] %}" + writes + "{% endfor %}{% endfor %}"
    assert with_template(tiny_dir, tmp_path, template).template_takes_object_arguments is objects
