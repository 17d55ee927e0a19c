"""A long prompt against a running server while other streams decode: the long prompt's time to
first token, and the decoding streams' time per output token before it arrives and while it
prefills (how long they stall behind its chunks).

    python -m app serve --model FILE.gguf --max-model-len 32768 --kv-cache-gib 2 &
    python tools/bench_long_prompt.py --url http://127.0.0.1:8000 --prompt-tokens 20000 --streams 4

--streams streaming completions (a short prompt each, ignore_eos) start first; once each has
streamed --warmup tokens, one completion of --prompt-tokens random token ids (max_tokens 1) is
sent, and its first token timed. A stream's gaps are the times between its consecutive tokens;
"before" pools the gaps after warm-up and before the long prompt was sent, "during" those that
end while it prefills. Then the streams are closed. Token ids for prompts work on Spool,
vLLM and llama.cpp's server alike.
"""

import argparse
import json
import random
import statistics
import threading
import time

import httpx


class Stream(threading.Thread):
    """One streaming completion, recording when each token arrives, until told to stop."""

    def __init__(self, url: str, model: str | None, prompt: list[int], max_tokens: int):
        super().__init__(daemon=True)
        self.body = {"prompt": prompt, "max_tokens": max_tokens, "stream": True, "ignore_eos": True,
                     "temperature": 0, **({"model": model} if model else {})}
        self.url, self.times, self.stop, self.error = url, [], threading.Event(), None

    def run(self):
        try:
            with httpx.Client(timeout=3600) as client, \
                    client.stream("POST", f"{self.url}/v1/completions", json=self.body) as r:
                r.raise_for_status()
                for line in r.iter_lines():
                    if self.stop.is_set():
                        return
                    if line.startswith("data: {") and json.loads(line[6:]).get("choices"):
                        self.times.append(time.perf_counter())
        except Exception as e:  # reported by main, not raised in the thread
            self.error = e


def gaps(streams: list[Stream], start: float, end: float) -> list[float]:
    """Each stream's gaps between consecutive tokens whose later token arrived in [start, end)."""
    return [b - a for s in streams for a, b in zip(s.times, s.times[1:]) if start <= b < end]


def summary(values: list[float]) -> str:
    if not values:
        return "none"
    ms = sorted(1000 * v for v in values)
    return (f"median {statistics.median(ms):.0f} ms, p90 {ms[int(0.9 * (len(ms) - 1))]:.0f} ms,"
            f" max {ms[-1]:.0f} ms, mean {statistics.fmean(ms):.0f} ms ({len(ms)} gaps)")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--model", default=None)
    p.add_argument("--prompt-tokens", type=int, default=20000)
    p.add_argument("--streams", type=int, default=4)
    p.add_argument("--warmup", type=int, default=8, help="tokens each stream streams before the long prompt")
    p.add_argument("--stream-tokens", type=int, default=4096, help="each stream's max_tokens (it is closed earlier)")
    p.add_argument("--vocab", type=int, default=32000, help="token ids are drawn below this")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    rng = random.Random(a.seed)
    streams = [Stream(a.url, a.model, [rng.randrange(100, a.vocab) for _ in range(32)], a.stream_tokens)
               for _ in range(a.streams)]
    for s in streams:
        s.start()
    while any(len(s.times) < a.warmup and s.is_alive() for s in streams):
        time.sleep(0.05)
    if any(s.error for s in streams):
        raise SystemExit(f"a stream failed: {[s.error for s in streams if s.error]}")
    warmed = max(s.times[a.warmup // 2] for s in streams) if a.streams else time.perf_counter()
    body = {"prompt": [rng.randrange(100, a.vocab) for _ in range(a.prompt_tokens)], "max_tokens": 1,
            "temperature": 0, "stream": True, **({"model": a.model} if a.model else {})}
    sent = time.perf_counter()
    first = None
    with httpx.Client(timeout=7200) as client, client.stream("POST", f"{a.url}/v1/completions", json=body) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if first is None and line.startswith("data: {") and json.loads(line[6:]).get("choices"):
                first = time.perf_counter()
    for s in streams:
        s.stop.set()
    errors = [s.error for s in streams if s.error]
    if first is None or errors:
        raise SystemExit(f"no first token for the long prompt, or a stream failed: {errors}")
    print(f"# {a.prompt_tokens}-token prompt beside {a.streams} decoding streams, {a.url}")
    print(f"TTFT of the long prompt: {first - sent:.1f} s ({a.prompt_tokens / (first - sent):.0f} prompt tok/s)")
    print(f"streams' TPOT before it: {summary(gaps(streams, warmed, sent))}")
    print(f"streams' TPOT while it prefills: {summary(gaps(streams, sent, first))}")
    during = [sum(1 for t in s.times if sent <= t < first) for s in streams]
    print(f"tokens each stream got while it prefilled: {during}")


if __name__ == "__main__":
    main()
