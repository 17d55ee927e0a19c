"""The Responses API as Codex CLI uses it (issue 53): its recorded first requests replayed
(tests/data/agents/codex_first*.json, captured from Codex 0.171 against a logging server:
function tools, a namespace tool, custom apply_patch with its Lark grammar, hosted web_search
and tool_search, developer messages, include, store false, reasoning.summary,
prompt_cache_key, client_metadata), a namespace tool's call round trip, hosted tools skipped
with the header, a custom tool's grammar holding its input, and `codex exec` itself against a
served model (slow; skipped where npm or its registry is out of reach)."""

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import httpx
import numpy as np
import pytest
from openai.types.responses import ResponseStreamEvent
from pydantic import TypeAdapter
from safetensors.numpy import save_file

from live_server import LiveServer
from npm_cli import npm_cli
from test_responses import MODEL, check, check_response
from tiny_model import random_weights

from app.server.responses.lark_regex import NotRegular, lark_regex
from model.default import default_model_dir

AGENTS = Path(__file__).parent / "data" / "agents"
CODEX_VERSION = "0.171.0"  # the CLI that sent the recorded requests
AGENT = "codex-agent"
CONTEXT = 16384  # a Codex first request is about 11k tokens of the default model's tokenizer
CRM = {"type": "namespace", "name": "crm", "description": "The customer records.", "tools": [
    {"type": "function", "name": "lookup", "description": "Find a customer by name", "parameters": {
        "type": "object", "additionalProperties": False, "required": ["name"],
        "properties": {"name": {"type": "string", "maxLength": 20}}}}]}
HOSTED = [{"type": "web_search"}, {"type": "image_generation"},
          {"type": "file_search", "vector_store_ids": ["vs_1"]},
          {"type": "mcp", "server_label": "docs", "server_url": "https://mcp.example.com/sse"}]
SQL = 'start: "SELECT " COLUMN " FROM " TABLE ";"\nCOLUMN: /[a-z]{1,10}/\nTABLE: "users" | "orders"\n'
QUERY = {"type": "custom", "name": "run_sql", "description": "Run one SQL query",
         "format": {"type": "grammar", "syntax": "lark", "definition": SQL}}


def fixture(name: str) -> dict:
    return json.loads((AGENTS / f"{name}.json").read_text())


def agent_model(path: Path) -> Path:
    """A tiny random model with the default model's tokenizer and template (so an agent's
    prompt is as many tokens as there) and a long context, which ends its answers within a
    few tokens: every token's embedding shares one large component, which the LM head reads
    only for the end-of-turn token."""
    path.mkdir(parents=True, exist_ok=True)
    source = default_model_dir(progress=False)
    for name in ("tokenizer.json", "generation_config.json"):
        shutil.copy(source / name, path / name)
    tokenizer_config = json.loads((source / "tokenizer_config.json").read_text())
    (path / "tokenizer_config.json").write_text(json.dumps({**tokenizer_config, "model_max_length": CONTEXT}))
    config = json.loads((source / "config.json").read_text())
    vocab, eos = config["vocab_size"], config["eos_token_id"]
    config.update(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, max_position_embeddings=CONTEXT, tie_word_embeddings=False,
                  torch_dtype="float32")
    tensors = random_weights("llama", tie=False, vocab=vocab)
    tensors["model.embed_tokens.weight"][:, 0] = 4.0
    tensors["model.norm.weight"][0] = 1.0
    tensors["lm_head.weight"][:, 0] = 0.0
    tensors["lm_head.weight"][eos, 0] = 4.0
    save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()}, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(config))
    return path


@pytest.fixture(scope="module")
def agent_server(tmp_path_factory):
    s = LiveServer("--model", str(agent_model(tmp_path_factory.mktemp("agent-model") / AGENT)),
                   "--max-model-len", str(CONTEXT), "--kv-cache-gib", "0.05")
    yield s
    assert s.stop() == 0, s.output()


def events(response: httpx.Response) -> list[dict]:
    """A stream's events, each checked against the client's types and OpenAI's schema."""
    lines = list(response.iter_lines())
    names = [line[7:] for line in lines if line.startswith("event: ")]
    payloads = [json.loads(line[6:]) for line in lines if line.startswith("data: ")]
    assert [p["type"] for p in payloads] == names
    for payload in payloads:
        TypeAdapter(ResponseStreamEvent).validate_python(payload)
        check(payload, "ResponseStreamEvent")
    return payloads


@pytest.mark.parametrize("name, skipped", [("codex_first", "web_search"),
                                           ("codex_first_gpt55", "tool_search, web_search")])
def test_codex_first_request_is_answered(agent_server, name, skipped):
    body = {**fixture(name), "model": AGENT}  # as Codex would name the served model
    assert body["stream"] and body["store"] is False and body["include"] == ["reasoning.encrypted_content"]
    with httpx.stream("POST", agent_server.url + "/v1/responses", json=body, timeout=300) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["spool-skipped-tools"] == skipped
        payloads = events(r)
    assert payloads[0]["type"] == "response.created" and payloads[-1]["type"] == "response.completed"
    response = check_response(payloads[-1]["response"])
    assert response.usage.input_tokens > 8000  # the whole prompt: instructions, tools and all
    whole = httpx.post(agent_server.url + "/v1/responses", json={**body, "stream": False}, timeout=300)
    assert whole.status_code == 200 and whole.headers["spool-skipped-tools"] == skipped
    assert check_response(whole.json()).usage.input_tokens == response.usage.input_tokens
    assert f"skipped the tools {skipped} " in agent_server.output()


def test_hosted_tools_are_skipped_and_named(server):
    body = {"model": MODEL, "input": "What is the capital of France?", "tools": HOSTED + [CRM],
            "max_output_tokens": 4}
    r = httpx.post(server.url + "/v1/responses", json=body, timeout=60)
    assert r.status_code == 200, r.text
    assert r.headers["spool-skipped-tools"] == "web_search, image_generation, file_search, mcp"
    response = check_response(r.json())
    assert [t.type for t in response.tools] == ["web_search", "image_generation", "file_search", "mcp", "namespace"]
    plain = httpx.post(server.url + "/v1/responses", json={**body, "tools": [CRM]}, timeout=60)
    assert "spool-skipped-tools" not in plain.headers
    assert plain.json()["usage"]["input_tokens"] == r.json()["usage"]["input_tokens"]  # left out of the prompt


def namespace_call(server, stream: bool) -> tuple[dict, int]:
    """A call forced by the tool's qualified name: its function_call item, and the prompt's size."""
    body = {"model": MODEL, "input": "Find the customer Ada.", "tools": [CRM], "store": False, "temperature": 0,
            "tool_choice": {"type": "function", "name": "crm__lookup"}, "max_output_tokens": 60, "stream": stream}
    if not stream:
        response = httpx.post(server.url + "/v1/responses", json=body, timeout=60).json()
        check_response(response)
    else:
        with httpx.stream("POST", server.url + "/v1/responses", json=body, timeout=60) as r:
            payloads = events(r)
        done = next(p for p in payloads if p["type"] == "response.function_call_arguments.done")
        assert done["name"] == "lookup"
        response = check_response(payloads[-1]["response"]).model_dump(exclude_none=True)
    (call,) = response["output"]
    return call, response["usage"]["input_tokens"]


@pytest.mark.parametrize("stream", [False, True], ids=["create", "stream"])
def test_a_namespace_tool_call_round_trip(server, stream):
    call, _ = namespace_call(server, stream)
    assert call["type"] == "function_call" and (call["namespace"], call["name"]) == ("crm", "lookup")
    assert set(json.loads(call["arguments"])) == {"name"}
    asked = {"role": "user", "content": "Find the customer Ada."}
    result = {"type": "function_call_output", "call_id": call["call_id"], "output": "Ada Lovelace, London, since 1843"}
    second = httpx.post(server.url + "/v1/responses", timeout=60, json={
        "model": MODEL, "input": [asked, call, result], "tools": [CRM], "store": False, "max_output_tokens": 8})
    assert second.status_code == 200, second.text
    # the same conversation as a chat: the call under its qualified name, the output as the tool's answer
    lookup = {"name": "crm__lookup", "description": "Find a customer by name\n\n(crm: The customer records.)",
              "parameters": CRM["tools"][0]["parameters"]}
    called = {"id": call["call_id"], "type": "function",
              "function": {"name": "crm__lookup", "arguments": call["arguments"]}}
    chat = {"messages": [asked, {"role": "assistant", "content": "", "tool_calls": [called]},
                         {"role": "tool", "tool_call_id": call["call_id"], "content": result["output"]}],
        "tools": [{"type": "function", "function": lookup}]}
    rendered = httpx.post(server.url + "/tokenize", json=chat, timeout=60).json()
    assert second.json()["usage"]["input_tokens"] == rendered["count"]


def custom_call(server, body: dict) -> tuple[list[dict], dict]:
    with httpx.stream("POST", server.url + "/v1/responses", json={**body, "stream": True}, timeout=60) as r:
        payloads = events(r)
    response = check_response(payloads[-1]["response"]).model_dump(exclude_none=True)
    return payloads, response


def test_a_custom_tools_grammar_holds_its_input(server):
    body = {"model": MODEL, "input": "List the names of all users.", "tools": [QUERY], "temperature": 0,
            "tool_choice": {"type": "custom", "name": "run_sql"}, "max_output_tokens": 60}
    payloads, response = custom_call(server, body)
    (call,) = response["output"]
    assert call["type"] == "custom_tool_call" and call["name"] == "run_sql" and call["id"].startswith("ctc_")
    assert re.fullmatch(r"SELECT [a-z]{1,10} FROM (users|orders);", call["input"]), call["input"]
    done = next(p for p in payloads if p["type"] == "response.custom_tool_call_input.done")
    assert done["input"] == call["input"]
    reply = httpx.post(server.url + "/v1/responses", json=body, timeout=60).json()
    assert [(i["type"], i["input"]) for i in reply["output"]] == [("custom_tool_call", call["input"])]
    # its output goes back as the tool's answer, the call as the model wrote it
    result = {"type": "custom_tool_call_output", "call_id": call["call_id"], "output": "ada, grace"}
    again = httpx.post(server.url + "/v1/responses", timeout=60, json={
        "model": MODEL, "input": [{"role": "user", "content": body["input"]}, call, result], "tools": [QUERY],
        "max_output_tokens": 4})
    assert again.status_code == 200 and again.json()["usage"]["input_tokens"] > reply["usage"]["input_tokens"]


def test_apply_patch_grammar_as_one_regex():
    (tool,) = [t for t in fixture("codex_first_gpt55")["tools"] if t["type"] == "custom"]
    pattern = lark_regex(tool["format"]["definition"])
    for patch in ["*** Begin Patch\n*** Add File: hello.txt\n+hi\n*** End Patch\n",
                  "*** Begin Patch\n*** Update File: a.py\n@@ def f\n-x\n+y\n keep\n*** End Patch",
                  "*** Begin Patch\n*** Delete File: old.txt\n*** End Patch\n"]:
        assert re.fullmatch(pattern, patch), patch
    for wrong in ["hello", "*** Begin Patch\n*** End Patch\n", "*** Begin Patch\n*** Add File: x\nhi\n*** End Patch\n"]:
        assert not re.fullmatch(pattern, wrong), wrong
    assert re.fullmatch(lark_regex('start: "a".."c" ~ 2..3 ["d"i] -> x'), "abD")
    for grammar in ['start: a\na: "x" a | "y"', 'start: "x"\n%ignore " "', 'start: "x"\n%import common.FOO']:
        with pytest.raises(NotRegular):
            lark_regex(grammar)


# -- codex exec itself -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def codex() -> Path:
    """Codex CLI from npm, the version the fixtures were recorded with."""
    return npm_cli(f"@openai/codex@{CODEX_VERSION}", "codex")


@pytest.mark.slow
def test_codex_exec_completes_a_turn(codex, agent_server, tmp_path):
    home, work = tmp_path / "codex-home", tmp_path / "project"
    home.mkdir()
    work.mkdir()
    (home / "config.toml").write_text(f"""model = "{AGENT}"
model_provider = "spool"
model_context_window = {CONTEXT}

[model_providers.spool]
name = "Spool"
base_url = "{agent_server.url}/v1"
wire_api = "responses"
""")
    answered = agent_server.output().count("POST /v1/responses 200")
    done = subprocess.run([str(codex), "exec", "--skip-git-repo-check", "Say hi."], cwd=work, capture_output=True,
                          text=True, timeout=300, stdin=subprocess.DEVNULL,
                          env={**os.environ, "CODEX_HOME": str(home), "NO_COLOR": "1"})
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert agent_server.output().count("POST /v1/responses 200") > answered
