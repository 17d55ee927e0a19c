"""chat_template_kwargs and reasoning_effort: extra variables for the chat template, as vLLM
passes them. A tiny reasoning model whose template reads enable_thinking (as Qwen3's does) and
reasoning_effort stands in, served on 127.0.0.1."""

import json

import httpx
import pytest

from live_server import LiveServer
from model.tokenizer import Tokenizer
from tiny_model import make_tiny_model

# Qwen3's switch: thinking opened for the model, or an empty thought when enable_thinking is false
TEMPLATE = (
    "{% if reasoning_effort is defined %}{{ '<|im_start|>system\nReasoning: ' + reasoning_effort + '<|im_end|>\n' }}"
    "{% endif %}"
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
    "{% if enable_thinking is defined and not enable_thinking %}{{ '<think>\n\n</think>\n\n' }}"
    "{% else %}{{ '<think>\n' }}{% endif %}{% endif %}"
)
HELLO = [{"role": "user", "content": "Hello"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model = make_tiny_model(tmp_path_factory.mktemp("tiny-qwen3-template"), thinking=True)
    config = json.loads((model / "tokenizer_config.json").read_text())
    (model / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": TEMPLATE}))
    s = LiveServer("--model", str(model), "--kv-cache-gib", "0.05")
    s.tokenizer = Tokenizer(model)
    yield s
    assert s.stop() == 0, s.output()


def post(server, path: str, **body) -> httpx.Response:
    return httpx.post(server.url + path, json={"messages": HELLO, **body}, timeout=60)


def rendered(server, **body) -> str:
    r = post(server, "/tokenize", **body)
    assert r.status_code == 200, r.text
    return server.tokenizer.decode(r.json()["tokens"], skip_special_tokens=False)


def test_the_template_sees_the_kwargs_and_the_effort(server):
    assert rendered(server).endswith("<|im_start|>assistant\n<think>\n")
    off = rendered(server, chat_template_kwargs={"enable_thinking": False})
    assert off.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert rendered(server, chat_template_kwargs={"enable_thinking": True}) == rendered(server)
    assert rendered(server, reasoning_effort="low").startswith("<|im_start|>system\nReasoning: low<|im_end|>\n")
    assert rendered(server, reasoning_effort="low", chat_template_kwargs={"reasoning_effort": "high"}).startswith(
        "<|im_start|>system\nReasoning: high")  # the explicit kwargs win, as vLLM's do
    render = post(server, "/v1/chat/completions/render", chat_template_kwargs={"enable_thinking": False}).json()
    assert server.tokenizer.decode(render["token_ids"], skip_special_tokens=False) == off


def test_a_chat_without_thinking_answers_in_content(server):
    start, end = server.tokenizer.think_ids
    body = {"max_tokens": 12, "ignore_eos": True, "logit_bias": {str(start): -100, str(end): -100}}
    thinking = post(server, "/v1/chat/completions", **body).json()["choices"][0]["message"]
    assert thinking["reasoning_content"] and not thinking["content"]  # the thought never closes
    r = post(server, "/v1/chat/completions", chat_template_kwargs={"enable_thinking": False}, **body)
    plain = r.json()["choices"][0]["message"]
    assert not plain.get("reasoning_content") and plain["content"]
    assert r.json()["usage"]["prompt_tokens"] == len(post(
        server, "/tokenize", chat_template_kwargs={"enable_thinking": False}).json()["tokens"])


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/tokenize", "/v1/chat/completions/render"])
@pytest.mark.parametrize("body, param", [
    ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs"),
    ({"chat_template_kwargs": {"add_generation_prompt": False}}, "chat_template_kwargs"),
    ({"chat_template_kwargs": {"tools": []}}, "chat_template_kwargs"),
    ({"chat_template_kwargs": ["enable_thinking"]}, "chat_template_kwargs"),
    ({"reasoning_effort": "extreme"}, "reasoning_effort"),
])
def test_kwargs_that_clash_are_refused_naming_the_field(server, path, body, param):
    r = post(server, path, **body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error"
    if "chat_template_kwargs" in body and isinstance(body["chat_template_kwargs"], dict):
        assert next(iter(body["chat_template_kwargs"])) in error["message"]
