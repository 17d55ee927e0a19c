"""A reasoning model's thinking: returned as reasoning_content, streamed and not, and cut by
max_thinking_tokens (the engine forces </think>). A tiny model with <think> tokens stands in."""

import json

import httpx
import pytest

from app.server.reasoning import ReasoningParser
from model.tokenizer import Tokenizer
from live_server import LiveServer
from tiny_model import THINKING_CHATML as CHATML_OPENING_THINK, make_tiny_model


def split(inside: bool, pieces: list[str]) -> tuple[str, str]:
    parser, reasoning, content = ReasoningParser(inside), "", ""
    for piece in pieces:
        r, c = parser.feed(piece)
        reasoning, content = reasoning + r, content + c
    r, c = parser.finish()
    return reasoning + r, content + c


@pytest.mark.parametrize("inside, text, expected", [
    (True, "weigh it up</think>The answer.", ("weigh it up", "The answer.")),
    (True, "still thinking </thi", ("still thinking </thi", "")),  # cut off while thinking
    (False, "\n<think>hmm</think>\nYes.", ("hmm", "\nYes.")),
    (False, "No thinking here. </think>", ("", "No thinking here. </think>")),
    (False, "<thin", ("", "<thin")),
])
def test_every_split_of_the_text_gives_the_same_reasoning_and_content(inside, text, expected):
    assert split(inside, [text]) == expected
    for cut in range(1, len(text)):
        assert split(inside, [text[:cut], text[cut:]]) == expected
    assert split(inside, list(text)) == expected


@pytest.mark.parametrize("inside, text, expected", [
    (True, "weigh it up[/THINK]The answer.", ("weigh it up", "The answer.")),
    (False, "[THINK]hmm[/THINK]Yes.", ("hmm", "Yes.")),
    (False, "<think>not Mistral's</think>", ("", "<think>not Mistral's</think>")),
])
def test_mistral_tags_split_alike(inside, text, expected):
    """Magistral's and Ministral 3's [THINK] ... [/THINK], cut anywhere."""
    def split_mistral(pieces):
        parser, reasoning, content = ReasoningParser(inside, ("[THINK]", "[/THINK]")), "", ""
        for piece in [*pieces, None]:
            r, c = parser.feed(piece) if piece is not None else parser.finish()
            reasoning, content = reasoning + r, content + c
        return reasoning, content

    for cut in range(len(text)):
        assert split_mistral([text[:cut], text[cut:]]) == expected


def test_a_mistral_reasoning_model_thinks_in_its_own_tags(tmp_path):
    """A vocabulary with [THINK] and [/THINK] (and no <think>): they are its tags, the budget
    closes with [/THINK], and the reply splits at it."""
    template = CHATML_OPENING_THINK.replace("<think>", "[THINK]")
    model = make_tiny_model(tmp_path / "mistral-thinking", tokens=("[THINK]", "[/THINK]"), chat_template=template)
    assert Tokenizer(model).think_tags == ("[THINK]", "[/THINK]")
    s = LiveServer("--model", str(model), "--kv-cache-gib", "0.05")
    try:
        choice = chat(s, max_thinking_tokens=4)
        assert tokens(choice)[4] == "[/THINK]"
        assert choice["message"]["reasoning_content"] and choice["message"]["content"]
        assert "[/THINK]" not in choice["message"]["reasoning_content"] + choice["message"]["content"]
    finally:
        assert s.stop() == 0, s.output()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model = make_tiny_model(tmp_path_factory.mktemp("tiny-thinking"), thinking=True)
    s = LiveServer("--model", str(model), "--kv-cache-gib", "0.05")
    s.model = model
    yield s
    assert s.stop() == 0, s.output()


def chat(server, **body) -> dict:
    body = {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 30, "seed": 1,
            "logprobs": True, "ignore_eos": True, **body}
    r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


def tokens(choice) -> list[str]:
    return [entry["token"] for entry in choice["logprobs"]["content"]]


def test_max_thinking_tokens_ends_the_thinking_the_template_opened(server):
    choice = chat(server, max_thinking_tokens=5)
    assert tokens(choice)[5] == "</think>" and "</think>" not in tokens(choice)[:5]
    message = choice["message"]
    assert message["reasoning_content"] and message["content"] and "</think>" not in message["reasoning_content"]
    free = chat(server)  # no budget: this random model does not close its thinking in 30 tokens
    assert "</think>" not in tokens(free)
    assert free["message"]["reasoning_content"] and free["message"]["content"] == ""


def test_a_thinking_the_model_opens_is_cut_too(server):
    """With the template's <think> left out (add_generation_prompt off, the prompt ends at the
    assistant tag), the budget counts from the model's own <think>."""
    think = Tokenizer(server.model).think_ids[0]
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": ""}]
    choice = chat(server, messages=messages, add_generation_prompt=False, max_thinking_tokens=3,
                  logit_bias={str(think): 100})  # every token <think>, except the forced end
    assert tokens(choice)[:6] == ["<think>"] * 4 + ["</think>", "<think>"]
    assert choice["message"]["reasoning_content"] == "<think>" * 3
    assert choice["message"]["content"].startswith("<think>")


def test_the_stream_carries_reasoning_then_content(server):
    body = {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 20, "seed": 2, "ignore_eos": True,
            "max_thinking_tokens": 4, "stream": True}
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=60) as r:
        deltas = [json.loads(line[6:])["choices"][0]["delta"] for line in r.iter_lines()
                  if line.startswith("data: {")]
    reasoning = "".join(d.get("reasoning_content") or "" for d in deltas)
    content = "".join(d.get("content") or "" for d in deltas)
    whole = chat(server, **{k: v for k, v in body.items() if k != "stream"}, logprobs=False)
    assert (reasoning, content) == (whole["message"]["reasoning_content"], whole["message"]["content"])
    assert reasoning and content
    first_content = next(i for i, d in enumerate(deltas) if d.get("content"))
    assert not any(d.get("reasoning_content") for d in deltas[first_content:])


@pytest.mark.parametrize("opened_by", ["template", "model"])
def test_an_output_format_applies_to_the_answer_after_the_thinking(server, opened_by):
    body = {"response_format": {"type": "json_schema", "json_schema": {"name": "yes_no", "schema": {
        "type": "string", "enum": ["yes", "no"]}}}, "max_thinking_tokens": 4}
    if opened_by == "model":  # the prompt ends at the assistant tag; a bias makes the model open the thinking
        think = Tokenizer(server.model).think_ids[0]
        body.update(messages=[{"role": "user", "content": "Hi"}, {"role": "assistant", "content": ""}],
                    add_generation_prompt=False, logit_bias={str(think): 5})
    choice = chat(server, **body, ignore_eos=False)
    assert "</think>" in tokens(choice)
    assert choice["message"]["reasoning_content"] and choice["message"]["content"] in ('"yes"', '"no"')
    assert choice["finish_reason"] == "stop"


def test_thinking_tags_that_are_plain_text_bound_the_thought_by_their_bytes(tiny_dir):
    """For a vocabulary where </think> is ordinary text (no added token), the thought is a lazy
    lexeme that ends at the first </think>."""
    from types import SimpleNamespace

    import llguidance

    from app.engine.grammar import Grammars
    from app.server.reasoning import after_thinking

    grammars = Grammars(Tokenizer(tiny_dir))
    text_tags = SimpleNamespace(think_ids=(0, 0), think_tags=("<think>", "</think>"),
                                hf=SimpleNamespace(get_added_tokens_decoder=dict))
    answer = llguidance.LLMatcher.grammar_from_regex("(yes|no)")

    def accepts(inside: bool, text: str) -> bool:
        matcher = grammars.matcher(after_thinking(text_tags, answer, inside))
        ids = grammars.tokenizer.encode(text, add_special_tokens=False)
        return matcher.try_consume_tokens(ids) == len(ids) and matcher.is_accepting()

    assert accepts(True, "weigh it up</think>yes") and not accepts(True, "weigh it up</think>maybe")
    assert not accepts(True, "no")  # the thinking was opened: it must close first
    assert accepts(False, "no") and accepts(False, "<think>hmm</think>yes") and not accepts(False, "hmm</think>yes")
