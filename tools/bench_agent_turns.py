"""Prefill of a coding agent's first and second turns against a running server: Claude Code's
recorded first request (tests/data/agents/claude_code_first.json, about 20k tokens of system
prompt and tool schemas), then its second turn, the conversation resent with the reply and the
next question, as Claude Code sends it. Each asks for one token, so its time is the prefill's.

Three timings, the prefix cache flushed before each cold one: the first turn cold, the second
turn after it (its prompt read from the cache but for the new tokens), and the second turn cold
(what it would cost without the cache). The median of --repeats rounds.

    python tools/make_model.py --shape tiny-32k --format hf --type f32 --out /tmp/tiny-32k
    python -m app serve --model /tmp/tiny-32k --served-model-name SmolLM2-135M-Instruct --max-model-len 32768 &
    python tools/bench_agent_turns.py --url http://127.0.0.1:8000
"""

import argparse
import json
import statistics
import time
from pathlib import Path

import httpx

RECORDED = Path(__file__).resolve().parent.parent / "tests" / "data" / "agents" / "claude_code_first.json"


def turns(recorded: dict, model: str | None) -> tuple[dict, dict]:
    """The first turn as recorded and the second as Claude Code resends it (its cache_control
    marker moved to the new question), each asking for one token."""
    first = {**recorded["body"], "stream": False, "max_tokens": 1, **({"model": model} if model else {})}
    reminder, said = first["messages"][0]["content"]
    resent = [{"role": "user", "content": [reminder, {"type": "text", "text": said["text"]}]}, first["messages"][1],
              {"role": "assistant", "content": [{"type": "text", "text": "hi"}]},
              {"role": "user", "content": [{"type": "text", "text": "and bye", "cache_control": {"type": "ephemeral"}}]}]
    return first, {**first, "messages": resent}


def timed(client: httpx.Client, path: str, headers: dict, body: dict) -> tuple[float, dict]:
    start = time.perf_counter()
    r = client.post(path, json=body, headers=headers)
    seconds = time.perf_counter() - start
    r.raise_for_status()
    return seconds, r.json()["usage"]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--model", default=None, help="the served name, in place of the recording's")
    p.add_argument("--repeats", type=int, default=3)
    a = p.parse_args(argv)
    recorded = json.loads(RECORDED.read_text())
    first, second = turns(recorded, a.model)
    runs = {"first turn, cold": [], "second turn, after the first": [], "second turn, cold": []}
    with httpx.Client(base_url=a.url, timeout=1800) as client:
        for _ in range(a.repeats):
            client.post("/flush_cache").raise_for_status()
            runs["first turn, cold"].append(timed(client, recorded["path"], recorded["headers"], first))
            runs["second turn, after the first"].append(timed(client, recorded["path"], recorded["headers"], second))
            client.post("/flush_cache").raise_for_status()
            runs["second turn, cold"].append(timed(client, recorded["path"], recorded["headers"], second))
    print("| turn | prompt tokens | read from cache | prefill + 1 token (s, median) |")
    print("| --- | ---: | ---: | ---: |")
    for name, results in runs.items():
        usage = results[-1][1]
        total = usage["input_tokens"] + usage["cache_read_input_tokens"]
        print(f"| {name} | {total} | {usage['cache_read_input_tokens']} |"
              f" {statistics.median(s for s, _ in results):.3f} |")


if __name__ == "__main__":
    main()
