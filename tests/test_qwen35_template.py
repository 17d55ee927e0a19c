"""Qwen3.5's own chat template (llama.cpp's copy of Qwen3.5-4B's, tests/llama_cpp_source.py) on
a tiny model with its markers: Spool reads its tool-call format from it (Qwen3-Coder's XML
form), writes a conversation's earlier calls and results through it as the template writes
them, and knows the template opens the reply inside a thinking section."""

import json

import pytest

from app.server.schemas import ChatCompletionRequest
from app.server.prompts import chat_prompt
from app.server.reasoning import opens_thinking
from app.server.tools import FORMATS, ToolUse, detect
from llama_cpp_source import chat_template
from model.tokenizer import Tokenizer
from tiny_model import make_tiny_model

MARKERS = ("<tool_call>", "</tool_call>", "<think>", "</think>", "<tool_response>", "</tool_response>")
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                            "parameters": {"type": "object", "required": ["city"],
                                                           "properties": {"city": {"type": "string"},
                                                                          "days": {"type": "integer"}}}}}


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    path = make_tiny_model(tmp_path_factory.mktemp("qwen35-template"), tokens=MARKERS,
                           chat_template=chat_template("Qwen3.5-4B"))
    return Tokenizer(path)


def render(tok, messages, tools=None, **variables) -> str:
    req = ChatCompletionRequest.model_validate({"messages": messages, **({"tools": tools} if tools else {})})
    fmt = FORMATS[detect(tok.chat_template_source)](tok)
    ids = chat_prompt(tok, req.messages, ToolUse.of(req, fmt), True, variables, fmt)
    return tok.decode(ids, skip_special_tokens=False)


@pytest.mark.slow
def test_the_template_writes_qwen3_coder_calls_and_results(tok):
    assert detect(tok.chat_template_source) == "qwen3_coder" and tok.template_takes_tools
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris for 3 days?"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": json.dumps({"city": "Paris", "days": 3})}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"},
        {"role": "user", "content": "And tomorrow?"}]
    text = render(tok, messages, [WEATHER])
    assert '"name": "get_weather"' in text and "Be brief." in text  # the tools, then the system prompt
    assert "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n" \
           "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>" in text
    assert "<tool_response>\nsunny, 21 C\n</tool_response>" in text
    assert text.endswith("<|im_start|>assistant\n<think>\n")


@pytest.mark.slow
def test_the_reply_opens_inside_thinking_unless_it_is_turned_off(tok):
    messages = [{"role": "user", "content": "hi"}]
    on = tok.encode_chat(messages, True)
    off = tok.encode_chat(messages, True, enable_thinking=False)
    assert opens_thinking(tok, on) and not opens_thinking(tok, off)
    assert tok.decode(off, skip_special_tokens=False).endswith("<think>\n\n</think>\n\n")


@pytest.mark.slow
def test_a_call_in_the_templates_form_parses_back(tok):
    """What the model is told to write, streamed through the format's parser, is the call."""
    fmt = FORMATS["qwen3_coder"](tok)
    parser = fmt.parser(ToolUse.of(ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": "hi"}], "tools": [WEATHER]}), fmt))
    text = "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n3\n" \
           "</parameter>\n</function>\n</tool_call>"
    content, _ = parser.feed(text)
    content += parser.finish()
    assert content.strip() == ""
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in parser.calls] == \
        [("get_weather", {"city": "Paris", "days": 3})]
