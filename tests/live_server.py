"""A real `python -m app serve` subprocess on 127.0.0.1, for tests that talk to it over sockets."""

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until_ok(url: str, proc: subprocess.Popen, timeout: float, verify=True) -> bool:
    """Poll url until it answers 200 (True), or until proc exits or timeout passes (False)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if httpx.get(url, timeout=2, verify=verify).status_code == 200:
                return True
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    return False


class LiveServer:
    def __init__(self, *args: str, env: dict | None = None, port: int | None = None, scheme: str = "http",
                 verify=True):
        """scheme https: the server was given a certificate, which verify (httpx's) trusts."""
        self.port = port or free_port()
        self.url = f"{scheme}://127.0.0.1:{self.port}"
        self.log_path = Path(os.environ.get("TMPDIR", "/tmp")) / f"spool-server-{self.port}.log"
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "app", "serve", "--port", str(self.port), *args],
            cwd=ROOT, stdout=self.log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
        if not wait_until_ok(self.url + "/health", self.proc, timeout=180, verify=verify):
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with {self.proc.returncode}:\n{self.output()}")
            self.stop()
            raise RuntimeError(f"the server did not come up:\n{self.output()}")

    def openai_client(self, timeout: float = 120, api_key: str = "unused"):
        """The official client pointed at this server, without retries (a test sees every error)."""
        import openai

        return openai.OpenAI(base_url=self.url + "/v1", api_key=api_key, max_retries=0, timeout=timeout)

    def output(self) -> str:
        self.log.flush()
        return self.log_path.read_text()

    def metrics(self) -> dict[str, float]:
        """spool:* samples, keyed by name plus labels."""
        out = {}
        for line in httpx.get(self.url + "/metrics", timeout=10).text.splitlines():
            if line.startswith("spool:"):
                key, value = line.rsplit(" ", 1)
                out[key] = float(value)
        return out

    def gauge(self, name: str) -> float:
        return next(v for k, v in self.metrics().items() if k.startswith(f"spool:{name}{{"))

    def wait_gauge(self, name: str, value: float, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while self.gauge(name) != value:
            assert time.monotonic() < deadline, f"{name} stayed at {self.gauge(name)}, not {value}"
            time.sleep(0.1)

    def closed(self, reason: str) -> float:
        """spool:connections_closed_total for one reason."""
        return self.metrics()[f'spool:connections_closed_total{{reason="{reason}"}}']

    def wait_closed(self, reason: str, at_least: float, timeout: float = 15) -> None:
        """A connection is counted once the server has let go of it (after its linger)."""
        deadline = time.monotonic() + timeout
        while self.closed(reason) < at_least:
            assert time.monotonic() < deadline, f"{reason}: {self.closed(reason)} < {at_least}"
            time.sleep(0.05)

    def assert_serving(self) -> None:
        """Alive, and a real completion comes back whole (ignore_eos: a tiny random model may
        sample its end at once)."""
        assert self.proc.poll() is None, self.output()
        r = httpx.post(self.url + "/v1/completions", json={"prompt": "Hello", "max_tokens": 2, "ignore_eos": True},
                       timeout=30)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2, r.text

    def stop(self, sig=signal.SIGTERM, timeout: float = 60) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        return self.proc.returncode
