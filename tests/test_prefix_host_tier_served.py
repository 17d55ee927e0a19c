"""Served end to end: a conversation's second turn, after a burst of other requests crowded its
first turn out of a small KV cache, reloads the shared prefix from the host tier
(--swap-space) and reports it as cached prompt tokens."""

from concurrent.futures import ThreadPoolExecutor

import httpx

from live_server import LiveServer


def chat(server, messages, max_tokens=8) -> dict:
    body = {"model": "tiny", "messages": messages, "max_tokens": max_tokens, "temperature": 0}
    r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def test_the_second_turn_reloads_its_prefix_after_a_burst(tiny_dir):
    # 8 KiB blocks of 16 tokens: a KV cache of 20 blocks, a host pool of about 260
    server = LiveServer(str(tiny_dir), "--served-model-name", "tiny", "--backend", "numpy",
                        "--kv-cache-gib", "0.00016", "--swap-space", "0.002")
    try:
        messages = [{"role": "user", "content": " ".join(["The capital of France is Paris."] * 16)}]
        first = chat(server, messages)
        assert first["usage"]["prompt_tokens"] > 100
        others = [[{"role": "user", "content": " ".join([f"Numbers: {k} 1 2 3 4 5 6 7 8 9 10 100 1000."] * 8)}]
                  for k in range(4)]
        with ThreadPoolExecutor(4) as pool:
            list(pool.map(lambda m: chat(server, m, max_tokens=4), others))
        messages += [{"role": "assistant", "content": first["choices"][0]["message"]["content"]},
                     {"role": "user", "content": "Hello world! How are you today?"}]
        second = chat(server, messages)
        cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert cached >= 96, second["usage"]  # at least six of the first turn's 16-token blocks
        assert server.metrics()[next(k for k in server.metrics() if k.startswith("spool:prefix_cache_host_hits"))] > 0
        assert "KV cache 20 blocks" in server.output()
    finally:
        assert server.stop() == 0, server.output()
