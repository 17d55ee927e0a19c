"""One request never harms another (issue 46): on a model whose embedding has more rows than its
tokenizer has tokens (as Qwen2.5/3, Phi-3 and Gemma 3 have), structured output, tools and
thinking budgets run beside plain requests on every backend (NumPy, the numba kernels, the CUDA
kernels through the CPU harness); a hostile request mixed into a batch of ordinary ones fails
alone, and the ordinary ones get exactly the tokens they get without it."""

import json

import llguidance
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from app.engine.errors import EngineError
from app.server.errors import APIError, validate
from app.server.anthropic.schemas import MessagesRequest
from app.engine.request import ThinkingBudget
from app.server.formats import json_grammar
from app.server.schemas import ChatCompletionRequest, CompletionRequest
from app.server.tools import FORMATS, ToolUse
from cuda_harness import CpuLauncher, gpu_available
from engine_harness import Harness
from model.ops.cuda_ops import CudaOps
from model.ops.numba_ops import NumbaOps
from model.ops.numpy_ops import NumpyOps
from model.runner import ModelRunner
from model.sampling import SamplingParams
from model.tokenizer import Tokenizer
from tiny_model import make_tiny_model

PADDING = 128


def device_ops():
    """The CUDA kernels on a device (a GPU run; the harness runs the same kernels in CI)."""
    if not gpu_available():
        pytest.skip("no GPU: CuPy is not installed or sees no device")
    from model.ops import cupy_ops

    return cupy_ops.create("float32")


BACKENDS = {"numpy": NumpyOps, "numba": lambda: NumbaOps("q8_0"), "cuda-harness": lambda: CudaOps(np, CpuLauncher()),
            "cuda": device_ops}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


@pytest.fixture(scope="module")
def padded(tmp_path_factory):
    """A thinking model (<think> tokens) with PADDING rows past its tokenizer's ids."""
    path = make_tiny_model(tmp_path_factory.mktemp("tiny-padded"), thinking=True, padded_vocab=PADDING)
    tok = Tokenizer(path)
    assert json.loads((path / "config.json").read_text())["vocab_size"] == tok.vocab_size + PADDING
    return path, tok


def harness(path, tok, backend: str, **config) -> Harness:
    return Harness(ModelRunner.from_dir(path, num_blocks=96, block_size=4, ops=BACKENDS[backend]()), tok, **config)


def prompts(tok) -> list[list[int]]:
    return [tok.encode(t) for t in ("The capital of France is", "def add(a, b):", "Hello world! How",
                                    "Numbers: 0 1 2 3")]


def plain_sampling(i: int) -> SamplingParams:
    """Greedy and seeded rows: both must be the same bits beside anything."""
    return SamplingParams(temperature=0.0) if i % 2 == 0 else SamplingParams(temperature=0.9, seed=100 + i)


def run_plain(h: Harness, tok) -> list[str]:
    return [h.submit(p, request_id=f"plain{i}", max_tokens=10, ignore_eos=True, sampling=plain_sampling(i))
            for i, p in enumerate(prompts(tok))]


def test_unmasked_rows_do_pick_the_padding(padded):
    """The padding is tempting: unconstrained, the model picks ids no token names (so the
    tests below, where a grammar must never let one through, could fail)."""
    path, tok = padded
    h = harness(path, tok, "numba")
    rids = run_plain(h, tok)
    h.run()
    assert any(t >= tok.vocab_size for r in rids for t in h.tokens(r))


@pytest.mark.parametrize("backend", ["numpy", "numba", "cuda-harness", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_structured_output_tools_and_thinking_on_a_padded_vocabulary(padded, backend):
    path, tok = padded
    alone = harness(path, tok, backend)
    plain = run_plain(alone, tok)
    alone.run()

    h = harness(path, tok, backend)
    run_plain(h, tok)
    chat = ChatCompletionRequest(messages=[{"role": "user", "content": "weather in Rome?"}], tools=[WEATHER],
                                 tool_choice="required")
    tools = ToolUse.of(chat, FORMATS["hermes"](tok)).grammar()
    end = tok.encode("</think>", add_special_tokens=False)
    constrained = {
        "json": h.submit(prompts(tok)[0], max_tokens=40, grammar=json_grammar({"type": "object"}, "response_format")),
        "tools": h.submit(prompts(tok)[1], max_tokens=60, grammar=tools),
        "thinking": h.submit(prompts(tok)[2], max_tokens=12, ignore_eos=True,
                             thinking=ThinkingBudget(tuple(end), max_tokens=3)),
    }
    h.run()
    for rid in plain:  # what they write alone (bit for bit on the q8_0 kernels, which are batch-invariant)
        assert h.frames[rid][-1].finish_reason == "length"
        if backend == "numba":
            assert h.tokens(rid) == alone.tokens(rid)
    for name, rid in constrained.items():
        frame = h.frames[rid][-1]
        assert frame.finish_reason in ("stop", "length"), (name, frame.error)
        if name != "thinking":  # a grammar never lets a padding row through
            assert all(t < tok.vocab_size for t in h.tokens(rid)), name
    assert h.tokens(constrained["thinking"])[3:3 + len(end)] == end  # the budget's end, forced
    text = h.text(constrained["json"])
    if h.frames[constrained["json"]][-1].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)
    assert h.text(constrained["tools"]).startswith("<tool_call>")
    assert h.pool.used == 0


def test_ids_are_checked_against_the_smaller_vocabulary(padded):
    """Ids past the tokenizer's, though the model has rows for them, are refused at the door
    wherever a request names them."""
    path, tok = padded
    h = harness(path, tok, "numpy")
    past = tok.vocab_size + 5
    for params in ({"stop_token_ids": (past,)}, {"sampling": SamplingParams(logit_bias={past: 5.0})}):
        with pytest.raises(EngineError, match="outside the vocabulary"):
            h.submit([5, 6, 7], **params)
    with pytest.raises(EngineError, match="outside the vocabulary"):
        h.submit([5, past, 7])


class PanicException(BaseException):
    """What pyo3 raises for a Rust panic in llguidance or tokenizers (a BaseException); the
    engine knows it by its name, as every pyo3 module makes its own class."""


def hostile(h: Harness, tok, kind: str) -> str | None:
    """Submit one hostile request of a kind; the id of the one that ran, or None when the door
    refused it (which it must, for the kinds the door can see)."""
    prompt = prompts(tok)[3]
    if kind == "out-of-range":
        with pytest.raises(EngineError):
            h.submit(prompt, sampling=SamplingParams(top_k=2**31))
        return None
    if kind == "uncompilable":
        with pytest.raises(EngineError, match="cannot be compiled"):
            h.submit(prompt, grammar=llguidance.LLMatcher.grammar_from_lark("start: (((("))
        return None
    if kind == "padded-grammar":
        return h.submit(prompt, max_tokens=8, grammar=json_grammar({"type": "object"}, "response_format"))
    rid = h.submit(prompt, max_tokens=8, grammar=llguidance.LLMatcher.grammar_from_regex("[a-z ]+"))
    request = h.planner.queues.requests[rid]
    if kind == "panicking-mask":  # on the grammars' thread, while the step's forward pass runs
        real = h.outputs.grammars.mask

        def mask(matcher):
            if matcher is request.output.matcher and len(request.output_ids) >= 2:
                raise PanicException("called `Option::unwrap()` on a `None` value")
            return real(matcher)
        h.outputs.grammars.mask = mask
    else:  # in the detokenizer, after its token was sampled
        add = request.output.detok.add

        def panicking_add(token):
            if len(request.output_ids) >= 3:
                raise PanicException("index out of bounds: the len is 0 but the index is 0")
            return add(token)
        request.output.detok.add = panicking_add
    return rid


KINDS = ["out-of-range", "uncompilable", "padded-grammar", "panicking-mask", "panicking-detokenizer"]


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(kind=st.sampled_from(KINDS), seed=st.integers(0, 2**16), at=st.integers(0, 4))
def test_a_hostile_request_in_a_random_batch_fails_alone(padded, kind, seed, at):
    """On the q8_0 kernels, whose rows never depend on their neighbours, so "the same tokens"
    is bit for bit."""
    path, tok = padded
    rng = np.random.default_rng(seed)
    batch = [(rng.integers(3, tok.vocab_size, rng.integers(2, 12)).tolist(),
              SamplingParams(temperature=float(rng.choice([0.0, 0.7])), seed=int(rng.integers(1 << 30))),
              int(rng.integers(3, 10))) for _ in range(4)]

    def run(with_hostile: bool):
        h = harness(path, tok, "numba")
        rids, bad = [], None
        for i, (prompt, sampling, max_tokens) in enumerate(batch):
            if with_hostile and i == at:
                bad = hostile(h, tok, kind)
            rids.append(h.submit(prompt, request_id=f"ordinary{i}", sampling=sampling, max_tokens=max_tokens,
                                 ignore_eos=True))
        if with_hostile and at == len(batch):
            bad = hostile(h, tok, kind)
        h.run()
        assert h.pool.used == 0
        return h, rids, bad

    clean, rids, _ = run(False)
    h, _, bad = run(True)
    for rid in rids:
        assert h.tokens(rid) == clean.tokens(rid), (kind, rid)
    if bad is not None:
        last = h.frames[bad][-1]
        if kind.startswith("panicking"):
            assert last.finish_reason == "error" and "PanicException" in last.error
        else:
            assert last.finish_reason in ("stop", "length") and all(t < tok.vocab_size for t in h.tokens(bad))


def test_a_served_padded_model_answers_json_beside_plain_requests(padded):
    """As a new user met it: a json_object request and plain ones at once on a padded
    vocabulary, through the server and the official client; every one answers."""
    from concurrent.futures import ThreadPoolExecutor

    from live_server import LiveServer

    path, _ = padded
    server = LiveServer("--model", str(path), "--kv-cache-gib", "0.05")
    try:
        with server.openai_client() as client, ThreadPoolExecutor(4) as pool:
            def chat(i: int):
                fmt = {"response_format": {"type": "json_object"}} if i == 0 else {}
                return client.chat.completions.create(
                    model=path.name, messages=[{"role": "user", "content": f"question {i}"}],
                    max_tokens=24, temperature=0.0, **fmt)
            replies = list(pool.map(chat, range(4)))
        assert all(r.choices[0].finish_reason in ("stop", "length") for r in replies)
        if replies[0].choices[0].finish_reason == "stop":
            assert isinstance(json.loads(replies[0].choices[0].message.content), dict)
    finally:
        assert server.stop() == 0, server.output()


HOSTILE_BODIES = {
    "out-of-range": {"prompt": "hello", "top_k": 2**31, "max_tokens": 4},
    "invalid-tool-schema": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "tools": [
        {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": 5}}}],
        "tool_choice": "required"},
    "padded-grammar": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 12,
                       "response_format": {"type": "json_object"}},
    "uncompilable": {"prompt": "hello", "max_tokens": 4, "guided_regex": "(((("},
    "oversized": {"prompt": [[5]] * 100_000, "n": 16, "max_tokens": 1},
}


def test_hostile_requests_beside_ordinary_ones_on_a_live_server(padded):
    """Each hostile kind sent at once with seeded ordinary requests, through real sockets: the
    ordinary ones write the same tokens as alone, and the hostile one gets a 4xx or its own
    answer (a grammar on the padded vocabulary is served)."""
    from concurrent.futures import ThreadPoolExecutor

    import httpx

    from live_server import LiveServer

    path, _ = padded
    server = LiveServer("--model", str(path), "--kv-cache-gib", "0.05")
    ordinary = [{"prompt": f"The capital number {i} is", "max_tokens": 8, "temperature": 0.8, "seed": i,
                 "ignore_eos": True} for i in range(4)]

    def post(body: dict) -> httpx.Response:
        route = "/v1/chat/completions" if "messages" in body else "/v1/completions"
        with httpx.Client(base_url=server.url, timeout=120) as c:
            return c.post(route, json=body)

    def texts(replies) -> list[str]:
        assert all(r.status_code == 200 for r in replies), [r.text for r in replies]
        return [r.json()["choices"][0]["text"] for r in replies]

    try:
        with ThreadPoolExecutor(len(ordinary) + 1) as pool:
            alone = texts(pool.map(post, ordinary))
            for kind, body in HOSTILE_BODIES.items():
                bad = pool.submit(post, body)
                assert texts(pool.map(post, ordinary)) == alone, kind
                reply = bad.result()
                if kind == "padded-grammar":
                    assert reply.status_code == 200, reply.text
                else:
                    assert reply.status_code == 400 and reply.json()["error"]["message"], (kind, reply.text)
    finally:
        assert server.stop() == 0, server.output()


@pytest.mark.parametrize("field,value", [
    ("top_k", 2**31), ("top_k", -2), ("seed", 2**63), ("seed", -2**63 - 1), ("n", 17), ("n", 0),
    ("logit_bias", {str(i): 1.0 for i in range(301)}), ("prompt_logprobs", 21), ("min_tokens", -1),
])
def test_fields_out_of_range_are_refused_at_the_door(field, value):
    """Before any work, and naming the field: a 400 from the body's own schema."""
    for schema, body in ((ChatCompletionRequest, {"messages": [{"role": "user", "content": "hi"}]}),
                         (CompletionRequest, {"prompt": "hi"})):
        with pytest.raises(APIError) as refused:
            validate(schema, {**body, field: value})
        assert refused.value.status == 400 and refused.value.param.startswith(field), refused.value.message
        validate(schema, body)  # the same body without it is fine


def test_anthropic_top_k_is_held_to_int32_too():
    body = {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
    with pytest.raises(APIError, match="top_k"):
        validate(MessagesRequest, {**body, "top_k": 2**31})
    assert validate(MessagesRequest, {**body, "top_k": 40}).top_k == 40


def test_the_engine_refuses_what_no_sampler_can_hold(padded):
    """The last line, for callers that skip the schemas (the WebSocket's, a library user's)."""
    path, tok = padded
    h = harness(path, tok, "numpy")
    for sampling in (SamplingParams(top_k=2**31), SamplingParams(seed=2**64),
                     SamplingParams(logit_bias={i: 1.0 for i in range(301)})):
        with pytest.raises(EngineError):
            h.submit([5, 6, 7], sampling=sampling)
