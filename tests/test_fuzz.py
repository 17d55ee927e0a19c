"""Protocol fuzzing on a live server: thousands of connections of random bytes, truncated and
mutated requests, oversized heads, wrong Content-Lengths, broken chunked bodies, WebSocket
upgrades followed by bad frames, and stalls. Afterwards the server answers, nothing runs or
waits, the KV cache is back at idle, and no connection failed inside the server."""

import json
import random

import httpx
import pytest
import trio

from live_server import LiveServer

CONNECTIONS = 3000
WORKERS = 48
WS_HEAD = (b"GET /v1/ws HTTP/1.1\r\nHost: localhost\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
           b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n")


def post(path: str, body: bytes, extra: bytes = b"") -> bytes:
    return (b"POST %s HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\nContent-Length: %d\r\n%s\r\n"
            % (path.encode(), len(body), extra)) + body


def valid_request(rng: random.Random) -> bytes:
    max_tokens = rng.randint(1, 4)
    return rng.choice([
        lambda: b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n",
        lambda: b"GET /v1/models HTTP/1.1\r\nHost: localhost\r\n\r\n",
        lambda: post("/v1/completions", json.dumps({"prompt": "Hello there", "max_tokens": max_tokens,
                                                     "stream": rng.random() < 0.5}).encode()),
        lambda: post("/v1/chat/completions", json.dumps({"messages": [{"role": "user", "content": "Hi"}],
                                                          "max_tokens": max_tokens, "stream": True}).encode()),
        lambda: post("/tokenize", b'{"prompt": "Hello"}'),
    ])()


def masked_frame(rng: random.Random, opcode: int, payload: bytes, fin: bool = True) -> bytes:
    mask = rng.randbytes(4)
    head = bytes([(0x80 if fin else 0) | opcode])
    n = len(payload)
    head += bytes([0x80 | n]) if n < 126 else bytes([0x80 | 126]) + n.to_bytes(2, "big")
    return head + mask + bytes(b ^ mask[i % 4] for i, b in enumerate(payload))


def mutate(rng: random.Random, data: bytes) -> bytes:
    data = bytearray(data)
    for _ in range(rng.randint(1, 8)):
        pos = rng.randrange(len(data) + 1)
        kind = rng.random()
        if kind < 0.4 and pos < len(data):
            data[pos] = rng.randrange(256)
        elif kind < 0.7:
            data[pos:pos] = rng.choice([b"\r\n", b"\x00", b":", b" ", b"\xff", rng.randbytes(rng.randint(1, 16))])
        else:
            del data[pos:pos + rng.randint(1, 16)]
    return bytes(data)


def case(rng: random.Random) -> tuple[str, bytes, bool]:
    """(kind, bytes to send, whether to stall after them)."""
    kind = rng.choice(["random", "truncated", "mutated", "oversized", "short_body", "long_body", "chunked",
                       "websocket", "stall"])
    if kind == "random":
        return kind, rng.randbytes(rng.randint(1, 4096)), False
    if kind == "truncated":
        request = valid_request(rng)
        return kind, request[:rng.randrange(1, len(request))], rng.random() < 0.2
    if kind == "mutated":
        return kind, mutate(rng, valid_request(rng)), False
    if kind == "oversized":
        head = b"GET /health HTTP/1.1\r\nHost: x\r\n"
        if rng.random() < 0.5:
            return kind, head + b"X-Big: " + b"a" * rng.randint(17_000, 80_000) + b"\r\n\r\n", False
        return kind, head + b"".join(b"X-%d: v\r\n" % i for i in range(rng.randint(101, 2000))) + b"\r\n", False
    if kind == "short_body":
        request = post("/v1/completions", b'{"prompt": "Hello", "max_tokens": 2}')
        return kind, request[:-rng.randint(1, 20)], True
    if kind == "long_body":
        return kind, post("/v1/completions", b'{"prompt": "Hello", "max_tokens": 2}') + rng.randbytes(rng.randint(1, 300)), False
    if kind == "chunked":
        bad = rng.choice([b"zz\r\nhello\r\n0\r\n\r\n", b"5\r\nhelloXX0\r\n\r\n", b"ffffffffffffffffff\r\n",
                          b"3\r\n{\"p\r\n-1\r\n\r\n", b"5;" + b"e" * 20000 + b"\r\nhello\r\n0\r\n\r\n", b"2\r\n{}"])
        return kind, (b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
                      b"Transfer-Encoding: chunked\r\n\r\n" + bad), False
    if kind == "websocket":
        frames = rng.choice([
            lambda: rng.randbytes(rng.randint(1, 512)),  # garbage
            lambda: bytes([0x81, 5]) + b"hello",  # unmasked client frame
            lambda: masked_frame(rng, 0x3, b"reserved opcode"),
            lambda: masked_frame(rng, 0x0, b"continuation with no start"),
            lambda: masked_frame(rng, 0x1, b"\xff\xfe not utf-8"),
            lambda: masked_frame(rng, 0x9, b"p" * 200),  # a control frame over 125 bytes
            lambda: bytes([0x81, 0xFF]) + (1 << 62).to_bytes(8, "big") + b"mask",  # absurd length
            lambda: masked_frame(rng, 0x1, json.dumps({"type": "generate", "id": "g", "prompt": "Hi",
                                                        "max_tokens": 3}).encode()),
            lambda: masked_frame(rng, 0x1, b'{"type": "generate", "id": 5}', fin=False),
        ])()
        return kind, WS_HEAD + frames, rng.random() < 0.3
    return kind, b"", True  # connect, send nothing


async def one_connection(port: int, rng: random.Random, seen: dict) -> None:
    kind, data, stall = case(rng)
    seen[kind] = seen.get(kind, 0) + 1
    try:
        stream = await trio.open_tcp_stream("127.0.0.1", port)
    except OSError:
        seen["connect_failed"] = seen.get("connect_failed", 0) + 1
        return
    try:
        while data:  # in random pieces, as a network would deliver them
            cut = rng.randint(1, 8192)
            await stream.send_all(data[:cut])
            data = data[cut:]
        with trio.move_on_after(3 if stall else rng.choice([0.01, 0.2, 3])):
            while await stream.receive_some(65536):
                pass
    except (trio.BrokenResourceError, trio.ClosedResourceError):
        pass
    finally:
        await stream.aclose()


@pytest.mark.slow
async def test_thousands_of_hostile_connections_leave_the_server_healthy():
    server = LiveServer("--kv-cache-gib", "0.1", "--max-seqs", "8", "--header-timeout", "1", "--body-timeout", "1",
                        "--keep-alive-timeout", "1", "--ws-idle-timeout", "2", "--ws-ping-interval", "0.5")
    try:
        rng = random.Random(2026)
        seeds = [rng.random() for _ in range(CONNECTIONS)]
        seen: dict = {}
        limiter = trio.Semaphore(WORKERS)

        async def run(seed):
            async with limiter:
                await one_connection(server.port, random.Random(seed), seen)

        with trio.fail_after(600):
            async with trio.open_nursery() as nursery:
                for seed in seeds:
                    nursery.start_soon(run, seed)
        assert sum(v for k, v in seen.items() if k != "connect_failed") == CONNECTIONS
        assert len(seen) >= 9, seen  # every kind of case was sent
        assert server.proc.poll() is None, server.output()

        with trio.fail_after(60):
            while True:
                m = await trio.to_thread.run_sync(server.metrics)
                if (m['spool:num_requests_running{model_name="SmolLM2-135M-Instruct"}'] == 0
                        and m['spool:num_requests_waiting{model_name="SmolLM2-135M-Instruct"}'] == 0
                        and m['spool:kv_cache_usage_perc{model_name="SmolLM2-135M-Instruct"}'] == 0
                        and m["spool:connections_open"] <= 1):  # the scrape's own
                    break
                await trio.sleep(0.2)
        closed = {k.split('"')[1]: v for k, v in m.items() if k.startswith("spool:connections_closed_total")}
        assert closed["error"] == 0, server.output()[-5000:]
        assert closed["bad_request"] > 100 and closed["header_timeout"] > 10, closed
        r = await trio.to_thread.run_sync(lambda: httpx.post(server.url + "/v1/completions", timeout=30,
                                                             json={"prompt": "Hello", "max_tokens": 4}))
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
    finally:
        assert server.stop() == 0, server.output()[-5000:]
