"""Slowloris against Spool: do many connections that trickle their request headers stop a normal
client from getting answers within its usual latency? A benchmark, not a test; loopback only.

    python tools/slowloris.py [--connections 500] [--duration 30] [--requests 30] [--ramp 2]
        [--base-url http://127.0.0.1:PORT] [--json FILE] [-- serve flags, e.g. --header-timeout 5]

Without --base-url it starts `python -m app serve --port <free port>` (plus the flags after
`--`), waits for GET /health == 200 and sends it SIGTERM at the end; its log goes to --server-log.
Phase 1 (baseline): the normal client sends --requests sequential POST /v1/completions
("Hello", 8 tokens, greedy) and GET /health, a fresh connection each. Phase 2 (attack): over
--ramp seconds, --connections raw sockets each send "GET / HTTP/1.1\\r\\nHost: x\\r\\nX-a: " and
then one byte a second, reconnecting whenever the server closes them; for --duration seconds
the normal client repeats its requests. The server should answer each slow one 408 after
--header-timeout, and evict the longest-waiting one if it reaches --max-connections.
CPU-seconds of the server, this tool and other processes are printed per phase: on a shared
machine, a phase in which others used several CPU-seconds measures them as much as Spool.
$SPOOL_API_KEY, if set, goes with every request (and to the server this tool starts).
"""

import argparse
import json
import math
import os
import re
import socket
import statistics
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import trio

ROOT = Path(__file__).resolve().parent.parent
HEAD = b"GET / HTTP/1.1\r\nHost: x\r\nX-a: "
COMPLETION = {"prompt": "Hello", "max_tokens": 8, "temperature": 0}
METRIC = re.compile(r'^spool:(connections_open|connections_closed_total)(?:\{reason="(\w+)"\})? (\S+)$', re.M)
ATTACKER_KEYS = ("connections opened", "closed by server", "408s seen", "503s seen", "closed with no response",
                 "resets by server", "connect errors")


def summary(latencies: list[float], errors: Counter) -> dict:
    """Request count, errors by kind, and nearest-rank median / p90 / max in ms of the successes."""
    xs = sorted(latencies)

    def ms(q):
        return round(1000 * xs[max(0, math.ceil(q * len(xs)) - 1)], 1) if xs else None

    return {"requests": len(xs) + sum(errors.values()), "errors": sum(errors.values()), "error_kinds": dict(errors),
            "median_ms": ms(0.5), "p90_ms": ms(0.9), "max_ms": ms(1.0)}


class Phase:
    """The normal client's record of one phase, and the CPU-seconds used meanwhile."""

    def __init__(self, server_pid: int | None):
        self.pid = server_pid
        self.cpu0 = self.cpu()
        self.latency = {"completions": [], "health": []}
        self.errors = {"completions": Counter(), "health": Counter()}
        self.start, self.timeline = time.perf_counter(), []  # (s since start, route, status, ms)

    def cpu(self) -> dict | None:
        """CPU-seconds so far of the server, this process, and the rest of the machine (Linux /proc)."""
        if self.pid is None or not os.path.exists("/proc/stat"):
            return None
        tick = os.sysconf("SC_CLK_TCK")
        ticks = [int(x) for x in open("/proc/stat").readline().split()[1:]]
        server = sum(map(int, open(f"/proc/{self.pid}/stat").read().rsplit(")", 1)[1].split()[11:13])) / tick
        tool = sum(os.times()[:2])
        busy = (sum(ticks) - ticks[3] - ticks[4] - ticks[7]) / tick  # all but idle, iowait and steal
        return {"server": server, "this tool": tool, "other processes": busy - server - tool}

    def results(self) -> dict:
        cpu1 = self.cpu()
        cpu = {k: round(v - self.cpu0[k], 1) for k, v in cpu1.items()} if cpu1 else None
        return {**{route: summary(self.latency[route], self.errors[route]) for route in self.latency},
                "cpu_s": cpu, "timeline": self.timeline}


async def request(http: httpx.AsyncClient, phase: Phase) -> None:
    """One completion, then one health check, each on a fresh connection."""
    for route, method, path, body in (("completions", "POST", "/v1/completions", COMPLETION),
                                      ("health", "GET", "/health", None)):
        t0 = time.perf_counter()
        try:
            r = await http.request(method, path, json=body)
        except httpx.HTTPError as e:
            phase.errors[route][type(e).__name__] += 1
            phase.timeline.append((round(t0 - phase.start, 3), route, type(e).__name__, None))
            continue
        latency = time.perf_counter() - t0
        if r.status_code == 200:
            phase.latency[route].append(latency)
        else:
            phase.errors[route][str(r.status_code)] += 1
        phase.timeline.append((round(t0 - phase.start, 3), route, r.status_code, round(1000 * latency, 1)))


async def scrape(http: httpx.AsyncClient) -> dict:
    """connections_open and connections_closed_total by reason, from GET /metrics."""
    text = (await http.get("/metrics")).raise_for_status().text
    return {(reason or name): float(value) for name, reason, value in METRIC.findall(text)}


async def slowloris(port: int, stats: Counter) -> None:
    """One attacker: trickle a request head a byte a second; reconnect whenever the server closes."""
    while True:
        try:
            stream = await trio.open_tcp_stream("127.0.0.1", port)
        except OSError:
            stats["connect errors"] += 1
            await trio.sleep(1)
            continue
        stats["connections opened"] += 1
        reply = bytearray()
        async with stream, trio.open_nursery() as nursery:
            nursery.start_soon(trickle, stream)
            try:
                while data := await stream.receive_some(4096):
                    reply += data
            except trio.BrokenResourceError:
                stats["resets by server"] += 1
            nursery.cancel_scope.cancel()
        stats["closed by server"] += 1
        stats[f"{reply[9:12].decode()}s seen" if reply.startswith(b"HTTP/1.1 ") else "closed with no response"] += 1


async def trickle(stream: trio.SocketStream) -> None:
    try:
        await stream.send_all(HEAD)
        while True:
            await trio.sleep(1)
            await stream.send_all(b"a")
    except (trio.BrokenResourceError, trio.ClosedResourceError):
        pass  # the reader sees the close


async def bench(args, base: str, port: int, server_pid: int | None) -> dict:
    limits = httpx.Limits(max_keepalive_connections=0)  # a fresh connection per request
    key = os.environ.get("SPOOL_API_KEY")  # the server this tool starts reads it too
    headers = {"authorization": f"Bearer {key}"} if key else {}
    async with httpx.AsyncClient(base_url=base, timeout=120, limits=limits, headers=headers) as http, \
            httpx.AsyncClient(base_url=base, timeout=30, headers=headers) as probe:
        await request(http, Phase(None))  # warm-up, not counted
        baseline = Phase(server_pid)
        for _ in range(args.requests):
            await request(http, baseline)
        baseline = baseline.results()
        before, open_now, attacker = await scrape(probe), [], Counter()
        async with trio.open_nursery() as nursery:
            for _ in range(args.connections):
                nursery.start_soon(slowloris, port, attacker)
                await trio.sleep(args.ramp / args.connections)

            async def sample():
                while True:
                    try:
                        open_now.append((await scrape(probe))["connections_open"])
                    except httpx.HTTPError:  # refused at the limit, like any newcomer
                        pass
                    await trio.sleep(1)

            nursery.start_soon(sample)
            attack, end = Phase(server_pid), trio.current_time() + args.duration  # its timeline starts here
            while trio.current_time() < end:
                await request(http, attack)
            attack = attack.results()
            nursery.cancel_scope.cancel()  # the attackers leave, so the last scrape finds room
        with trio.fail_after(30):
            while True:
                try:
                    after = await scrape(probe)
                    break
                except httpx.HTTPError:
                    await trio.sleep(0.5)
    return {"baseline": baseline, "attack": attack, "attacker": dict(attacker),
            "connections_closed_delta": {k: v - before.get(k, 0) for k, v in after.items()
                                         if k != "connections_open" and v != before.get(k, 0)},
            "connections_open": {"before": before["connections_open"], "min": min(open_now),
                                 "median": statistics.median(open_now), "max": max(open_now)}}


def start_server(extra: list[str], log_path: str) -> tuple[subprocess.Popen, int]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "app", "serve", "--port", str(port), *extra],
                                cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc, port
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.terminate()
    sys.exit(f"the server did not become healthy; see {log_path}")


def print_table(r: dict, args) -> None:
    print(f"# {args.connections} slow connections opened over {args.ramp:g} s, attack {args.duration:g} s;"
          f" baseline {args.requests} requests per route")
    for phase in ("baseline", "attack"):
        if r[phase]["cpu_s"]:
            print(f"# CPU-s during {phase}: " + ", ".join(f"{k} {v}" for k, v in r[phase]["cpu_s"].items()))
    print("| phase | route | requests | errors | median ms | p90 ms | max ms |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: |")
    for phase in ("baseline", "attack"):
        for route in ("completions", "health"):
            s = r[phase][route]
            kinds = f" ({', '.join(f'{k}: {v}' for k, v in s['error_kinds'].items())})" if s["errors"] else ""
            ms = " | ".join(str(s[k] or "-") for k in ("median_ms", "p90_ms", "max_ms"))
            print(f"| {phase} | {route} | {s['requests']} | {s['errors']}{kinds} | {ms} |")
    print("\n| attacker / server | count |\n| --- | ---: |")
    for key in [*ATTACKER_KEYS, *sorted(set(r["attacker"]) - set(ATTACKER_KEYS))]:
        print(f"| {key} | {r['attacker'].get(key, 0)} |")
    for reason, value in sorted(r["connections_closed_delta"].items()):
        print(f'| spool:connections_closed_total{{reason="{reason}"}} delta | {value:g} |')
    o = r["connections_open"]
    print(f"| spool:connections_open before; min / median / max during attack | {o['before']:g};"
          f" {o['min']:g} / {o['median']:g} / {o['max']:g} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--connections", type=int, default=500, help="slow connections (default: 500)")
    parser.add_argument("--duration", type=float, default=30.0, help="seconds of attack (default: 30)")
    parser.add_argument("--requests", type=int, default=30, help="baseline requests per route (default: 30)")
    parser.add_argument("--ramp", type=float, default=2.0, help="seconds to open the slow connections (default: 2)")
    parser.add_argument("--base-url", default=None, help="a running server on 127.0.0.1 (default: start one)")
    parser.add_argument("--server-log", default="/tmp/spool-slowloris.log", help="(default: %(default)s)")
    parser.add_argument("--json", default=None, metavar="FILE", help="write the results here")
    parser.add_argument("serve_flags", nargs="*", help="after --: flags for the server this tool starts")
    args = parser.parse_args()
    proc = None
    if args.base_url:
        parts = urlsplit(args.base_url)
        if parts.scheme != "http" or parts.hostname not in ("127.0.0.1", "localhost") or args.serve_flags:
            sys.exit(f"--base-url must be http://127.0.0.1:PORT, with no serve flags: {args.base_url}")
        port = parts.port or 80
    else:
        proc, port = start_server(args.serve_flags, args.server_log)
    try:
        result = trio.run(bench, args, f"http://127.0.0.1:{port}", port, proc and proc.pid)
    finally:
        if proc:
            proc.terminate()
            proc.wait(timeout=60)
    result["config"] = vars(args)
    print_table(result, args)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
