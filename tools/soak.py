"""Soak a Spool server with thousands of mixed requests and check it keeps every promise.

    python tools/soak.py                       # starts its own server with a tiny KV pool, 2,000 requests
    python tools/soak.py --requests 500 --json soak.json
    python tools/soak.py --base-url http://127.0.0.1:8000   # an already running server

The mix, drawn from --seed: streamed (SSE), non-streamed and WebSocket generations; 30% of
them cut at a random moment (before the answer, or after a few chunks); 10% invalid bodies,
which must get a 4xx (an error frame on the WebSocket); 2% clients that read their stream
slowly. The server it starts has a KV pool small enough that requests are preempted.

At the end it checks, and exits 1 if any check fails:
- nothing running and nothing waiting, and KV usage back at idle (0);
- no error on any valid request that was not cut (each ends with stop or length, within
  max_tokens);
- the server's resident memory grew less than 10% from the first quarter of the run to the
  last (the means of /metrics' process_resident_memory_bytes samples);
- a fixed set of greedy requests returns exactly what it returned before the soak.
"""

import argparse
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from loadtest import metric_values  # tools/ is on the path when this runs as a script

ROOT = Path(__file__).resolve().parent.parent
GREEDY_PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, a small robot",
                  "The three primary colours are"]
TOPICS = ["the sea", "a city at night", "prime numbers", "coffee", "a lost key", "mountains", "trains", "bread"]


@dataclass
class Outcome:
    kind: str  # sse, plain, ws, invalid
    cut: bool = False
    slow: bool = False
    ok: bool = False
    detail: str = ""


@dataclass
class Soak:
    base: str
    model: str
    rng: random.Random
    outcomes: list[Outcome] = field(default_factory=list)
    rss: list[tuple[int, float]] = field(default_factory=list)  # (requests finished, bytes)


def body(soak: Soak, chat: bool, stream: bool) -> dict:
    r = soak.rng
    prompt = f"Write {r.choice(['a short poem', 'two sentences', 'a list', 'a story'])} about {r.choice(TOPICS)}."
    b = {"model": soak.model, "max_tokens": r.randint(4, 64), "temperature": r.choice([0.0, 0.7, 1.0]),
         "seed": r.randrange(1000)}
    if chat:
        b["messages"] = [{"role": "user", "content": prompt}]
    else:
        b["prompt"] = prompt * r.randint(1, 3)
    if stream:
        b.update(stream=True, stream_options={"include_usage": True})
    return b


INVALID = [  # (path, body): each must be refused with a 4xx
    ("/v1/completions", b"{not json"),
    ("/v1/completions", {"prompt": "x", "max_tokens": "ten"}),
    ("/v1/chat/completions", {"messages": []}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "temperature": -1}),
    ("/v1/completions", {"prompt": "x", "max_tokens": 10 ** 9}),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"99999999": 1}}),
    ("/v1/completions", {"model": "no-such-model", "prompt": "x"}),
    ("/v1/chat/completions", {"messages": "hello", "stream": True}),
]


def check_final(outcome: Outcome, finish_reason, usage, max_tokens: int) -> None:
    if finish_reason not in ("stop", "length"):
        outcome.detail = f"finish_reason {finish_reason!r}"
    elif not usage or not 0 <= usage.get("completion_tokens", -1) <= max_tokens:
        outcome.detail = f"usage {usage!r} for max_tokens {max_tokens}"
    else:
        outcome.ok = True


async def sse(soak: Soak, client, outcome: Outcome, chat: bool) -> None:
    import trio

    b = body(soak, chat, stream=True)
    path = "/v1/chat/completions" if chat else "/v1/completions"
    cut_after = soak.rng.randint(0, 4) if outcome.cut else None
    finish, usage, events = None, None, 0
    async with client.stream("POST", soak.base + path, json=b) as resp:
        if resp.status_code != 200:
            outcome.detail = f"HTTP {resp.status_code}"
            return
        async for line in resp.aiter_lines():
            if not line.startswith("data:"):
                continue
            if cut_after is not None and events >= cut_after:
                return  # leaving the block closes the connection mid-stream
            events += 1
            if outcome.slow:
                await trio.sleep(0.15)
            data = line[5:].strip()
            if data == "[DONE]":
                check_final(outcome, finish, usage, b["max_tokens"])
                return
            chunk = json.loads(data)
            usage = chunk.get("usage") or usage
            for choice in chunk.get("choices") or []:
                finish = choice.get("finish_reason") or finish
    if cut_after is None:
        outcome.detail = "the stream ended without [DONE]"


async def plain(soak: Soak, client, outcome: Outcome, chat: bool) -> None:
    import trio

    b = body(soak, chat, stream=False)
    path = "/v1/chat/completions" if chat else "/v1/completions"
    if outcome.cut:
        with trio.move_on_after(soak.rng.uniform(0.0, 0.5)):  # cancelled mid-request: the socket closes
            await client.post(soak.base + path, json=b)
        return
    resp = await client.post(soak.base + path, json=b)
    if resp.status_code != 200:
        outcome.detail = f"HTTP {resp.status_code}"
        return
    reply = resp.json()
    check_final(outcome, reply["choices"][0]["finish_reason"], reply.get("usage"), b["max_tokens"])


async def ws(soak: Soak, outcome: Outcome) -> None:
    import trio_websocket

    b = body(soak, chat=soak.rng.random() < 0.5, stream=False)
    cut_after = soak.rng.randint(0, 4) if outcome.cut else None
    async with trio_websocket.open_websocket_url("ws" + soak.base.removeprefix("http") + "/v1/ws") as sock:
        await sock.send_message(json.dumps({"type": "generate", "id": "g", **b}))
        deltas = 0
        while True:
            frame = json.loads(await sock.get_message())
            if cut_after is not None and deltas >= cut_after:
                return  # closing the socket cancels the generation
            if frame["type"] == "delta":
                deltas += 1
            elif frame["type"] == "done":
                choice = frame["choices"][0]
                check_final(outcome, choice["finish_reason"], frame.get("usage"), b["max_tokens"])
                return
            else:
                outcome.detail = f"error frame {frame.get('error')}"
                return


async def invalid(soak: Soak, client, outcome: Outcome) -> None:
    if soak.rng.random() < 0.2:  # the WebSocket's own kind of bad input: the socket stays open
        import trio_websocket

        async with trio_websocket.open_websocket_url("ws" + soak.base.removeprefix("http") + "/v1/ws") as sock:
            await sock.send_message(json.dumps({"type": "generate", "id": "bad", "messages": "nope"}))
            frame = json.loads(await sock.get_message())
            outcome.ok = frame["type"] == "error" and (frame.get("error") or {}).get("type") == "invalid_request_error"
            outcome.detail = "" if outcome.ok else f"got {frame}"
            return
    path, b = soak.rng.choice(INVALID)
    if isinstance(b, dict):
        b = {"model": soak.model, **b}
    resp = await client.post(soak.base + path, content=b if isinstance(b, bytes) else json.dumps(b).encode(),
                             headers={"content-type": "application/json"})
    outcome.ok = 400 <= resp.status_code < 500
    outcome.detail = "" if outcome.ok else f"HTTP {resp.status_code} for {b!r:.80}"


async def greedy_set(soak: Soak, client) -> list[str]:
    texts = []
    for prompt in GREEDY_PROMPTS:
        resp = await client.post(soak.base + "/v1/completions",
                                 json={"model": soak.model, "prompt": prompt, "max_tokens": 24, "temperature": 0})
        resp.raise_for_status()
        texts.append(resp.json()["choices"][0]["text"])
    return texts


async def metrics(soak: Soak, client) -> dict[str, float]:
    resp = await client.get(soak.base + "/metrics")
    resp.raise_for_status()
    return metric_values(resp.text)


async def watch_memory(soak: Soak, client, finished: list) -> None:
    import trio

    while True:
        values = await metrics(soak, client)
        if "process_resident_memory_bytes" in values:
            soak.rss.append((finished[0], values["process_resident_memory_bytes"]))
        await trio.sleep(0.5)


async def run(args) -> dict:
    import httpx
    import trio
    from tqdm import tqdm

    limits = httpx.Limits(max_keepalive_connections=0)
    async with httpx.AsyncClient(timeout=120, limits=limits) as client:
        models = (await client.get(args.base_url + "/v1/models")).json()
        soak = Soak(args.base_url, models["data"][0]["id"], random.Random(args.seed))
        before = await greedy_set(soak, client)
        plan = []
        for n in range(args.requests):
            if n % 50 == 25:  # 2%: a client that reads its stream slowly, to the end
                plan.append(Outcome("sse", slow=True))
            elif soak.rng.random() < 0.10:
                plan.append(Outcome("invalid"))
            else:  # 30% of all requests are cut
                plan.append(Outcome(soak.rng.choice(["sse", "sse", "plain", "ws"]), cut=soak.rng.random() < 0.30 / 0.88))
        finished = [0]
        progress = tqdm(total=len(plan), unit="req", disable=args.quiet or None, file=sys.stderr)
        queue = iter(plan)

        async def worker():
            for outcome in queue:
                try:
                    if outcome.kind == "invalid":
                        await invalid(soak, client, outcome)
                    elif outcome.kind == "ws":
                        await ws(soak, outcome)
                    elif outcome.kind == "sse":
                        await sse(soak, client, outcome, chat=soak.rng.random() < 0.5)
                    else:
                        await plain(soak, client, outcome, chat=soak.rng.random() < 0.5)
                except Exception as e:  # a valid request that was not cut must not fail at all
                    if not outcome.cut:
                        outcome.detail = f"{type(e).__name__}: {e}"
                soak.outcomes.append(outcome)
                finished[0] += 1
                progress.update(1)

        started = time.monotonic()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(watch_memory, soak, client, finished)
            async with trio.open_nursery() as workers:
                for _ in range(args.concurrency):
                    workers.start_soon(worker)
            nursery.cancel_scope.cancel()
        elapsed = time.monotonic() - started
        progress.close()
        with trio.move_on_after(60):  # cut requests end at the server's next step
            while True:
                m = await metrics(soak, client)
                if m.get("spool:num_requests_running", 1) == 0 and m.get("spool:num_requests_waiting", 1) == 0:
                    break
                await trio.sleep(0.2)
        m = await metrics(soak, client)
        after = await greedy_set(soak, client)
    return report(soak, before, after, m, elapsed)


def report(soak: Soak, before, after, m: dict, elapsed: float) -> dict:
    valid = [o for o in soak.outcomes if o.kind != "invalid" and not o.cut]
    invalid = [o for o in soak.outcomes if o.kind == "invalid"]
    quarter = max(1, len(soak.outcomes) // 4)
    first = [b for n, b in soak.rss if n <= quarter]
    last = [b for n, b in soak.rss if n >= len(soak.outcomes) - quarter]
    growth = (sum(last) / len(last)) / (sum(first) / len(first)) - 1 if first and last else None
    checks = {
        "idle: nothing running or waiting": m.get("spool:num_requests_running") == 0
        and m.get("spool:num_requests_waiting") == 0,
        "idle: KV usage back to 0": m.get("spool:kv_cache_usage_perc") == 0,
        "every valid request that was not cut succeeded": all(o.ok for o in valid),
        "every invalid request got a 4xx": all(o.ok for o in invalid),
        "resident memory grew < 10% from the first quarter to the last": growth is not None and growth < 0.10,
        "greedy requests answer as before the soak": before == after,
    }
    failures = [f"{o.kind}{' (slow)' if o.slow else ''}: {o.detail}" for o in soak.outcomes
                if not o.ok and (o.kind == "invalid" or not o.cut)]
    return {
        "passed": all(checks.values()),
        "checks": checks,
        "requests": len(soak.outcomes), "seconds": round(elapsed, 1),
        "by_kind": {k: sum(o.kind == k for o in soak.outcomes) for k in ("sse", "plain", "ws", "invalid")},
        "cut": sum(o.cut for o in soak.outcomes), "slow": sum(o.slow for o in soak.outcomes),
        "preemptions": m.get("spool:num_preemptions_total", 0.0),
        "rss_mib_first_quarter": round(sum(first) / len(first) / 2 ** 20, 1) if first else None,
        "rss_mib_last_quarter": round(sum(last) / len(last) / 2 ** 20, 1) if last else None,
        "rss_growth": growth,
        "failures": failures[:20],
    }


def start_server(args) -> tuple[subprocess.Popen, str]:
    """Spool on a free port with a KV pool small enough that requests are preempted."""
    import httpx

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = open(Path(os.environ.get("TMPDIR", "/tmp")) / f"spool-soak-{port}.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "app", "serve", "--port", str(port), "--kv-cache-gib",
                             str(args.kv_cache_gib), "--max-seqs", "16", *args.server_args],
                            cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    proc.kill()
    raise SystemExit(f"error: the server did not come up; see {log.name}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=2000, help="(default: 2000)")
    p.add_argument("--concurrency", type=int, default=16, help="clients at once (default: 16)")
    p.add_argument("--base-url", default=None, help="an already running server (default: start one)")
    p.add_argument("--kv-cache-gib", type=float, default=0.015,
                   help="the started server's KV pool, small enough to preempt (default: 0.015)")
    p.add_argument("--server-args", nargs=argparse.REMAINDER, default=[], help="more flags for the started server")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="write the report here too")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    args = p.parse_args(argv)
    import trio

    proc = None
    if args.base_url is None:
        proc, args.base_url = start_server(args)
    try:
        result = trio.run(run, args)
    finally:
        if proc is not None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(60)
    print(json.dumps(result, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
