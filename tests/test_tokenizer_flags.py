"""--tokenizer and --chat-template on serve and generate: another directory's tokenizer, and a
chat template from a file or given inline, in place of the model's own."""

import subprocess
import sys

import httpx
import pytest

from live_server import ROOT, LiveServer
from model.tokenizer import Tokenizer
from tiny_model import make_tiny_model

TEMPLATE = "{% for m in messages %}<think>{{ m['content'] }}</think>{% endfor %}{{ 'Answer:' if add_generation_prompt }}"


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    model = make_tiny_model(tmp_path_factory.mktemp("tiny-plain"))
    other = make_tiny_model(tmp_path_factory.mktemp("tiny-with-think-tokens"), thinking=True)
    template = tmp_path_factory.mktemp("template") / "chat.jinja"
    template.write_text(TEMPLATE)
    return model, other, template


@pytest.mark.parametrize("inline", [False, True], ids=["file", "inline"])
def test_serve_renders_with_the_flags_tokenizer_and_template(dirs, inline):
    model, other, template = dirs
    s = LiveServer("--model", str(model), "--kv-cache-gib", "0.05", "--tokenizer", str(other),
                   "--chat-template", TEMPLATE if inline else str(template))
    try:
        tokens = httpx.post(s.url + "/tokenize", json={"messages": [{"role": "user", "content": "Hello"}]}).json()
        tok = Tokenizer(other)
        assert tok.decode(tokens["tokens"], skip_special_tokens=False) == "<think>Hello</think>Answer:"
        assert tokens["tokens"][0] == tok.think_ids[0]  # an added token of the other tokenizer only
        assert Tokenizer(model).think_ids is None
    finally:
        assert s.stop() == 0, s.output()


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "app", *args], cwd=ROOT, capture_output=True, text=True, timeout=300)


def test_generate_takes_the_flags_and_bad_values_are_one_line_errors(dirs):
    model, other, _ = dirs
    refused = run("generate", "Hello", "--model", str(model), "--tokenizer", str(other),
                  "--chat-template", "{{ raise_exception('this template takes no messages') }}")
    assert refused.returncode == 2 and "this template takes no messages" in refused.stderr
    for flags in (["--chat-template", "no-such-file.jinja"], ["--tokenizer", str(ROOT / "app")]):
        bad = run("serve", "--model", str(model), *flags)
        assert bad.returncode != 0 and flags[0] in bad.stderr and "Traceback" not in bad.stderr
