"""Every real chat template llama.cpp keeps for its tests (models/templates/*.jinja, fetched
by tests/llama_cpp_source.py) through Spool's own prompt path: each renders a conversation with a
system prompt, tools, reasoning, a tool call and its result; each that knows tools names a
tool-call format Spool reads; and a call comes back out of that format's parser both as the
format writes it and as the template itself wrote the assistant's call.

Where the folder is not cached yet, test_the_templates_are_there fetches it (or skips); the
rest are parametrized over what is there when the tests are collected."""

import json
import shutil
from pathlib import Path

import pytest
from llama_cpp_source import models_folder, template_folder
from tiny_model import train_tokenizer

from app.engine.grammar import Grammars
from app.server.prompts import chat_prompt
from app.server.schemas import ChatCompletionRequest
from app.server.tools import FORMATS, ToolUse, detect
from model.tokenizer import Tokenizer

FOLDER = template_folder()
NAMES = sorted(p.stem for p in FOLDER.glob("*.jinja")) if FOLDER else []

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "required": ["city"], "properties": {
        # Command R+'s template adds every parameter's description to text, so each has one
        "city": {"type": "string", "description": "The city"},
        "days": {"type": "integer", "description": "How many days"}}}}}
CALL = ("get_weather", {"city": "Paris", "days": 3})
QUESTION, RESULT, SYSTEM = "What is the weather in Paris?", "sunny, 21 C", "You are terse."
MESSAGES = [
    {"role": "system", "content": SYSTEM},
    {"role": "user", "content": QUESTION},
    {"role": "assistant", "content": "", "reasoning_content": "The user wants the weather.", "tool_calls": [
        # nine letters and digits: Mistral's templates refuse any other call id
        {"id": "call12345", "type": "function", "function": {"name": CALL[0], "arguments": json.dumps(CALL[1])}}]},
    {"role": "tool", "tool_call_id": "call12345", "content": RESULT}]

# Variables a template reads that transformers does not pass, given as a client would give them
# (chat_template_kwargs): Firefunction v2's reads its tools as JSON text from `functions`, and
# the date from `datetime`, as Fireworks' own code passes them; without them it cannot render.
KWARGS = {"fireworks-ai-llama-3-firefunction-v2": {"functions": json.dumps([WEATHER["function"]]),
                                                   "datetime": "2025-01-01"}}

# Templates that leave the system prompt out of this conversation, by design: Mistral Nemo's
# writes it only into the conversation's last message, when that is a user's.
NO_SYSTEM_HERE = {"mistralai-Mistral-Nemo-Instruct-2407"}

# Formats Spool does not read yet: the templates render, but no parser reads their calls.
NOT_READ = {}


@pytest.fixture(scope="module")
def tokenizer_json(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("templates") / "tokenizer.json"
    train_tokenizer().save(str(path))
    return path


@pytest.fixture(scope="module")
def grammars(tokenizer_json):
    return Grammars(tokenizer(tokenizer_json, "{{ messages[0].content }}"))


def tokenizer(tokenizer_json: Path, template: str) -> Tokenizer:
    """A tokenizer with the template (its markers are plain text to it, which the formats read
    the same)."""
    folder = tokenizer_json.parent / str(abs(hash(template)))
    folder.mkdir(exist_ok=True)
    shutil.copy(tokenizer_json, folder)
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": template, "bos_token": "<s>", "eos_token": "<|endoftext|>"}))
    return Tokenizer(folder)


def template(name: str) -> str:
    return (FOLDER / f"{name}.jinja").read_text()


def rendered(tok: Tokenizer, name: str, messages: list[dict] = MESSAGES) -> str:
    """The conversation as the server renders it, through the server's own prompt path."""
    req = ChatCompletionRequest.model_validate({"messages": messages, "tools": [WEATHER],
                                                "chat_template_kwargs": KWARGS.get(name)})
    fmt = FORMATS[detect(tok.chat_template_source) or "hermes"](tok)
    ids = chat_prompt(tok, req.messages, ToolUse.of(req, fmt), True, req.template_variables(), fmt)
    return tok.decode(ids, skip_special_tokens=False)


def parsed(fmt, text: str) -> tuple[str, list[tuple[str, dict]]]:
    """(content, calls) the format's parser reads out of text, fed a piece at a time."""
    req = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}], "tools": [WEATHER]})
    parser = fmt.parser(ToolUse.of(req, fmt))
    content = "".join(parser.feed(text[i:i + 7])[0] for i in range(0, len(text), 7)) + parser.finish()
    return content, [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in parser.calls]


def test_the_templates_are_there():
    """The folder is fetched when missing (a skip where pip cannot), for the tests below."""
    assert (models_folder("templates/README.md") / "templates" / "README.md").is_file()


@pytest.mark.slow
@pytest.mark.parametrize("name", NAMES)
def test_the_template_renders_a_conversation_with_tools(name, tokenizer_json):
    text = rendered(tokenizer(tokenizer_json, template(name)), name)
    assert QUESTION in text and RESULT in text
    assert (SYSTEM in text) is (name not in NO_SYSTEM_HERE)


@pytest.mark.slow
@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.xfail(reason=NOT_READ[n], strict=True))
                                  if n in NOT_READ else n for n in NAMES])
def test_a_call_in_the_templates_format_parses_back(name, tokenizer_json, grammars):
    tok = tokenizer(tokenizer_json, template(name))
    found = detect(tok.chat_template_source)
    knows_tools = tok.template_takes_tools or tok.template_writes_calls
    assert found is not None or not knows_tools, "a template that knows tools names its format"
    fmt = FORMATS[found or "hermes"](tok)
    written = fmt.write_calls([CALL])
    content, calls = parsed(fmt, written)
    assert calls == [CALL] and not content.strip()
    use = ToolUse.of(ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": "hi"}], "tools": [WEATHER], "tool_choice": "required"}), fmt)
    matcher = grammars.matcher(use.grammar())
    ids = tok.encode(written, add_special_tokens=False)
    assert matcher.try_consume_tokens(ids) == len(ids) and matcher.is_accepting()
    # the call as the template wrote it, from its start up to the tool's result
    text = rendered(tok, name)
    turn = text[text.index(QUESTION) + len(QUESTION):text.rindex(RESULT)]
    start = turn.find(fmt.opener) if fmt.opener and fmt.opener in turn else min(
        i for i in (turn.find("{"), turn.find("["), len(turn)) if i >= 0)
    assert CALL in parsed(fmt, turn[start:])[1]


NINE_CHARACTER_IDS = [n for n in NAMES if "length != 9" in template(n)]


@pytest.mark.parametrize("name", NINE_CHARACTER_IDS)
def test_mistral_templates_take_the_ids_spool_and_other_servers_give(name, tokenizer_json):
    """Mistral's templates refuse a call id that is not nine letters and digits: a history
    whose ids came from another server (call_ and 24 hex digits) renders, the call and its
    result still paired, and a call Spool reads in Mistral's format gets such an id."""
    other = "call_" + "0123456789abcdef01234567"
    messages = [*MESSAGES[:2], {**MESSAGES[2], "tool_calls": [{**MESSAGES[2]["tool_calls"][0], "id": other}]},
                {**MESSAGES[3], "tool_call_id": other}]
    tok = tokenizer(tokenizer_json, template(name))
    text = rendered(tok, name, messages)
    assert RESULT in text and other[-9:] in text and other not in text
    fmt = FORMATS[detect(tok.chat_template_source)](tok)
    parser = fmt.parser(None)
    parser.feed(fmt.write_calls([CALL]))
    parser.finish()
    [call] = parser.calls
    assert len(call["id"]) == 9 and call["id"].isalnum()


@pytest.mark.skipif(not NAMES, reason="llama.cpp's templates could not be fetched")
def test_the_ids_checked_are_mistrals():
    assert NINE_CHARACTER_IDS and all("istral" in n or "agistral" in n for n in NINE_CHARACTER_IDS)
