"""What scoring harnesses and agents send on the default model, through the official openai
client: GET /v1/models/{id}, echo (with logprobs and max_tokens 0, as lm-eval scores text) and
vLLM's prompt_logprobs, checked against the same tokens scored one prefix at a time."""

import httpx
import openai
import pytest

TEXT = "The quick brown fox jumps over the lazy dog."
TOLERANCE = 1e-4  # nats, absolute; measured: 0 on the default q8_0 path, 1.1e-5 with --dtype float32


@pytest.fixture(scope="module")
def name(client) -> str:
    return client.models.list().data[0].id


@pytest.fixture(scope="module")
def ids(server) -> list[int]:
    return httpx.post(server.url + "/tokenize", json={"prompt": TEXT}).json()["tokens"]


def test_retrieve_gives_the_served_models_card_and_a_404_for_any_other(client, name):
    card = client.models.retrieve(name)
    assert card.id == name and card.object == "model" and card.model_extra["max_model_len"] > 0
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("gpt-4o")
    assert e.value.body["code"] == "model_not_found" and "gpt-4o" in e.value.body["message"]


def one_at_a_time(client, name, ids) -> list[float]:
    """Each token's logprob after the tokens before it: forced by a bias, whose logprob is of
    the distribution before it."""
    out = []
    for k in range(1, len(ids)):
        choice = client.completions.create(model=name, prompt=ids[:k], max_tokens=1, temperature=0, logprobs=0,
                                           logit_bias={str(ids[k]): 100}).choices[0]
        assert choice.logprobs.tokens[0] == choice.text  # the forced token
        out.append(choice.logprobs.token_logprobs[0])
    return out


def test_echo_with_logprobs_and_no_tokens_scores_the_prompt(client, name, ids):
    reply = client.completions.create(model=name, prompt=TEXT, echo=True, logprobs=1, max_tokens=0)
    choice = reply.choices[0]
    assert choice.text == TEXT and choice.finish_reason == "length"
    assert reply.usage.completion_tokens == 0 and reply.usage.prompt_tokens == len(ids)
    lp = choice.logprobs
    assert len(lp.tokens) == len(ids) and "".join(lp.tokens) == TEXT
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(ids))]
    assert all(len(top) == 1 and max(top.values()) >= logprob for top, logprob in zip(lp.top_logprobs[1:],
                                                                                     lp.token_logprobs[1:]))
    expected = one_at_a_time(client, name, ids)
    assert max(abs(a - b) for a, b in zip(lp.token_logprobs[1:], expected)) < TOLERANCE


def test_prompt_logprobs_come_as_vllm_gives_them(client, name, ids):
    echoed = client.completions.create(model=name, prompt=TEXT, echo=True, logprobs=0, max_tokens=0)
    choice = client.completions.create(model=name, prompt=TEXT, max_tokens=2, temperature=0,
                                       extra_body={"prompt_logprobs": 2}).choices[0]
    assert choice.text and choice.logprobs is None
    scores = choice.model_extra["prompt_logprobs"]
    assert len(scores) == len(ids) and scores[0] is None
    for token_id, entry, logprob in zip(ids[1:], scores[1:], echoed.choices[0].logprobs.token_logprobs[1:]):
        own = entry[str(token_id)]
        assert own["logprob"] == pytest.approx(logprob, abs=TOLERANCE) and own["decoded_token"]
        assert sorted(e["rank"] for e in entry.values())[:2] == [1, 2] and len(entry) in (2, 3)
        higher = sum(e["logprob"] > own["logprob"] for e in entry.values())
        assert own["rank"] == 1 + higher if own["rank"] <= 2 else higher == 2
    chat = httpx.post(client.base_url.join("chat/completions").__str__(), json={
        "messages": [{"role": "user", "content": TEXT}], "max_tokens": 1, "prompt_logprobs": 0}, timeout=60).json()
    assert len(chat["prompt_logprobs"]) == chat["usage"]["prompt_tokens"] and chat["prompt_logprobs"][0] is None
    assert all(len(entry) == 1 for entry in chat["prompt_logprobs"][1:])


def test_a_streamed_echo_starts_with_the_prompt(client, name, ids):
    whole = client.completions.create(model=name, prompt=TEXT, echo=True, logprobs=1, max_tokens=4, temperature=0)
    chunks = list(client.completions.create(model=name, prompt=TEXT, echo=True, logprobs=1, max_tokens=4,
                                            temperature=0, stream=True))
    texts = [c.choices[0].text for c in chunks if c.choices]
    assert texts[0].startswith(TEXT) and "".join(texts) == whole.choices[0].text
    tokens = [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
    assert tokens == whole.choices[0].logprobs.tokens and len(tokens) == len(ids) + 4
    offsets = [o for c in chunks if c.choices and c.choices[0].logprobs for o in c.choices[0].logprobs.text_offset]
    assert offsets == whole.choices[0].logprobs.text_offset


def test_echo_with_n_and_several_prompts_echoes_each_choices_own(client, name):
    prompts = ["Hello there", "Paris is"]
    reply = client.completions.create(model=name, prompt=prompts, n=2, echo=True, max_tokens=3, temperature=0)
    assert [c.index for c in reply.choices] == [0, 1, 2, 3]
    for choice in reply.choices:
        prompt = prompts[choice.index // 2]
        assert choice.text.startswith(prompt) and len(choice.text) > len(prompt)
    token_prompt = client.completions.create(model=name, prompt=[[9906, 1073]], echo=True, max_tokens=0)
    assert token_prompt.choices[0].text and token_prompt.usage.completion_tokens == 0


@pytest.mark.parametrize("body, param", [
    ({"prompt": TEXT, "max_tokens": 0}, "max_tokens"),
    ({"prompt": TEXT, "max_tokens": 0, "logprobs": 1}, "max_tokens"),
    ({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 0}, "max_tokens"),
    ({"messages": [{"role": "user", "content": "Hi"}], "max_completion_tokens": 0}, "max_tokens"),
    ({"prompt": TEXT, "prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
    ({"prompt": TEXT, "prompt_logprobs": 21}, "prompt_logprobs"),
    ({"prompt": TEXT, "echo": True, "max_tokens": -1}, "max_tokens"),
])
def test_what_asks_for_nothing_is_a_400_naming_the_field(server, body, param):
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    r = httpx.post(server.url + path, json=body, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param and r.json()["error"]["type"] == "invalid_request_error"
