"""Several Spool replicas and a request router in front, on one machine: for trying routing,
prefix affinity and failover before a real cluster.

    python tools/cluster.py [--replicas 2] [--router vllm|sglang] [--policy cache_aware]
        [--port 8000] [--first-replica-port 8101] [--health-check-interval 5] [--failover]
        [-- extra flags for every `python -m app serve`]

It starts the replicas (`python -m app serve --port 8101`, 8102, ...), waits for their /health,
then the router on --port (vLLM's `vllm-router` or SGLang's `sglang-router`, both on PyPI), and
serves until Ctrl-C. Logs go to --log-dir. With --failover it instead measures what a replica's
death costs: a steady load of short completions through the router, SIGKILL of the first
replica after 5 s, and a report of the requests that failed or waited, and for how long.
"""

import argparse
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
ROUTERS = {"vllm": "vllm_router.launch_router", "sglang": "sglang_router.launch_router"}


def wait_ready(url: str, proc: subprocess.Popen, what: str, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            sys.exit(f"error: {what} exited with {proc.returncode}")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    sys.exit(f"error: {what} did not come up in {timeout:g} s")


def start(args, extra: list[str], log_dir: Path) -> tuple[list[subprocess.Popen], subprocess.Popen, list[str]]:
    replicas, urls = [], []
    for i in range(args.replicas):
        port = args.first_replica_port + i
        log = open(log_dir / f"replica-{port}.log", "w")
        replicas.append(subprocess.Popen([sys.executable, "-m", "app", "serve", "--port", str(port), *extra],
                                         cwd=ROOT, stdout=log, stderr=subprocess.STDOUT))
        urls.append(f"http://127.0.0.1:{port}")
    for proc, url in zip(replicas, urls):
        wait_ready(url + "/health", proc, f"the replica at {url}")
    router = subprocess.Popen(
        [sys.executable, "-m", ROUTERS[args.router], "--port", str(args.port), "--policy", args.policy,
         "--worker-urls", *urls, "--health-check-interval-secs", str(args.health_check_interval),
         "--prometheus-port", str(args.port + 1000)],
        stdout=open(log_dir / "router.log", "w"), stderr=subprocess.STDOUT)
    wait_ready(f"http://127.0.0.1:{args.port}/v1/models", router, f"{args.router}-router", timeout=90)
    return replicas, router, urls


def failover(args, replicas: list[subprocess.Popen]) -> None:
    """A steady load through the router; the first replica killed after 5 s; the damage."""
    url = f"http://127.0.0.1:{args.port}/v1/completions"
    model = httpx.get(f"http://127.0.0.1:{args.port}/v1/models").json()["data"][0]["id"]
    results: list[tuple[float, float, int]] = []  # (start, seconds, status or 0 for a transport error)
    stop = threading.Event()

    def client(i: int):
        with httpx.Client(timeout=60) as http:
            while not stop.is_set():
                t = time.monotonic()
                try:
                    status = http.post(url, json={"model": model, "prompt": f"Client {i} says", "max_tokens": 4}).status_code
                except httpx.HTTPError:
                    status = 0
                results.append((t, time.monotonic() - t, status))

    threads = [threading.Thread(target=client, args=(i,)) for i in range(args.clients)]
    for thread in threads:
        thread.start()
    time.sleep(5)
    killed = time.monotonic()
    replicas[0].send_signal(signal.SIGKILL)
    time.sleep(args.health_check_interval * 3 + 10)
    stop.set()
    for thread in threads:
        thread.join()
    before = [r for r in results if r[0] < killed]
    after = [r for r in results if r[0] >= killed]
    failed = [r for r in after if r[2] != 200]
    slow = [r for r in after if r[2] == 200 and r[1] > 4 * statistics.median(x[1] for x in before)]
    print(f"router {args.router} ({args.policy}), --health-check-interval-secs {args.health_check_interval},"
          f" {args.replicas} replicas, {args.clients} clients of 4-token completions")
    print(f"before the kill: {len(before)} requests, {sum(r[2] != 200 for r in before)} failed,"
          f" median {1000 * statistics.median(r[1] for r in before):.0f} ms")
    print(f"after the kill: {len(after)} requests, {len(failed)} failed", end="")
    if failed:
        print(f" (statuses {sorted(set(r[2] for r in failed))}, the last one started"
              f" {max(r[0] for r in failed) - killed:.1f} s after the kill)", end="")
    print()
    if after:
        print(f"after the kill: slowest {max(r[1] for r in after):.2f} s, {len(slow)} over 4x the median before")
    last_bad = max((r[0] for r in failed), default=killed)
    tail = [r for r in after if r[0] > last_bad]
    print(f"from {last_bad - killed:.1f} s after the kill on: {len(tail)} requests, all succeeded:"
          f" {all(r[2] == 200 for r in tail)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--router", choices=sorted(ROUTERS), default="vllm")
    parser.add_argument("--policy", default="cache_aware")
    parser.add_argument("--port", type=int, default=8000, help="the router's port")
    parser.add_argument("--first-replica-port", type=int, default=8101)
    parser.add_argument("--health-check-interval", type=int, default=5, help="seconds between the router's checks")
    parser.add_argument("--log-dir", type=Path, default=None)
    parser.add_argument("--failover", action="store_true", help="measure a replica's SIGKILL under load, then exit")
    parser.add_argument("--clients", type=int, default=4, help="--failover: concurrent clients")
    args, extra = parser.parse_known_args()
    extra = [x for x in extra if x != "--"]
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="spool-cluster-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    replicas, router, urls = start(args, extra, log_dir)
    try:
        print(f"{args.router}-router on http://127.0.0.1:{args.port} in front of {' '.join(urls)}; logs in {log_dir}",
              flush=True)
        if args.failover:
            failover(args, replicas)
        else:
            signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
            signal.sigwait({signal.SIGINT, signal.SIGTERM})
    finally:
        for proc in [router, *replicas]:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in [router, *replicas]:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.kill(proc.pid, signal.SIGKILL)


if __name__ == "__main__":
    main()
