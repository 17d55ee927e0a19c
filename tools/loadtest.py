"""Load-test any OpenAI-compatible server (Spool, vLLM, SGLang, llama.cpp's server) over SSE, and
Spool over its WebSocket too, and report what `vllm bench serve` reports, defined the same way.

    python tools/loadtest.py --num-requests 200 --max-concurrency 16 --input-len 128 --output-len 128
    python tools/loadtest.py --request-rate 4 --duration 60 --slo ttft:500,tpot:50 --json out.json --plot out.png
    python tools/loadtest.py --dataset prompts.jsonl --endpoint chat --protocol ws

Definitions (vLLM's): TTFT is the time from sending a request to its first streamed content;
ITL the gap between consecutive content events (all requests' gaps pooled); TPOT per request
(latency - TTFT) / (output tokens - 1), over requests with more than one token; E2EL the
whole request. Throughputs divide by the benchmark's wall time. Goodput counts the requests
that meet every given SLO (TTFT, TPOT, E2EL in ms), per second. Output tokens come from the
server's usage when it sends one, else from tokenizing the text.

Workloads: random prompts of --input-len tokens (lengths drawn uniformly within --range-ratio),
built from random words and cut to length with the server's /tokenize and /detokenize (vLLM's
and Spool's shape, or llama.cpp's), or with a local tokenizer directory (--tokenizer); or a
JSONL file (--dataset) of {"prompt": ...} or {"messages": [...]}, each with an optional
"output_len". Arrivals are Poisson at --request-rate (inf: all at once), at most
--max-concurrency in flight, until --num-requests have been sent or --duration has passed.

One HTTP connection per request unless --keep-alive: llama.cpp's server closes a connection
after a stream without saying so, and a pooled connection then fails on its next use.
"""

import argparse
import ipaddress
import json
import math
import random
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from urllib.parse import urlparse

import numpy as np
from sse_stream import StreamError, events

# Running and waiting requests, by the metric names of each server family.
RUNNING_METRICS = ("spool:num_requests_running", "vllm:num_requests_running", "sglang:num_running_reqs",
                   "llamacpp:requests_processing")
WAITING_METRICS = ("spool:num_requests_waiting", "vllm:num_requests_waiting", "sglang:num_queue_reqs",
                   "llamacpp:requests_deferred")
PERCENTILES = (50, 90, 99)
WORDS = ("time year people way day man thing woman life child world school state family student group country"
         " problem hand part place case week company system program question work government number night"
         " point home water room mother area money story fact month lot right study book eye job word"
         " business issue side kind head house service friend father power hour game line end member law car"
         " city community name president team minute idea kid body information back parent face others level"
         " office door health person art war history party result change morning reason research girl guy"
         " moment air teacher force education").split()


@dataclass
class RequestResult:
    """One request as the client saw it; times in seconds from the benchmark's start."""

    ok: bool = False
    error: str = ""  # the kind: http_429, connect, timeout, disconnected, incomplete, ...
    prompt_len: int = 0
    max_tokens: int = 0  # asked for
    output_len: int = 0  # received
    start: float = 0.0
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    text: str = ""


# -- the arithmetic --------------------------------------------------------------------------


def distribution(values_s: list[float]) -> dict:
    """mean, median, std and percentiles, in milliseconds (np.percentile's linear interpolation,
    as vLLM)."""
    if not values_s:
        return {"mean": 0.0, "median": 0.0, "std": 0.0, **{f"p{p}": 0.0 for p in PERCENTILES}}
    ms = np.asarray(values_s, dtype=np.float64) * 1000
    return {"mean": float(ms.mean()), "median": float(np.median(ms)), "std": float(ms.std()),
            **{f"p{p}": float(np.percentile(ms, p)) for p in PERCENTILES}}


def tpot(r: RequestResult) -> float | None:
    return (r.latency - r.ttft) / (r.output_len - 1) if r.output_len > 1 else None


def summarize(results: list[RequestResult], duration_s: float, slo_ms: dict | None = None) -> dict:
    """The benchmark's numbers from its requests (the definitions are in the module docstring)."""
    done = [r for r in results if r.ok]
    errors: dict[str, int] = {}
    for r in results:
        if not r.ok:
            errors[r.error] = errors.get(r.error, 0) + 1
    tpots = [t for t in map(tpot, done) if t is not None]
    total_in, total_out = sum(r.prompt_len for r in done), sum(r.output_len for r in done)
    good = 0
    slo_ms = slo_ms or {}
    for r in done:
        measured = {"ttft": r.ttft * 1000, "tpot": (tpot(r) or 0.0) * 1000, "e2el": r.latency * 1000}
        good += all(measured[name] <= limit for name, limit in slo_ms.items())
    return {
        "duration_s": duration_s,
        "requests": len(results),
        "completed": len(done),
        "failed": len(results) - len(done),
        "errors": errors,
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "request_throughput": len(done) / duration_s if duration_s else 0.0,
        "output_throughput": total_out / duration_s if duration_s else 0.0,
        "total_token_throughput": (total_in + total_out) / duration_s if duration_s else 0.0,
        "goodput": good / duration_s if slo_ms and duration_s else None,
        "ttft_ms": distribution([r.ttft for r in done]),
        "tpot_ms": distribution(tpots),
        "itl_ms": distribution([gap for r in done for gap in r.itl]),
        "e2el_ms": distribution([r.latency for r in done]),
    }


def parse_slo(text: str | None) -> dict:
    """'ttft:500,tpot:50' -> {'ttft': 500.0, 'tpot': 50.0} (milliseconds)."""
    slo = {}
    for part in (text or "").split(","):
        if not part.strip():
            continue
        name, _, value = part.partition(":")
        name = name.strip().lower()
        if name not in ("ttft", "tpot", "e2el"):
            raise ValueError(f"--slo: unknown metric {name!r}; use ttft, tpot or e2el")
        try:
            slo[name] = float(value)
        except ValueError:
            raise ValueError(f"--slo: {part!r} needs a number of milliseconds, as ttft:500") from None
    return slo


def poisson_delays(count: int, rate: float, rng: random.Random) -> list[float]:
    """Gaps between arrivals: exponential with mean 1/rate; none at an infinite rate."""
    return [0.0 if math.isinf(rate) else rng.expovariate(rate) for _ in range(count)]


def input_lengths(count: int, length: int, ratio: float, rng: random.Random) -> list[int]:
    """Uniform in [length * (1 - ratio), length * (1 + ratio)], at least 1 (vLLM's --random-range-ratio)."""
    low, high = max(1, int(length * (1 - ratio))), max(1, int(length * (1 + ratio)))
    return [rng.randint(low, high) for _ in range(count)]


def metric_values(page: str) -> dict[str, float]:
    """Prometheus samples summed over their labels, by name."""
    values: dict[str, float] = {}
    for line in page.splitlines():
        if line and not line.startswith("#") and " " in line:
            key, value = line.rsplit(" ", 1)
            name = key.split("{", 1)[0]
            values[name] = values.get(name, 0.0) + float(value)
    return values


def parse_metrics(text: str) -> dict:
    """Running and waiting requests from a Prometheus page, whichever server family wrote it."""
    values = metric_values(text)
    found = {}
    for kind, names in (("running", RUNNING_METRICS), ("waiting", WAITING_METRICS)):
        present = [values[name] for name in names if name in values]
        if present:
            found[kind] = sum(present)
    return found


# -- the workload ----------------------------------------------------------------------------


@dataclass
class Item:
    """One request to send: a prompt (text, or chat messages) and how many tokens to ask for."""

    prompt: str | None
    messages: list | None
    prompt_len: int
    output_len: int


class Tokenizer:
    """Token counts and cuts: the server's /tokenize and /detokenize (vLLM's and Spool's shape,
    else llama.cpp's), or a local tokenizer.json."""

    def __init__(self, client, base: str, model: str, local_dir: str | None):
        self.client, self.base, self.model = client, base, model
        self.local = None
        self.shape = None  # "openai" ({"prompt"} -> {"tokens"}) or "llama.cpp" ({"content"} -> {"tokens"})
        if local_dir:
            from tokenizers import Tokenizer as HFTokenizer

            self.local = HFTokenizer.from_file(str(Path(local_dir) / "tokenizer.json"))

    async def encode(self, text: str) -> list[int]:
        if self.local:
            return self.local.encode(text, add_special_tokens=False).ids
        shapes = [self.shape] if self.shape else ["openai", "llama.cpp"]
        for shape in shapes:
            body = ({"model": self.model, "prompt": text, "add_special_tokens": False} if shape == "openai"
                    else {"content": text, "add_special": False})
            r = await self.client.post(self.base + "/tokenize", json=body)
            try:
                tokens = r.json().get("tokens") if r.status_code == 200 else None
            except (ValueError, AttributeError):  # not JSON, or not an object
                tokens = None
            if isinstance(tokens, list) and (tokens or not text or self.shape):  # a server that ignored the
                self.shape = shape                                                # body answers [] for text
                return [t if isinstance(t, int) else t["id"] for t in tokens]
        raise SystemExit(f"error: {self.base}/tokenize did not answer (status {r.status_code});"
                         " pass --tokenizer with a local tokenizer directory")

    async def decode(self, ids: list[int]) -> str:
        if self.local:
            return self.local.decode(ids)
        body = {"model": self.model, "tokens": ids} if self.shape == "openai" else {"tokens": ids}
        r = await self.client.post(self.base + "/detokenize", json=body)
        if r.status_code != 200:
            raise SystemExit(f"error: {self.base}/detokenize answered {r.status_code}; pass --tokenizer")
        return r.json().get("prompt", r.json().get("content", ""))


async def random_prompt(tokenizer: Tokenizer, length: int, rng: random.Random) -> tuple[str, int]:
    """Random words cut to `length` tokens; a random number first, so no two share a prefix."""
    text = str(rng.randrange(10 ** 9))
    for _ in range(8):
        text += " " + " ".join(rng.choice(WORDS) for _ in range(length))
        ids = await tokenizer.encode(text)
        if len(ids) >= length:
            break
    else:
        raise SystemExit(f"error: the tokenizer gave {len(ids)} tokens for {len(text)} characters of text")
    text = await tokenizer.decode(ids[:length])
    return text, len(await tokenizer.encode(text))


async def build_items(args, tokenizer: Tokenizer, count: int, rng: random.Random) -> list[Item]:
    if args.dataset:
        items = []
        for n, line in enumerate(Path(args.dataset).read_text().splitlines(), 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                prompt, messages = row.get("prompt"), row.get("messages")
                if (prompt is None) == (messages is None):
                    raise ValueError("give exactly one of prompt and messages")
            except (ValueError, AttributeError) as e:
                raise SystemExit(f"error: {args.dataset}:{n}: {e}") from None
            counted = prompt if prompt is not None else " ".join(str(m.get("content", "")) for m in messages)
            items.append(Item(prompt, messages, len(await tokenizer.encode(counted)),
                              int(row.get("output_len", args.output_len))))
        if not items:
            raise SystemExit(f"error: {args.dataset} holds no prompts")
        return [items[i % len(items)] for i in range(count)]
    lengths = input_lengths(count, args.input_len, args.range_ratio, rng)
    outputs = input_lengths(count, args.output_len, args.range_ratio, rng)
    items = []
    for length, output in zip(lengths, outputs):
        text, actual = await random_prompt(tokenizer, length, rng)
        items.append(Item(text, None, actual, output))
    return items


# -- the requests ----------------------------------------------------------------------------


def request_body(args, item: Item, stream: bool = True) -> dict:
    body = {"model": args.model, "max_tokens": item.output_len, "temperature": args.temperature}
    if args.endpoint == "chat":
        body["messages"] = item.messages or [{"role": "user", "content": item.prompt}]
    else:
        body["prompt"] = item.prompt if item.prompt is not None else item.messages[-1]["content"]
    if stream:
        body.update(stream=True, stream_options={"include_usage": True})
    if args.ignore_eos:
        body["ignore_eos"] = True
    return {**body, **(args.extra_body or {})}


class Timer:
    """Content events of one stream: TTFT at the first, ITL between the others."""

    def __init__(self, result: RequestResult):
        self.result, self.sent, self.last = result, time.perf_counter(), None
        self.chunks: list[str] = []

    def content(self, text: str) -> None:
        now = time.perf_counter()
        if self.last is None:
            self.result.ttft = now - self.sent
        else:
            self.result.itl.append(now - self.last)
        self.last = now
        self.chunks.append(text)

    async def finish(self, usage: dict | None, tokenizer: Tokenizer) -> None:
        r = self.result
        r.latency = time.perf_counter() - self.sent
        r.text = "".join(self.chunks)
        if self.last is None:
            r.ttft = r.latency
        if usage and usage.get("prompt_tokens"):
            r.prompt_len = usage["prompt_tokens"]
        r.output_len = usage["completion_tokens"] if usage and "completion_tokens" in usage \
            else len(await tokenizer.encode(r.text))
        r.ok = True


async def httpx_events(client, url: str, body: dict):
    """sse_stream.events' contract through httpx (https://, pooled connections)."""
    import httpx

    try:
        async with client.stream("POST", url, json=body) as resp:
            yield resp.status_code
            if resp.status_code != 200:
                return
            async for line in resp.aiter_lines():
                if line.startswith("data:"):
                    yield line[5:].strip()
    except httpx.TimeoutException:
        raise StreamError("timeout") from None
    except httpx.ConnectError:
        raise StreamError("connect") from None
    except (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError):
        raise StreamError("disconnected") from None


async def send_sse(client, args, item: Item, result: RequestResult, tokenizer: Tokenizer) -> None:
    path = "/v1/chat/completions" if args.endpoint == "chat" else "/v1/completions"
    url, body = args.base_url + path, request_body(args, item)
    lean = url.startswith("http://") and not args.keep_alive
    auth = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    stream = events(url, body, auth, args.timeout) if lean else httpx_events(client, url, body)
    timer, usage, finished = Timer(result), None, False
    try:
        status = await anext(stream)
        if status != 200:
            result.error = f"http_{status}"
            return
        async for data in stream:
            if data == "[DONE]":
                finished = True
                break
            chunk = json.loads(data)
            if chunk.get("error"):
                result.error = "stream_error"
                return
            usage = chunk.get("usage") or usage
            for choice in chunk.get("choices") or []:
                text = choice.get("text") if args.endpoint != "chat" else (choice.get("delta") or {}).get("content")
                if text:
                    timer.content(text)
                finished = finished or bool(choice.get("finish_reason"))
    except StreamError as e:
        result.error = str(e)
        return
    except json.JSONDecodeError:
        result.error = "bad_chunk"
        return
    finally:
        await stream.aclose()
    if not finished:
        result.error = "incomplete"
        return
    await timer.finish(usage, tokenizer)


async def send_whole(client, args, item: Item, result: RequestResult, tokenizer: Tokenizer) -> None:
    """--no-stream: the reply whole at its end, so the client reads nothing per token; its TTFT
    is the whole latency, and TPOT and ITL are not measured."""
    import httpx

    path = "/v1/chat/completions" if args.endpoint == "chat" else "/v1/completions"
    timer = Timer(result)
    try:
        resp = await client.post(args.base_url + path, json=request_body(args, item, stream=False))
    except httpx.TimeoutException:
        result.error = "timeout"
        return
    except httpx.ConnectError:
        result.error = "connect"
        return
    except (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError):
        result.error = "disconnected"
        return
    if resp.status_code != 200:
        result.error = f"http_{resp.status_code}"
        return
    reply = resp.json()
    timer.chunks = [c.get("text") or (c.get("message") or {}).get("content") or "" for c in reply.get("choices") or []]
    await timer.finish(reply.get("usage"), tokenizer)


async def send_ws(args, item: Item, result: RequestResult, tokenizer: Tokenizer) -> None:
    """Spool's /v1/ws: one generate frame, deltas, then done (or error)."""
    import trio_websocket

    url = "ws" + args.base_url.removeprefix("http") + "/v1/ws"
    headers = [("Authorization", f"Bearer {args.api_key}")] if args.api_key else None
    timer = Timer(result)
    try:
        async with trio_websocket.open_websocket_url(url, extra_headers=headers) as ws:
            body = request_body(args, item, stream=False)
            await ws.send_message(json.dumps({"type": "generate", "id": "g", **body}))
            while True:
                frame = json.loads(await ws.get_message())
                if frame["type"] == "delta" and frame.get("text"):
                    timer.content(frame["text"])
                elif frame["type"] == "done":
                    await timer.finish(frame.get("usage"), tokenizer)
                    return
                elif frame["type"] == "error":
                    error = frame.get("error") or {}
                    result.error = f"ws_{error.get('code') or error.get('type') or 'error'}"
                    return
    except trio_websocket.HandshakeError:
        result.error = "ws_handshake"
    except trio_websocket.ConnectionClosed:
        result.error = "disconnected"
    except OSError:
        result.error = "connect"


# -- the run ---------------------------------------------------------------------------------


async def scrape(client, base: str, t0: float, timeline: list, every: float = 0.5) -> None:
    """Running and waiting requests over time, from /metrics, until cancelled."""
    import trio

    while True:
        try:
            r = await client.get(base + "/metrics")
        except Exception:  # the server's metrics are a bonus: a failed scrape is skipped
            r = None
        if r is not None and r.status_code == 404:
            return
        if r is not None and r.status_code == 200:
            found = parse_metrics(r.text)
            if found:
                timeline.append({"t": time.perf_counter() - t0, **found})
        await trio.sleep(every)


async def run(args) -> dict:
    import httpx
    import trio
    from tqdm import tqdm

    rng = random.Random(args.seed)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_keepalive_connections=None if args.keep_alive else 0, max_connections=None)
    timeout = httpx.Timeout(args.timeout, connect=30)
    async with httpx.AsyncClient(headers=headers, limits=limits, timeout=timeout) as client, \
            httpx.AsyncClient(headers=headers, timeout=30) as control:
        if not args.model:
            r = await control.get(args.base_url + "/v1/models")
            if r.status_code != 200:
                raise SystemExit(f"error: {args.base_url}/v1/models answered {r.status_code}; pass --model")
            args.model = r.json()["data"][0]["id"]
        tokenizer = Tokenizer(control, args.base_url, args.model, args.tokenizer)
        count = args.num_requests or (math.ceil(args.request_rate * args.duration * 1.2) + 16
                                      if math.isfinite(args.request_rate) else 512)
        items = await build_items(args, tokenizer, count, rng)
        delays = poisson_delays(len(items), args.request_rate, rng)
        results: list[RequestResult] = []
        timeline: list[dict] = []
        slots = trio.Semaphore(args.max_concurrency or len(items))
        progress = tqdm(total=args.num_requests or None, unit="req", disable=args.quiet or None, file=sys.stderr)

        async def one(item: Item, result: RequestResult) -> None:
            try:
                if args.protocol == "ws":
                    await send_ws(args, item, result, tokenizer)
                elif args.no_stream:
                    await send_whole(client, args, item, result, tokenizer)
                else:
                    await send_sse(client, args, item, result, tokenizer)
            finally:
                slots.release()
                progress.update(1)

        t0 = time.perf_counter()
        async with trio.open_nursery() as outer:
            if args.metrics_every > 0:
                outer.start_soon(scrape, control, args.base_url, t0, timeline, args.metrics_every)
            async with trio.open_nursery() as requests:
                for n, (item, delay) in enumerate(zip(items, delays)):
                    if args.num_requests and n >= args.num_requests:
                        break
                    await trio.sleep(delay)
                    if args.duration and time.perf_counter() - t0 >= args.duration:
                        break
                    await slots.acquire()
                    result = RequestResult(prompt_len=item.prompt_len, max_tokens=item.output_len,
                                           start=time.perf_counter() - t0)
                    results.append(result)
                    requests.start_soon(one, item, result)
            duration = time.perf_counter() - t0
            outer.cancel_scope.cancel()
        progress.close()
    summary = summarize(results, duration, parse_slo(args.slo))
    return {"config": {k: v for k, v in vars(args).items() if k not in ("api_key", "json", "plot")},
            "summary": summary, "requests": [{k: v for k, v in asdict(r).items() if k != "text"} for r in results],
            "timeline": timeline}


def table(summary: dict) -> str:
    s = summary
    rows = [("Successful requests", s["completed"]), ("Failed requests", s["failed"])]
    rows += [(f"  {kind}", n) for kind, n in sorted(s["errors"].items())]
    rows += [("Benchmark duration (s)", f"{s['duration_s']:.2f}"), ("Total input tokens", s["total_input_tokens"]),
             ("Total generated tokens", s["total_output_tokens"]),
             ("Request throughput (req/s)", f"{s['request_throughput']:.2f}"),
             ("Output token throughput (tok/s)", f"{s['output_throughput']:.2f}"),
             ("Total token throughput (tok/s)", f"{s['total_token_throughput']:.2f}")]
    if s["goodput"] is not None:
        rows.append(("Request goodput (req/s)", f"{s['goodput']:.2f}"))
    for key, title in (("ttft_ms", "Time to First Token"), ("tpot_ms", "Time per Output Token (excl. 1st token)"),
                       ("itl_ms", "Inter-token Latency"), ("e2el_ms", "End-to-end Latency")):
        rows.append((f"-- {title} --", ""))
        short = key.split("_")[0].upper()
        rows += [(f"{stat.capitalize() if stat in ('mean', 'median') else stat.upper()} {short} (ms)", f"{v:.2f}")
                 for stat, v in s[key].items() if stat not in ("std", "p50")]
    width = 44
    return "\n".join([" Serving Benchmark Result ".center(width + 12, "="),
                      *(f"{name:<{width}}{value:>12}" if value != "" else name.center(width + 12, "-")
                        for name, value in rows), "=" * (width + 12)])


def plot(reports: list[tuple[str, dict]], path: str) -> None:
    """Latency CDFs, output throughput over time, and running/waiting requests over time; one
    line per report, so runs can be compared in one picture."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SystemExit("error: --plot needs matplotlib (pip install matplotlib)") from None
    fig, axes = plt.subplots(2, 3, figsize=(16, 9))
    for i, (label, report) in enumerate(reports):
        color = f"C{i}"  # one colour per report in every panel
        done = [r for r in report["requests"] if r["ok"]]
        series = {"TTFT": [r["ttft"] for r in done],
                  "TPOT": [(r["latency"] - r["ttft"]) / (r["output_len"] - 1) for r in done if r["output_len"] > 1],
                  "ITL": [g for r in done for g in r["itl"]], "E2E latency": [r["latency"] for r in done]}
        for ax, (name, values) in zip(axes.flat, series.items()):
            if values:
                ms = np.sort(np.asarray(values) * 1000)
                ax.plot(ms, np.arange(1, len(ms) + 1) / len(ms), color=color, label=label)
            ax.set(title=f"{name} CDF", xlabel="ms", ylabel="fraction of requests" if name != "ITL" else "fraction")
            if name == "ITL":
                ax.set_xscale("log")  # a few long gaps (prefills in between) would hide the rest
        events = []  # (time, tokens) of every streamed event, a request's tokens spread over its events
        for r in done:
            times = r["start"] + r["ttft"] + np.concatenate([[0.0], np.cumsum(r["itl"])])
            events += [(t, r["output_len"] / len(times)) for t in times]
        if events:
            t, tokens = np.asarray(events).T
            edges = np.arange(0, math.ceil(t.max()) + 1)
            per_second, _ = np.histogram(t, bins=edges, weights=tokens)
            axes[1, 1].plot(edges[:-1], per_second, drawstyle="steps-post", color=color, label=label)
        axes[1, 1].set(title="output throughput", xlabel="s", ylabel="tokens/s")
        if report["timeline"]:
            t = [p["t"] for p in report["timeline"]]
            axes[1, 2].plot(t, [p.get("running", 0) for p in report["timeline"]], color=color, label=f"{label}: running")
            axes[1, 2].plot(t, [p.get("waiting", 0) for p in report["timeline"]], "--", color=color,
                            label=f"{label}: waiting")
        axes[1, 2].set(title="requests at the server (/metrics)", xlabel="s")
    for ax in axes.flat:
        if ax.lines:
            ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def check_target(url: str, allow_remote: bool) -> None:
    parsed = urlparse(url)
    if parsed.scheme not in ("http", "https") or not parsed.hostname:
        raise SystemExit(f"error: --base-url {url!r} is not an http(s) URL")
    host = parsed.hostname
    try:
        loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = False
    if not loopback and not allow_remote:
        raise SystemExit(f"error: {host} is not this machine; load-testing another host needs --allow-remote")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    a = p.add_argument
    a("--base-url", default="http://127.0.0.1:8000", help="the server (default: http://127.0.0.1:8000)")
    a("--model", default=None, help="the model name to send (default: the server's first in /v1/models)")
    a("--api-key", default=None, help="sent as 'Authorization: Bearer KEY'")
    a("--num-requests", type=int, default=None, help="requests to send (default: 100, or unbounded with --duration)")
    a("--max-concurrency", type=int, default=None, help="most requests in flight (default: no limit)")
    a("--request-rate", type=float, default=math.inf, help="Poisson arrivals per second (default: inf, all at once)")
    a("--duration", type=float, default=None, help="stop sending new requests after this many seconds")
    a("--input-len", type=int, default=128, help="prompt tokens of the random workload (default: 128)")
    a("--output-len", type=int, default=128, help="max_tokens asked for (default: 128)")
    a("--range-ratio", type=float, default=0.0, help="lengths uniform in len * [1 - r, 1 + r] (default: 0)")
    a("--dataset", default=None, help="JSONL of {\"prompt\"} or {\"messages\"}, optional \"output_len\"")
    a("--endpoint", choices=("completions", "chat"), default="completions", help="(default: completions)")
    a("--ignore-eos", action="store_true", help="ask the server to generate all max_tokens")
    a("--temperature", type=float, default=0.0, help="(default: 0, greedy)")
    a("--protocol", choices=("sse", "ws"), default="sse", help="ws: Spool's /v1/ws (default: sse)")
    a("--keep-alive", action="store_true", help="reuse HTTP connections (default: one per request)")
    a("--no-stream", action="store_true",
      help="ask for whole replies: the client reads nothing per token (TTFT is then the whole latency; no TPOT)")
    a("--extra-body", default=None, metavar="JSON",
      help="fields merged into every request, as '{\"response_format\": {\"type\": \"json_object\"}}'")
    a("--tokenizer", default=None, help="a local tokenizer directory, for servers without /tokenize")
    a("--seed", type=int, default=0, help="workload and arrival seed (default: 0)")
    a("--slo", default=None, help="goodput targets in ms, as ttft:500,tpot:50[,e2el:MS]")
    a("--timeout", type=float, default=600.0, help="seconds a request may take (default: 600)")
    a("--metrics-every", type=float, default=0.5, metavar="SECONDS",
      help="read the server's /metrics this often for the timeline; 0: never, so a small machine's server spends"
           " nothing on it (default: 0.5)")
    a("--json", default=None, help="write the config, summary, every request and the /metrics timeline")
    a("--plot", default=None, help="write a PNG: latency CDFs, throughput and server queue over time")
    a("--compare", nargs="+", metavar="JSON", default=None,
      help="plot earlier --json reports together (with --plot) instead of running")
    a("--allow-remote", action="store_true", help="allow a --base-url that is not this machine")
    a("--quiet", action="store_true", help="no progress bar")
    args = p.parse_args(argv)
    if args.num_requests is None and args.duration is None:
        args.num_requests = 100
    for name in ("num_requests", "max_concurrency", "input_len", "output_len"):
        value = getattr(args, name)
        if value is not None and value < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.no_stream and args.protocol == "ws":
        p.error("--no-stream is for SSE's endpoints; the WebSocket always streams")
    if not args.request_rate > 0 or not 0 <= args.range_ratio < 1:
        p.error("--request-rate must be positive and --range-ratio in [0, 1)")
    try:
        parse_slo(args.slo)
    except ValueError as e:
        p.error(str(e))
    try:
        args.extra_body = json.loads(args.extra_body) if args.extra_body else None
    except ValueError as e:
        p.error(f"--extra-body is not JSON: {e}")
    if args.extra_body is not None and not isinstance(args.extra_body, dict):
        p.error("--extra-body must be a JSON object")
    args.base_url = args.base_url.rstrip("/")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.compare:
        if not args.plot:
            raise SystemExit("error: --compare needs --plot")
        plot([(Path(f).stem, json.loads(Path(f).read_text())) for f in args.compare], args.plot)
        return 0
    check_target(args.base_url, args.allow_remote)
    import httpx
    import trio

    try:
        report = trio.run(run, args)
    except httpx.HTTPError as e:  # the set-up calls (models, tokenize); a request's own errors are counted
        raise SystemExit(f"error: {args.base_url}: {type(e).__name__}: {e}") from None
    print(table(report["summary"]))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    if args.plot:
        plot([(args.model, report)], args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
