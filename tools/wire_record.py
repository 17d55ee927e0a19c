"""Record what a Spool server sends on the wire for every route, so a refactor can show that
the bytes did not change (tests/test_wire_bytes.py holds the recording and checks it).

    python tools/wire_record.py --url http://127.0.0.1:8000 --out wire.json
    python tools/wire_record.py --url http://127.0.0.1:8000 --compare tests/data/wire_bytes/avx512-vnni512.json

Every request is sent one at a time, greedy or seeded, to a freshly started server with the
default model (the order matters: the prefix cache's hits are part of the usage). What is
kept: the status, the headers but Date, and the body's bytes. Only what cannot repeat is
blanked, keeping its length so Content-Length still holds: the "created" clocks and the
Responses API's random ids. A body over 16 KiB is kept as its length and SHA-256, and paths
under the home folder start with ~. A recording names the CPU path it was made on (cpu_path):
the numbers the kernels compute are that path's, so each path has its own.
"""

import argparse
import hashlib
import json
import re
import sys
from pathlib import Path

import httpx
import trio
from trio_websocket import open_websocket_url

MODEL = "SmolLM2-135M-Instruct"
USER = [{"role": "user", "content": "Name three colors."}]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
WEATHER_ANTHROPIC = {"name": "get_weather", "description": "The weather in a city.",
                     "input_schema": WEATHER["function"]["parameters"]}
WEATHER_RESPONSES = {"type": "function", "name": "get_weather", "description": "The weather in a city.",
                     "parameters": WEATHER["function"]["parameters"]}
COLORS = {"type": "json_schema", "json_schema": {"name": "colors", "schema": {
    "type": "object", "properties": {"colors": {"type": "array", "items": {"type": "string"}, "maxItems": 3}},
    "required": ["colors"]}}}

# name, method, path, JSON body (or raw bytes with a content type): in the order they are sent
HTTP_CASES = [
    ("health", "GET", "/health", None),
    ("models", "GET", "/v1/models", None),
    ("model", "GET", f"/v1/models/{MODEL}", None),
    ("model unknown", "GET", "/v1/models/nope", None),
    ("chat", "POST", "/v1/chat/completions", {"messages": USER, "max_tokens": 8, "temperature": 0}),
    ("chat n=2 seeded logprobs", "POST", "/v1/chat/completions",
     {"messages": USER, "max_tokens": 6, "n": 2, "seed": 7, "temperature": 0.9, "logprobs": True, "top_logprobs": 2}),
    ("chat stream", "POST", "/v1/chat/completions",
     {"messages": USER, "max_tokens": 6, "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}),
    ("chat tool forced", "POST", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "Weather in Paris?"}], "tools": [WEATHER], "tool_choice": "required",
      "max_tokens": 40, "temperature": 0}),
    ("chat tool named stream", "POST", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "Weather in Oslo?"}], "tools": [WEATHER],
      "tool_choice": {"type": "function", "function": {"name": "get_weather"}}, "max_tokens": 40, "temperature": 0,
      "stream": True}),
    ("chat json schema", "POST", "/v1/chat/completions",
     {"messages": USER, "response_format": COLORS, "max_tokens": 30, "temperature": 0}),
    ("chat stop", "POST", "/v1/chat/completions",
     {"messages": USER, "max_tokens": 30, "temperature": 0, "stop": ["\n"], "ignore_eos": True}),
    ("completions", "POST", "/v1/completions",
     {"prompt": ["The sky is", "Once upon"], "max_tokens": 5, "temperature": 0, "logprobs": 1}),
    ("completions echo", "POST", "/v1/completions",
     {"prompt": "Two plus two", "max_tokens": 3, "temperature": 0, "echo": True}),
    ("completions stream", "POST", "/v1/completions",
     {"prompt": "The sky is", "max_tokens": 5, "temperature": 0, "stream": True}),
    ("embeddings", "POST", "/v1/embeddings", {"input": ["red", "green"], "encoding_format": "base64"}),
    ("messages", "POST", "/v1/messages",
     {"model": MODEL, "max_tokens": 8, "temperature": 0, "messages": USER}),
    ("messages stream", "POST", "/v1/messages",
     {"model": MODEL, "max_tokens": 6, "temperature": 0, "messages": USER, "system": "Be brief.", "stream": True}),
    ("messages tool stream", "POST", "/v1/messages",
     {"model": MODEL, "max_tokens": 40, "temperature": 0, "stream": True, "tools": [WEATHER_ANTHROPIC],
      "tool_choice": {"type": "any"}, "messages": [{"role": "user", "content": "Weather in Rome?"}]}),
    ("messages count_tokens", "POST", "/v1/messages/count_tokens", {"model": MODEL, "messages": USER}),
    ("messages error", "POST", "/v1/messages", {"model": MODEL, "messages": USER}),
    ("responses", "POST", "/v1/responses", {"model": MODEL, "input": "Name three colors.", "max_output_tokens": 8,
                                             "temperature": 0}),
    ("responses stream", "POST", "/v1/responses",
     {"model": MODEL, "input": "Name three colors.", "max_output_tokens": 6, "temperature": 0, "stream": True,
      "instructions": "Be brief."}),
    ("responses tool", "POST", "/v1/responses",
     {"model": MODEL, "input": "Weather in Lima?", "tools": [WEATHER_RESPONSES], "tool_choice": "required",
      "max_output_tokens": 40, "temperature": 0}),
    ("responses get", "GET", "/v1/responses/{last_response}", None),
    ("responses delete", "DELETE", "/v1/responses/{last_response}", None),
    ("responses get deleted", "GET", "/v1/responses/{last_response}", None),
    ("tokenize", "POST", "/tokenize", {"prompt": "Hello world"}),
    ("tokenize chat", "POST", "/tokenize", {"messages": USER}),
    ("detokenize", "POST", "/detokenize", {"tokens": [19556, 905]}),
    ("render chat", "POST", "/v1/chat/completions/render", {"messages": USER}),
    ("render completion", "POST", "/v1/completions/render", {"prompt": "Hi"}),
    ("openapi", "GET", "/openapi.json", None),
    ("model_info", "GET", "/model_info", None),
    ("get_load", "GET", "/get_load", None),
    ("error malformed json", "POST", "/v1/chat/completions", (b'{"messages": [', "application/json")),
    ("error not json", "POST", "/v1/chat/completions", (b"messages=hi", "application/x-www-form-urlencoded")),
    ("error bad field", "POST", "/v1/chat/completions", {"messages": USER, "max_tokens": -1}),
    ("error no messages", "POST", "/v1/chat/completions", {"max_tokens": 4}),
    ("error bad role", "POST", "/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}),
    ("error top_k", "POST", "/v1/completions", {"prompt": "x", "top_k": 2 ** 40}),
    ("error unknown route", "GET", "/v1/nothing", None),
    ("error wrong method", "GET", "/v1/chat/completions", None),
    ("page", "GET", "/", None),
    ("page script", "GET", "/ui/chat.js", None),
    ("metrics", "GET", "/metrics", None),
    ("flush_cache", "POST", "/flush_cache", None),
]
# frames sent on one socket, the replies read until each generation's done (or error) frame
WS_FRAMES = [
    {"type": "generate", "id": "g1", "messages": USER, "max_tokens": 6, "temperature": 0},
    {"type": "generate", "id": "g2", "prompt": "The sky is", "max_tokens": 4, "temperature": 0},
    {"type": "generate", "id": "g3", "messages": [{"role": "user", "content": "Weather in Kyiv?"}], "tools": [WEATHER],
     "tool_choice": "required", "max_tokens": 40, "temperature": 0},
    "not json",
    {"type": "generate", "id": "g4", "messages": USER, "max_tokens": -3},
    {"type": "cancel", "id": "nobody"},
]
CLOCKS = re.compile(rb'("(?:created|created_at|completed_at)":\s?)(\d+)')
RANDOM_IDS = re.compile(rb'\b(resp|msg|item|fc|call|toolu)_[0-9a-zA-Z]{8,}')
VARYING = {"metrics"}  # counts and timings: status and content type only
BIG = 16384
HOME = str(Path.home()).encode()


def blank(body: bytes) -> bytes:
    """Clocks to zeros and random ids to x's, each keeping its length; the home folder to ~."""
    body = body.replace(HOME, b"~")
    body = CLOCKS.sub(lambda m: m.group(1) + b"0" * len(m.group(2)), body)
    return RANDOM_IDS.sub(lambda m: m.group(1) + b"_" + b"x" * (len(m.group(0)) - len(m.group(1)) - 1), body)


def kept(name: str, body: bytes) -> str | dict:
    if name in VARYING:
        return {"bytes": "varies"}
    if len(body) > BIG:
        return {"bytes": len(body), "sha256": hashlib.sha256(body).hexdigest()}
    return body.decode("utf-8", "backslashreplace")


def record_http(client: httpx.Client) -> list[dict]:
    out, last_response = [], None
    for name, method, path, body in HTTP_CASES:
        if "{last_response}" in path:
            path = path.format(last_response=last_response)
        if isinstance(body, tuple):
            content, headers = body[0], {"content-type": body[1]}
        else:
            content = None if body is None else json.dumps(body).encode()
            headers = {} if body is None else {"content-type": "application/json"}
        with client.stream(method, path, content=content, headers=headers) as r:
            raw = r.read()
        if name.startswith("responses") and r.status_code == 200 and b'"id":"resp_' in raw:
            last_response = re.search(rb'"id":"(resp_[0-9a-zA-Z]+)"', raw).group(1).decode()
        out.append({"name": name, "status": r.status_code,
                    "headers": [[k, blank(v.encode()).decode()] for k, v in r.headers.items()
                                if k != "date" and not (name in VARYING and k == "content-length")],
                    "body": kept(name, blank(raw))})
    return out


async def record_ws(url: str) -> list[str]:
    frames = []
    async with open_websocket_url(url.replace("http", "ws", 1) + "/v1/ws") as ws:
        for frame in WS_FRAMES:
            await ws.send_message(frame if isinstance(frame, str) else json.dumps(frame))
            if isinstance(frame, dict) and frame["type"] == "cancel":
                continue  # an unknown id is ignored: nothing comes back
            while True:
                message = await ws.get_message()
                frames.append(blank(message.encode()).decode())
                if json.loads(message)["type"] in ("done", "error"):
                    break
    return frames


def cpu_path() -> str:
    """The CPU kernels' path on this machine (the server's, when it runs here), as a file name:
    another path sums in another order, so its logprobs and embeddings differ in their last
    digits, and a seeded draw near a tie may pick another token."""
    from model.quant import cpu

    return f"{cpu.PATH}-vnni{cpu.VNNI}" + ("-amx" if cpu.AMX else "")


def record(url: str) -> dict:
    with httpx.Client(base_url=url, timeout=120) as client:
        http = record_http(client)
    return {"cpu": cpu_path(), "http": http, "websocket": trio.run(record_ws, url)}


def differences(before: dict, after: dict) -> list[str]:
    """One line per case whose bytes differ."""
    lines = [f"http {a['name']}: {a} != {b}" for a, b in zip(before["http"], after["http"]) if a != b]
    if len(before["http"]) != len(after["http"]):
        lines.append(f"http: {len(before['http'])} cases != {len(after['http'])}")
    if before["websocket"] != after["websocket"]:
        lines.append(f"websocket: {before['websocket']} != {after['websocket']}")
    return lines


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--out", help="write the recording here")
    p.add_argument("--compare", help="a recording to compare with; exit 1 if any bytes differ")
    args = p.parse_args()
    recording = record(args.url)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(recording, f, indent=1)
            f.write("\n")
    if args.compare:
        with open(args.compare) as f:
            lines = differences(json.load(f), recording)
        print("\n".join(lines) or "identical")
        return 1 if lines else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
