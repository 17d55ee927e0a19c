"""The OpenAI-compatible server on the real default model, through the official openai client
and plain HTTP, on 127.0.0.1."""

import json

import httpx
import openai
import pytest
import trio
from trio_websocket import ConnectionRejected, open_websocket_url

from live_server import LiveServer

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module", params=["q8_0", "float32"])
def server(request):
    """The default model, on the CPU backend's default 8-bit weights and on float32 ones."""
    s = LiveServer("--kv-cache-gib", "0.25", "--max-seqs", "16", "--max-model-len", "2048", "--dtype", request.param)
    yield s
    assert s.stop() == 0, s.output()


@pytest.fixture(scope="module")
def client(server):
    with server.openai_client(timeout=120) as c:
        yield c


def model_name(client) -> str:
    return client.models.list().data[0].id


def test_models_lists_the_served_model(client):
    models = client.models.list().data
    assert [m.id for m in models] == ["SmolLM2-135M-Instruct"]


def test_chat_not_streamed(client):
    r = client.chat.completions.create(model=model_name(client), messages=QUESTION, temperature=0, max_tokens=30)
    assert "Paris" in r.choices[0].message.content
    assert r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens > 0 and r.usage.prompt_tokens > 20
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_chat_streamed_with_usage(client):
    stream = client.chat.completions.create(model=model_name(client), messages=QUESTION, temperature=0,
                                            max_tokens=30, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert "Paris" in text
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["stop"]
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage.completion_tokens > 0
    assert usage.prompt_tokens_details.cached_tokens >= 16  # the same prompt ran just before


def test_completions_streamed_and_not(client):
    prompt = "The capital of France is"
    r = client.completions.create(model=model_name(client), prompt=prompt, temperature=0, max_tokens=8)
    assert r.choices[0].text.strip() and r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 8
    chunks = list(client.completions.create(model=model_name(client), prompt=prompt, temperature=0, max_tokens=8,
                                            stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == r.choices[0].text
    assert chunks[-1].usage.completion_tokens == 8


def test_n_seed_logprobs_and_stop(client):
    name = model_name(client)
    r = client.chat.completions.create(model=name, messages=QUESTION, n=2, seed=7, temperature=1.0,
                                       max_tokens=12, logprobs=True, top_logprobs=3)
    assert sorted(c.index for c in r.choices) == [0, 1]
    again = client.chat.completions.create(model=name, messages=QUESTION, n=2, seed=7, temperature=1.0,
                                           max_tokens=12, logprobs=True, top_logprobs=3)
    assert [c.message.content for c in r.choices] == [c.message.content for c in again.choices]
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens // 2 or len(content) > 0
    for entry in content:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[-1].logprob
    stopped = client.chat.completions.create(model=name, messages=QUESTION, temperature=0, max_tokens=30,
                                             stop=["France"])
    assert "France" not in stopped.choices[0].message.content
    assert stopped.choices[0].finish_reason == "stop"


def test_tokenize_detokenize_openapi_and_health(server):
    r = httpx.post(server.url + "/tokenize", json={"prompt": "Hello world"}).json()
    assert r["count"] == len(r["tokens"]) > 0
    assert httpx.post(server.url + "/detokenize", json={"tokens": r["tokens"]}).json()["prompt"] == "Hello world"
    spec = httpx.get(server.url + "/openapi.json").json()
    assert "/v1/chat/completions" in spec["paths"] and "ChatCompletionRequest" in spec["components"]["schemas"]
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}


def test_metrics_use_vllm_names(server, client):
    client.completions.create(model=model_name(client), prompt="Hi", max_tokens=2)
    m = server.metrics()
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "prompt_tokens_total",
                 "generation_tokens_total", "prefix_cache_queries_total", "prefix_cache_hits_total",
                 "num_preemptions_total", "time_to_first_token_seconds_count",
                 "time_per_output_token_seconds_count", "inter_token_latency_seconds_count",
                 "e2e_request_latency_seconds_count", "request_queue_time_seconds_count"):
        assert any(k.startswith(f"spool:{name}{{") for k in m), name
    assert any(k.startswith('spool:request_success_total{finished_reason="length"') for k in m)
    assert server.gauge("generation_tokens_total") > 0
    page = httpx.get(server.url + "/metrics").text  # the process's own, for leak watching (tools/soak.py)
    rss = next(float(line.split()[1]) for line in page.splitlines() if line.startswith("process_resident_memory_bytes"))
    assert rss > 50e6  # the model alone is bigger than that


BAD_SAMPLERS = [("typical_p", 0), ("typical_p", 1.5), ("dynatemp_range", -0.5), ("dynatemp_exponent", -1),
                ("xtc_probability", 1.5), ("xtc_threshold", -0.1), ("allowed_token_ids", [10 ** 9]),
                ("allowed_token_ids", []), ("bad_words", [""]), ("penalty_last_n", -2), ("repeat_last_n", -2),
                ("dry_multiplier", -1), ("dry_allowed_length", -1), ("dry_penalty_last_n", -2),
                ("mirostat", 1), ("mirostat", 3), ("mirostat_tau", -1), ("samplers", ["top_k", "infill"]),
                ("samplers", "kqt")]
BAD = [
    ("malformed JSON", "/v1/chat/completions", b"{not json", 400),
    ("wrong type", "/v1/chat/completions", {"messages": "hello"}, 400),
    ("empty messages", "/v1/chat/completions", {"messages": []}, 400),
    ("negative temperature", "/v1/chat/completions", {"messages": QUESTION, "temperature": -1}, 400),
    ("NaN temperature", "/v1/chat/completions", b'{"messages": [{"role": "user", "content": "hi"}], "temperature": NaN}', 400),
    ("top_p zero", "/v1/chat/completions", {"messages": QUESTION, "top_p": 0}, 400),
    ("top_p above one", "/v1/chat/completions", {"messages": QUESTION, "top_p": 1.5}, 400),
    ("max_tokens beyond the context", "/v1/chat/completions", {"messages": QUESTION, "max_tokens": 100000}, 400),
    ("prompt longer than the context", "/v1/completions", {"prompt": "hello " * 3000}, 400),
    ("out-of-vocabulary logit_bias", "/v1/chat/completions", {"messages": QUESTION, "logit_bias": {"999999": 5}}, 400),
    ("a grammar and allowed_token_ids that leave no token", "/v1/completions",
     {"prompt": "x", "regex": "!x", "allowed_token_ids": [1, 2], "max_tokens": 2}, 400),
    ("unknown model", "/v1/chat/completions", {"model": "gpt-9", "messages": QUESTION}, 404),
    ("10 MB body", "/v1/completions", {"prompt": "x" * 10_000_000}, 413),
    ("unknown route", "/v1/nothing", {}, 404),
    ("deeply nested arrays", "/v1/completions", b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", 400),
    ("nested just under the parser's limit", "/v1/completions", b'{"prompt": ' + b"[" * 900 + b"]" * 900 + b"}", 400),
    ("an image part", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": [{"type": "text", "text": "What is this?"},
                                                 {"type": "image_url", "image_url": {"url": "data:,x"}}]}]}, 400),
    *[(f"unsupported {field}", path, {**base, field: value}, 400) for field, path, base, value in [
        ("functions", "/v1/chat/completions", {"messages": QUESTION}, [{"name": "f", "parameters": {}}]),
        ("tools", "/v1/completions", {"prompt": "x"},  # chat only
         [{"type": "function", "function": {"name": "f", "parameters": {}}}]),
        ("tool_choice", "/v1/chat/completions", {"messages": QUESTION}, "required"),  # with no tools
        ("audio", "/v1/chat/completions", {"messages": QUESTION}, {"voice": "alloy", "format": "wav"}),
        ("modalities", "/v1/chat/completions", {"messages": QUESTION}, ["text", "audio"]),
        ("suffix", "/v1/completions", {"prompt": "x"}, "y"),
        # vLLM's and llama-server's samplers Spool does not implement, set on
        ("repeat_penalty", "/v1/completions", {"prompt": "x"}, 1.1),
        ("use_beam_search", "/v1/completions", {"prompt": "x"}, True),
    ]],
    # the samplers Spool has, out of range (llama.cpp's ranges where vLLM has none)
    *[(f"bad {field}", "/v1/completions", {"prompt": "x", field: value}, 400) for field, value in BAD_SAMPLERS],
]
SAMPLERS = ("repeat_penalty", "use_beam_search")

# the field a refusal names, by the case's id
NAMED = {"an image part": "messages.0.content.1", **{f"unsupported {f}": f for f in (
    "functions", "tools", "tool_choice", "audio", "modalities", "suffix", *SAMPLERS)},
    **{f"bad {field}": field for field, _ in BAD_SAMPLERS}, "bad repeat_last_n": "penalty_last_n"}


@pytest.mark.parametrize("what,path,body,status", BAD, ids=[b[0] for b in BAD])
def test_bad_input_gets_an_openai_error_and_the_server_stays_healthy(server, what, path, body, status):
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = httpx.post(server.url + path, content=content, headers={"Content-Type": "application/json"}, timeout=60)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["code"] is None or isinstance(error["code"], str)  # OpenAI's schema: never the status number
    if what in NAMED:
        assert error["param"] == NAMED[what] and NAMED[what] in error["message"], error
    assert httpx.get(server.url + "/health").status_code == 200


def test_allowed_token_ids_bad_words_and_llama_samplers_reach_the_sampler(server):
    """vLLM's allowed_token_ids and bad_words, and llama-server's samplers, through the API."""
    ids = httpx.post(server.url + "/tokenize", json={"prompt": " Paris Rome"}).json()["tokens"][-2:]
    body = {"prompt": "The capital of France is", "max_tokens": 4, "temperature": 1.0, "seed": 3}
    r = httpx.post(server.url + "/v1/completions", json={**body, "allowed_token_ids": ids[:1]}, timeout=60).json()
    want = httpx.post(server.url + "/detokenize", json={"tokens": ids[:1] * 4}).json()["prompt"]
    assert r["choices"][0]["text"] == want, r
    greedy = {**body, "temperature": 0, "max_tokens": 1}
    first = httpx.post(server.url + "/v1/completions", json=greedy, timeout=60).json()["choices"][0]["text"]
    banned = httpx.post(server.url + "/v1/completions", json={**greedy, "bad_words": [first]}, timeout=60).json()
    assert banned["choices"][0]["text"] not in ("", first), (first, banned)
    llama = {"typical_p": 0.8, "dynatemp_range": 0.5, "xtc_probability": 0.5, "xtc_threshold": 0.1,
             "repeat_last_n": 16, "repetition_penalty": 1.2, "dry_multiplier": 0.8, "dry_allowed_length": 1,
             "dry_sequence_breakers": ["\n", "."]}
    mirostat = {"mirostat": 2, "mirostat_tau": 3.0, "mirostat_eta": 0.2, "max_tokens": 12}
    chain = {"samplers": "edkypmxt", "top_k": 20, "top_p": 0.9, "min_p": 0.05, "repetition_penalty": 1.1}
    for extra in (llama, mirostat, chain):
        runs = [httpx.post(server.url + "/v1/completions", json={**body, **extra}, timeout=60).json()
                for _ in range(2)]
        assert runs[0]["choices"][0]["text"] == runs[1]["choices"][0]["text"], runs  # seeded


def test_fields_that_ask_for_nothing_new_are_accepted(client):
    r = client.chat.completions.create(model=model_name(client), messages=QUESTION, max_tokens=2, temperature=0,
                                       response_format={"type": "text"}, tool_choice="none", user="u", store=False,
                                       metadata={"k": "v"}, service_tier="auto")
    assert r.choices[0].finish_reason == "length"
    off = {"dry_multiplier": 0, "dry_base": 1.75, "xtc_probability": 0.0, "xtc_threshold": 0.1, "typical_p": 1.0,
           "top_n_sigma": -1, "mirostat": 0, "dynatemp_range": 0, "bad_words": [], "repeat_penalty": 1.0,
           "samplers": ["top_k", "top_p", "temperature"], "n_probs": 0}  # llama-server's web page sends these
    r = client.chat.completions.create(model=model_name(client), messages=QUESTION, max_tokens=2, temperature=0,
                                       extra_body=off)
    assert r.choices[0].finish_reason == "length"


def test_bodies_have_openais_exact_shapes(server, client):
    """refusal: null on a chat message and its logprobs; no role key in stream deltas after the
    first (OpenAI's schema forbids role: null)."""
    body = {"messages": QUESTION, "max_tokens": 4, "temperature": 0, "logprobs": True}
    reply = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60).json()
    choice = reply["choices"][0]
    assert choice["message"]["refusal"] is None and choice["logprobs"]["refusal"] is None
    with httpx.stream("POST", server.url + "/v1/chat/completions", json={**body, "stream": True}, timeout=60) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    assert deltas[0]["role"] == "assistant" and all("role" not in d for d in deltas[1:]), deltas


def test_the_openai_client_sees_errors_as_exceptions(client):
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.chat.completions.create(model=model_name(client), messages=QUESTION, temperature=-1)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=QUESTION)


def test_api_key_guards_every_route_but_health():
    s = LiveServer("--kv-cache-gib", "0.05", "--api-key", "sekrit")
    try:
        assert httpx.get(s.url + "/health").status_code == 200
        r = httpx.get(s.url + "/v1/models")
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert httpx.get(s.url + "/metrics", headers={"Authorization": "Bearer wrong"}).status_code == 401
        with s.openai_client(api_key="sekrit") as c:
            assert c.models.list().data[0].id == "SmolLM2-135M-Instruct"

        async def websocket_needs_the_key_too():
            url = f"ws://127.0.0.1:{s.port}/v1/ws"
            with pytest.raises(ConnectionRejected):  # closed before the handshake completes
                async with open_websocket_url(url):
                    pass
            async with open_websocket_url(url, extra_headers=[(b"Authorization", b"Bearer sekrit")]) as ws:
                await ws.send_message(json.dumps({"type": "generate", "id": "a", "prompt": "Hi", "max_tokens": 2}))
                while (frame := json.loads(await ws.get_message()))["type"] != "done":
                    pass
                assert frame["usage"]["completion_tokens"] == 2

        trio.run(websocket_needs_the_key_too)
    finally:
        assert s.stop() == 0


def test_request_timeout_ends_generations():
    s = LiveServer("--kv-cache-gib", "0.05", "--request-timeout", "1")
    try:
        body = {"prompt": "Once upon a time", "max_tokens": 2000, "ignore_eos": True}
        r = httpx.post(s.url + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 504 and r.json()["error"]["code"] == "timeout"
        with httpx.stream("POST", s.url + "/v1/completions", json={**body, "stream": True}, timeout=60) as r:
            events = [line for line in r.iter_lines() if line.startswith("data: ")]
        assert '"code": "timeout"' in events[-2] and events[-1] == "data: [DONE]"
        s.wait_gauge("num_requests_running", 0, timeout=10)  # aborted at the next step
    finally:
        assert s.stop() == 0


@pytest.mark.parametrize("body,param", [
    ({"messages": QUESTION, "min_tokens": 50, "max_tokens": 5}, "min_tokens"),
    ({"messages": QUESTION, "max_tokens": 100000}, "max_tokens"),
    ({"messages": QUESTION, "top_p": 2}, "top_p"),
    ({"messages": QUESTION, "stop_token_ids": [10 ** 9]}, "stop_token_ids"),
])
def test_errors_name_the_field_at_fault(server, body, param):
    r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
