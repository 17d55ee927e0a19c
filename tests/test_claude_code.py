"""Claude Code on the Messages API. Its recorded first request (tests/data/agents/
claude_code_first.json: Claude Code 2.1.197's `claude -p "say hi"`, its paths and ids made
neutral) carries a system message inside `messages`, adaptive thinking, output_config.effort,
context_management, metadata, max_tokens 32000 and 25 tools, about 20k tokens in all.

The fields one by one; the request replayed as recorded, JSON and streamed, on a random-weight
model with the default model's tokenizer and a context just longer than the prompt, so its
max_tokens is held to what the context leaves; its second turn (the conversation resent, as
Claude Code does) read from the prefix cache; and, marked slow, the CLI itself from npm running
one turn.
"""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import httpx
import llguidance
import pytest
from anthropic.types import Message, RawMessageStreamEvent
from pydantic import TypeAdapter

from app.server.anthropic.chat_request import chat_request, clear_thinking, unapplied_edits
from app.server.anthropic.schemas import MessagesRequest
from app.server.errors import APIError
from app.server.limits import Limits
from app.server.prompts import chat_prompt, chat_tokens, system_first
from app.server.request_limits import parse
from app.server.tools import FORMATS, ToolUse
from live_server import LiveServer
from npm_cli import npm_cli
from model.tokenizer import Tokenizer
from tiny_model import CHATML, make_tiny_model

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))
import bench_agent_turns  # noqa: E402
import make_model  # noqa: E402

RECORDED = json.loads((ROOT / "tests" / "data" / "agents" / "claude_code_first.json").read_text())
FIRST = RECORDED["body"]
MODEL = FIRST["model"]  # the name Claude Code was told (--model): the server serves under it
ROOM = 256  # tokens the replay server's context holds past the recorded prompt
SAY = [{"role": "user", "content": "Say hi."}]
CLAUDE_CODE_VERSION = "2.1.197"  # the CLI that sent the recorded request


def messages_request(body: dict) -> MessagesRequest:
    """The body as the route reads it, under the default limits."""
    return parse(MessagesRequest, json.dumps(body).encode(), Limits(), 1024)


def asking(**fields) -> MessagesRequest:
    return messages_request({"model": MODEL, "max_tokens": 8, "messages": SAY, **fields})


# -- the fields, one by one ------------------------------------------------------------------


def test_the_recorded_request_passes_the_default_limits():
    req = messages_request(FIRST)
    assert [m.role for m in req.messages] == ["user", "system"] and len(req.tools) == 25
    assert req.thinking.type == "adaptive" and req.output_config.effort == "high"
    chat = chat_request(req)
    assert [m.role for m in chat.messages] == ["system", "user", "system"]
    assert chat.reasoning_effort == "high" and chat.max_thinking_tokens is None and not chat.chat_template_kwargs


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_the_recorded_tools_compile_in_every_call_format(name):
    """Two of Claude Code's tools use propertyNames, which llguidance does not implement: it goes
    unenforced (the grammar is lenient) rather than refusing the request."""
    req = messages_request(FIRST)
    grammar = ToolUse.of(chat_request(req), FORMATS[name]()).grammar()
    assert llguidance.LLMatcher.validate_grammar(grammar) == ""


def test_a_system_message_stays_where_it_is_sent():
    req = asking(system="Top.", messages=[*SAY, {"role": "assistant", "content": "Hi."},
                                         {"role": "system", "content": [{"type": "text", "text": "Late."}]},
                                         {"role": "user", "content": "Again."}])
    chat = chat_request(req)
    assert [m.role for m in chat.messages] == ["system", "user", "assistant", "system", "user"]
    assert chat.messages[3].content == "Late."


def test_a_system_message_holds_text_only():
    use = {"type": "tool_use", "id": "toolu_1", "name": "f", "input": {}}
    with pytest.raises(APIError) as e:
        asking(messages=[*SAY, {"role": "system", "content": [use]}])
    assert e.value.status == 400 and "system message holds text blocks only" in e.value.message


@pytest.mark.parametrize("thinking, effort, expected", [
    ({"type": "adaptive"}, None, {}),
    ({"type": "enabled", "budget_tokens": 64}, "low", {"max_thinking_tokens": 64, "reasoning_effort": "low"}),
    ({"type": "disabled"}, "max", {"chat_template_kwargs": {"enable_thinking": False}, "reasoning_effort": "high"}),
], ids=["adaptive", "enabled", "disabled"])
def test_thinking_and_effort_reach_the_template(thinking, effort, expected):
    config = {"output_config": {"effort": effort}} if effort else {}
    chat = chat_request(asking(thinking=thinking, **config))
    fields = ("max_thinking_tokens", "reasoning_effort", "chat_template_kwargs")
    assert {k: getattr(chat, k) for k in fields if getattr(chat, k) is not None} == expected


THOUGHT = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b", "reasoning_content": "one"},
           {"role": "user", "content": "c"}, {"role": "assistant", "content": "d", "reasoning_content": "two"},
           {"role": "user", "content": "e"}, {"role": "assistant", "content": "f", "reasoning_content": "three"}]


@pytest.mark.parametrize("keep, kept", [(None, ["three"]), ({"type": "thinking_turns", "value": 2}, ["two", "three"]),
                                        ({"type": "thinking_turns", "value": 0}, []),
                                        ("all", ["one", "two", "three"])], ids=["default", "two", "none", "all"])
def test_clear_thinking_keeps_the_last_turns_thinking(keep, kept):
    edit = {"type": "clear_thinking_20251015", **({} if keep is None else {"keep": keep})}
    req = asking(context_management={"edits": [edit]})
    cleared = clear_thinking(THOUGHT, req.context_management)
    assert [m["reasoning_content"] for m in cleared if "reasoning_content" in m] == kept
    assert [m["content"] for m in cleared] == [m["content"] for m in THOUGHT]
    assert unapplied_edits(req.context_management) == []


def test_clear_tool_uses_is_taken_and_named_as_not_applied():
    edits = [{"type": "clear_tool_uses_20250919", "trigger": {"type": "input_tokens", "value": 30000},
              "keep": {"type": "tool_uses", "value": 3}, "clear_at_least": {"type": "input_tokens", "value": 5000}},
             {"type": "clear_thinking_20251015", "keep": "all"}]
    req = asking(context_management={"edits": edits}, metadata={"user_id": "someone"}, service_tier="auto")
    assert unapplied_edits(req.context_management) == ["clear_tool_uses_20250919"]
    with pytest.raises(APIError) as e:
        asking(context_management={"edits": [{"type": "clear_thinking_20251015", "keep": {"value": -1}}]})
    assert e.value.status == 400 and "context_management.edits.0.keep" in e.value.message


def test_system_first_joins_the_system_messages_at_the_top():
    late = [{"role": "system", "content": "Top."}, {"role": "user", "content": "a"},
            {"role": "system", "content": "Late."}]
    assert system_first(late) == [{"role": "system", "content": "Top.\n\nLate."}, {"role": "user", "content": "a"}]
    assert system_first(late[:2]) == late[:2]
    assert system_first(late[1:]) == [{"role": "system", "content": "Late."}, {"role": "user", "content": "a"}]


# A template that takes a system message first only (Qwen3's raises), and one that drops the others
FIRST_ONLY = CHATML.replace("{% for message in messages %}", "{% for message in messages %}"
                            "{% if message['role'] == 'system' and not loop.first %}"
                            "{{ raise_exception('System message must be at the beginning.') }}{% endif %}")
DROPS_LATE = CHATML.replace("{{ '<|im_start|>' + message", "{% if loop.first or message['role'] != 'system' %}"
                            "{{ '<|im_start|>' + message").replace("'<|im_end|>' + '\n' }}",
                                                                   "'<|im_end|>' + '\n' }}{% endif %}")


@pytest.mark.parametrize("template, in_place", [(CHATML, True), (FIRST_ONLY, False), (DROPS_LATE, False)],
                         ids=["chatml", "first-only", "drops-late"])
def test_a_late_system_message_is_placed_as_the_template_allows(tmp_path, template, in_place):
    tokenizer = Tokenizer(make_tiny_model(tmp_path, chat_template=template))
    assert tokenizer.template_writes_late_system is in_place
    req = asking(system="Top.", messages=[*SAY, {"role": "system", "content": "Late."}])
    text = tokenizer.decode(chat_prompt(tokenizer, chat_request(req).messages, None, True), skip_special_tokens=False)
    top, user, late = text.index("Top."), text.index("Say hi."), text.index("Late.")
    assert (top < user < late) if in_place else (top < late < user)


# -- the recorded request, replayed -----------------------------------------------------------

# One layer of two heads with a 32k context (tools/make_model.py): the tokenizer is the default
# model's, so the prompt is as long as on a real model, and the protocol is what is tested
LONG = make_model.SHAPES["tiny-32k"]


@pytest.fixture(scope="module")
def long_model(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("long-context") / "model"
    make_model.write_hf(out, LONG, "f32", seed=0)
    return out


@pytest.fixture(scope="module")
def prompt_tokens(long_model) -> int:
    """The recorded request's prompt length, as the server renders it (Hermes: the template
    knows no tools)."""
    tokenizer = Tokenizer(long_model)
    state = SimpleNamespace(tokenizer=tokenizer, tool_format=FORMATS["hermes"](tokenizer))
    return len(chat_tokens(state, chat_request(messages_request(FIRST))))


@pytest.fixture(scope="module")
def server(long_model, prompt_tokens):
    s = LiveServer("--model", str(long_model), "--served-model-name", MODEL, "--max-model-len",
                   str(prompt_tokens + ROOM), "--kv-cache-gib", "0.05", "--prefill-chunk", "2048")
    yield s
    assert s.stop() == 0, s.output()


def replay(server, body: dict) -> httpx.Response:
    return httpx.post(server.url + RECORDED["path"], json=body, headers=RECORDED["headers"], timeout=300)


def test_the_recorded_request_is_answered(server, prompt_tokens):
    r = replay(server, {**FIRST, "stream": False})
    assert r.status_code == 200, r.text
    assert "spool-skipped-context-edits" not in r.headers  # clear_thinking, keep all: applied
    body = r.json()
    message = Message.model_validate(body)
    assert set(body) <= set(Message.model_fields) and message.model == MODEL
    assert message.stop_reason in ("end_turn", "max_tokens", "tool_use")
    usage = message.usage
    assert usage.input_tokens + usage.cache_read_input_tokens == prompt_tokens
    assert 0 < usage.output_tokens <= ROOM  # max_tokens 32000, held to what the context leaves


def test_the_recorded_request_streams(server, prompt_tokens):
    with httpx.stream("POST", server.url + RECORDED["path"], json=FIRST, headers=RECORDED["headers"],
                      timeout=300) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        payloads = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
    adapter = TypeAdapter(RawMessageStreamEvent)
    for payload in payloads:
        if payload["type"] != "ping":
            adapter.validate_python(payload)
    assert payloads[0]["type"] == "message_start" and payloads[-1]["type"] == "message_stop"
    assert payloads[-2]["delta"]["stop_reason"] in ("end_turn", "max_tokens", "tool_use")


def test_max_tokens_is_held_to_the_context(server, prompt_tokens):
    """Greedy, the random model writes to the end of the context: max_tokens 32000 is held to
    what is left, and the message ends with stop_reason max_tokens there."""
    message = replay(server, {**FIRST, "stream": False, "temperature": 0}).json()
    usage = message["usage"]
    assert message["stop_reason"] == "max_tokens", message
    assert usage["input_tokens"] + usage["cache_read_input_tokens"] + usage["output_tokens"] == prompt_tokens + ROOM


def test_a_prompt_past_the_context_is_refused_in_anthropics_shape(server, prompt_tokens):
    longer = {**FIRST, "messages": [*FIRST["messages"], {"role": "user", "content": "more " * ROOM}]}
    r = replay(server, longer)
    assert r.status_code == 400 and r.json()["type"] == "error", r.text
    assert f"this model's context is {prompt_tokens + ROOM}" in r.json()["error"]["message"]


def test_the_second_turn_reads_the_first_from_the_prefix_cache(server, prompt_tokens):
    """Claude Code resends the whole conversation, the reply and the next question added
    (tools/bench_agent_turns.py builds it): all but the last blocks of the first turn's prompt
    are read from the cache."""
    first, second = bench_agent_turns.turns(RECORDED, None)
    assert replay(server, first).status_code == 200
    usage = replay(server, second).json()["usage"]
    assert usage["cache_read_input_tokens"] >= prompt_tokens - 32 and usage["input_tokens"] < 64, usage


def test_an_edit_not_applied_is_named_in_a_header(server):
    edits = [{"type": "clear_tool_uses_20250919", "keep": {"type": "tool_uses", "value": 3}}]
    body = {"model": MODEL, "max_tokens": 2, "messages": SAY, "context_management": {"edits": edits}}
    for stream in (False, True):
        r = httpx.post(server.url + "/v1/messages", json={**body, "stream": stream}, timeout=60)
        assert r.status_code == 200 and r.headers["spool-skipped-context-edits"] == "clear_tool_uses_20250919"


# -- the CLI ----------------------------------------------------------------------------------


def ending_soon(model: Path, out: Path) -> Path:
    """The model with every fourth token id an end of turn, so that its random answer ends after
    a few tokens: Claude Code calls an answer cut short by max_tokens an error (exit 1), and asks
    again after an empty one."""
    shutil.copytree(model, out)
    generation = json.loads((out / "generation_config.json").read_text())
    ends = generation["eos_token_id"] if isinstance(generation["eos_token_id"], list) else [generation["eos_token_id"]]
    vocab = json.loads((out / "config.json").read_text())["vocab_size"]
    generation["eos_token_id"] = sorted(set(ends) | set(range(0, vocab, 4)))
    (out / "generation_config.json").write_text(json.dumps(generation))
    return out


@pytest.mark.slow
def test_claude_code_completes_a_turn(long_model, tmp_path):
    """`claude -p` against `spool serve`: one turn, exit 0. CLAUDE_CODE_MAX_OUTPUT_TOKENS bounds
    the answer; the non-essential calls (telemetry, update checks) stay off."""
    exe = npm_cli(f"@anthropic-ai/claude-code@{CLAUDE_CODE_VERSION}", "claude")
    model = ending_soon(long_model, tmp_path / "model")
    s = LiveServer("--model", str(model), "--served-model-name", MODEL, "--max-model-len", "32768",
                   "--kv-cache-gib", "0.05", "--prefill-chunk", "2048", "--api-key", "sk-claude-code")
    try:
        home, work = tmp_path / "home", tmp_path / "project"
        home.mkdir(), work.mkdir()
        env = {"PATH": os.environ["PATH"], "HOME": str(home), "ANTHROPIC_BASE_URL": s.url,
               "ANTHROPIC_API_KEY": "sk-claude-code", "CLAUDE_CODE_MAX_OUTPUT_TOKENS": "128",
               "DISABLE_TELEMETRY": "1", "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1"}
        done = subprocess.run([str(exe), "-p", "say hi", "--model", MODEL], cwd=work, env=env,
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, (done.stdout, done.stderr, s.output()[-3000:])
        assert "POST /v1/messages" in s.output()
    finally:
        assert s.stop() == 0, s.output()
