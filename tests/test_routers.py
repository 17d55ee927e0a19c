"""Several Spool replicas behind the routers of vLLM (vllm-router) and SGLang (sglang-router),
run as a user would: real binaries from PyPI, real replicas on the default model."""

import subprocess
import sys

import httpx
import pytest

from live_server import LiveServer, free_port, wait_until_ok

pytestmark = pytest.mark.slow

PREFIXES = [  # three system prompts of about 60 tokens, each shared by several requests
    "You are a ship's navigator in the age of sail. You answer in the voice of an old sailor who has"
    " crossed every ocean twice and remembers the name of every harbour, tide and wind he met there.",
    "You are a baker in a small mountain village. Every answer mentions bread, the weather over the pass"
    " and the goats that wander into the square each morning before the church bell rings six times.",
    "You are a patient teacher of arithmetic for young children. You explain every step with apples,"
    " pebbles or fingers, and you always end by asking the child to try one more example on their own.",
]
QUESTIONS = ["What do you see today?", "What did you eat?", "Tell me a short story.", "What is your name?"]


class Router:
    def __init__(self, *command: str):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen([*command, "--port", str(self.port), "--prometheus-port", str(free_port())],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        if not wait_until_ok(self.url + "/v1/models", self.proc, timeout=90):
            self.stop()
            raise RuntimeError(f"{command[2]} did not come up (exit code {self.proc.returncode})")

    def stop(self):
        self.proc.terminate()
        self.proc.wait(timeout=30)


@pytest.fixture(scope="module")
def replicas():
    pair = [LiveServer("--kv-cache-gib", "0.1", "--max-seqs", "8") for _ in range(2)]
    yield pair
    for replica in pair:
        replica.stop()


def served(replicas) -> list[float]:
    return [sum(v for k, v in r.metrics().items() if k.startswith("spool:request_success_total")) for r in replicas]


def requests_seen(replica) -> list[str]:
    """'METHOD PATH STATUS' for every request the replica logged (spool.http)."""
    return [line.split("spool.http: ", 1)[1].split(" ", 1)[1] for line in replica.output().splitlines()
            if "spool.http: " in line]


def test_vllm_router_keeps_each_prefix_on_one_replica_with_no_extra_calls(replicas):
    router = Router(sys.executable, "-m", "vllm_router.launch_router", "--policy", "cache_aware",
                    "--worker-urls", *(r.url for r in replicas))
    try:
        before = [len(requests_seen(r)) for r in replicas]
        where: dict[int, list[int]] = {p: [] for p in range(len(PREFIXES))}
        cached: dict[int, list[int]] = {p: [] for p in range(len(PREFIXES))}
        for question in QUESTIONS:
            for p, prefix in enumerate(PREFIXES):
                counts = served(replicas)
                reply = httpx.post(router.url + "/v1/chat/completions", timeout=60, json={
                    "model": "SmolLM2-135M-Instruct", "max_tokens": 4, "temperature": 0,
                    "messages": [{"role": "system", "content": prefix}, {"role": "user", "content": question}]})
                assert reply.status_code == 200, reply.text
                after = served(replicas)
                (replica,) = [i for i in range(len(replicas)) if after[i] > counts[i]]
                where[p].append(replica)
                cached[p].append(reply.json()["usage"]["prompt_tokens_details"]["cached_tokens"])
        for p in where:
            assert len(set(where[p][1:])) == 1, where  # after the first, one replica per prefix
            assert all(c >= 32 for c in cached[p][1:]), cached  # the system prompt's full blocks, from its cache
        calls = [call for r, start in zip(replicas, before) for call in requests_seen(r)[start:]]
        assert any(c.startswith("POST /v1/chat/completions/render 200") for c in calls)
        assert not [c for c in calls if c.startswith("POST /tokenize") or c.endswith(" 404")], calls
    finally:
        router.stop()


def test_sglang_router_names_the_real_model(replicas):
    router = Router(sys.executable, "-m", "sglang_router.launch_router", "--policy", "cache_aware",
                    "--worker-urls", *(r.url for r in replicas))
    try:
        models = httpx.get(router.url + "/v1/models").json()
        assert [m["id"] for m in models["data"]] == ["SmolLM2-135M-Instruct"]
        reply = httpx.post(router.url + "/v1/chat/completions", timeout=60, json={
            "model": "SmolLM2-135M-Instruct", "max_tokens": 4, "messages": [{"role": "user", "content": "Hi"}]})
        assert reply.status_code == 200 and reply.json()["choices"][0]["message"]["content"]
    finally:
        router.stop()
