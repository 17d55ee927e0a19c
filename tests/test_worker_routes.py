"""The routes request routers ask of a worker (app/server/worker_routes.py), against a live
server on the default model; tests/test_routers.py runs the routers themselves."""

import httpx

CHAT = {"messages": [{"role": "user", "content": "Tell me about the sea, the ships upon it and the rivers that"
                                                  " flow into it from the mountains far away."}]}


def test_server_and_model_info_name_the_model_its_files_and_limits(server):
    for path in ("/server_info", "/get_server_info"):
        info = httpx.get(server.url + path).json()
        assert info["served_model_name"] == info["model_id"] == "SmolLM2-135M-Instruct"
        assert info["model_path"].endswith("SmolLM2-135M-Instruct") and info["max_model_len"] == 8192
        assert info["max_running_requests"] == 48 and info["dp_size"] == 1
        assert info["max_total_tokens"] % info["page_size"] == 0 and info["max_total_tokens"] > 0
        assert info["vllm_config"]["cache_config"]["block_size"] == info["page_size"] == 16
    for path in ("/model_info", "/get_model_info"):
        model = httpx.get(server.url + path).json()
        assert model["tokenizer_path"] == info["model_path"] and model["is_generation"] is True
        assert model["model_type"] == "llama" and model["architectures"] == ["LlamaForCausalLM"]


def test_render_gives_the_prompt_ids_the_route_would_run(server):
    rendered = httpx.post(server.url + "/v1/chat/completions/render", json=CHAT).json()
    assert rendered["token_ids"] == httpx.post(server.url + "/tokenize", json=CHAT).json()["tokens"]
    reply = httpx.post(server.url + "/v1/chat/completions", json={**CHAT, "max_tokens": 1}).json()
    assert reply["usage"]["prompt_tokens"] == len(rendered["token_ids"])
    text = httpx.post(server.url + "/v1/completions/render", json={"prompt": "Hello there"}).json()
    assert text["token_ids"] == httpx.post(server.url + "/tokenize", json={"prompt": "Hello there"}).json()["tokens"]
    bad = httpx.post(server.url + "/v1/chat/completions/render", json={"messages": "nope"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "messages"
    wrong = httpx.post(server.url + "/v1/chat/completions/render", json={**CHAT, "model": "gpt-4"})
    assert wrong.status_code == 404


def test_load_counts_requests_and_held_tokens(server):
    load = httpx.get(server.url + "/get_load").json()
    assert load == [{"dp_rank": 0, "num_reqs": 0, "num_waiting_reqs": 0, "num_tokens": 0}]
    with httpx.stream("POST", server.url + "/v1/chat/completions",
                      json={**CHAT, "max_tokens": 200, "ignore_eos": True, "stream": True}) as stream:
        lines = stream.iter_lines()
        next(line for line in lines if line.startswith("data:"))  # running now
        (busy,) = httpx.get(server.url + "/get_load").json()
        assert busy["num_reqs"] == 1 and busy["num_tokens"] >= len(CHAT["messages"][0]["content"].split())
    server.wait_gauge("num_requests_running", 0)


def test_flush_cache_drops_what_no_request_holds(server):
    first = httpx.post(server.url + "/v1/chat/completions", json={**CHAT, "max_tokens": 1}).json()
    again = httpx.post(server.url + "/v1/chat/completions", json={**CHAT, "max_tokens": 1}).json()
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert httpx.post(server.url + "/flush_cache").json()["flushed_blocks"] > 0
    after = httpx.post(server.url + "/v1/chat/completions", json={**CHAT, "max_tokens": 1}).json()
    assert after["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert first["usage"]["prompt_tokens"] == after["usage"]["prompt_tokens"]
