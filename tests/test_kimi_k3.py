"""Kimi K3's XTML: the whole reply read apart (thinking, response, tool calls, the message's
close) over every split of the text, the calls' own forms (typed arguments, a json block,
escaped attributes), the grammars that hold a reply with its sections, and the thinking's
start and budget read from the real chat template's generation prompt."""

import json
from functools import partial

import pytest
from llama_cpp_source import chat_template
from tiny_model import make_tiny_model

from app.engine.grammar import Grammars
from app.server import reasoning, xtml
from app.server.chat_text import ChatText, Reading
from app.server.formats import json_grammar
from app.server.prompts import chat_prompt
from app.server.schemas import ChatCompletionRequest
from app.server.tools import FORMATS, ToolUse
from app.server.tools.kimi_k3 import KimiK3
from app.server.xtml import XtmlReply
from model.tokenizer import Tokenizer

MARKS = ("<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>")
NUMBER = {"type": "function", "function": {"name": "special_function", "parameters": {
    "type": "object", "properties": {"arg1": {"type": "integer"}, "arg2": {"type": "integer"}}, "required": ["arg1"]}}}
PYTHON = {"type": "function", "function": {"name": "python", "parameters": {
    "type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]}}}
TOOLS = "<|open|>tools<|sep|>"
ARG1 = '<|open|>argument key="arg1" type="number"<|sep|>1<|close|>argument<|sep|>'
CALL1 = f'<|open|>call tool="special_function" index="1"<|sep|>{ARG1}<|close|>call<|sep|>'
END = "<|close|>tools<|sep|><|close|>message<|sep|>"


@pytest.fixture(scope="module")
def tok(tmp_path_factory) -> Tokenizer:
    """Kimi K3's template over a tiny vocabulary with XTML's marks as tokens."""
    path = make_tiny_model(tmp_path_factory.mktemp("kimi_k3"), tokens=MARKS, chat_template=chat_template("Kimi-K3"))
    return Tokenizer(path)


def request(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}], **fields})


def use(*tools, tok=None, **fields) -> ToolUse | None:
    return ToolUse.of(request(tools=list(tools), **fields), KimiK3(tok)) if tools else None


def read(text: str, section: str = "think", tools=(NUMBER, PYTHON), step: int = 0) -> tuple[str, str, list]:
    """(reasoning, content, calls) as a chat reply streams them: in pieces of step characters
    (0: the whole text at once)."""
    offered = use(*tools)
    properties = {f["name"]: f["parameters"]["properties"] for f in offered.functions} if offered else {}
    chat = ChatText(Reading(offered, whole=partial(XtmlReply, section, KimiK3(), properties)))
    pieces = [text[i:i + step] for i in range(0, len(text), step)] if step else [text]
    reasoning = content = ""
    for i, piece in enumerate(pieces):
        r, c, _ = chat.feed(piece, final=i == len(pieces) - 1)
        reasoning, content = reasoning + r, content + c
    assert chat.thinks
    return reasoning, content, [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in chat.tool_calls]


@pytest.mark.parametrize("step", [0, 1, 3, 7])
def test_thinking_response_and_calls_are_read_apart(step):
    text = f"I should call it<|close|>think<|sep|><|open|>response<|sep|>On it.<|close|>response<|sep|>{TOOLS}{CALL1}{END}"
    assert read(text, step=step) == ("I should call it", "On it.", [("special_function", {"arg1": 1})])
    two = CALL1 + CALL1.replace('index="1"', 'index="2"').replace(ARG1, ARG1 + ARG1.replace("arg1", "arg2").replace(
        ">1<", ">2<"))
    text = f"<|open|>response<|sep|><|close|>response<|sep|>{TOOLS}{two}{END}"
    assert read(text, section="", step=step) == ("", "", [("special_function", {"arg1": 1}),
                                                           ("special_function", {"arg1": 1, "arg2": 2})])


@pytest.mark.parametrize("step", [0, 1, 5])
def test_a_reply_without_calls_is_its_response(step):
    assert read("Hello, world!\nWhat's up?<|close|>response<|sep|><|close|>message<|sep|><|end_of_msg|>",
                section="response", step=step) == ("", "Hello, world!\nWhat's up?", [])
    prose = "Use the response tag, then message the handler."
    assert read(f"<|open|>response<|sep|>{prose}<|close|>response<|sep|><|close|>message<|sep|>",
                section="", step=step) == ("", prose, [])
    assert read("I was still thinking when the budget ran out", step=step) == (
        "I was still thinking when the budget ran out", "", [])
    assert read("Plain text, no sections at all.", section="", step=step) == ("", "Plain text, no sections at all.", [])


def test_arguments_keep_their_types_and_forms():
    code = "print('hey') & \"quoted\" <b>"
    string = f'<|open|>call tool="python" index="1"<|sep|><|open|>argument key="code" type="string"<|sep|>{code}' \
             "<|close|>argument<|sep|><|close|>call<|sep|>"
    block = '<|open|>call tool="special_function" index="2"<|sep|><|open|>json type="object"<|sep|>' \
            '{"arg1": 5, "arg2": 6}<|close|>json<|sep|><|close|>call<|sep|>'
    _, _, calls = read(f"x<|close|>think<|sep|><|open|>response<|sep|><|close|>response<|sep|>{TOOLS}{string}{block}{END}")
    assert calls == [("python", {"code": code}), ("special_function", {"arg1": 5, "arg2": 6})]
    fmt = KimiK3()
    odd = [("python", {"code": '"a" & b'}), ("special_function", {"arg1": -3, "flags": [True, None], "opt": {"k": 1.5}})]
    written = fmt.write_calls(odd)
    assert 'key="code"' in written and 'type="array"' in written and 'type="object"' in written
    assert read(written, section="", tools=()) == ("", "", [])  # no tools offered: no calls given
    assert fmt.read(written[len(fmt.opener):-len(fmt.closer)], {}) == odd


def test_a_tools_section_that_is_not_calls_stays_content():
    text = f"<|open|>response<|sep|>Here:<|close|>response<|sep|>{TOOLS}nothing callable<|close|>tools<|sep|>"
    assert read(text, section="") == ("", f"Here:{TOOLS}nothing callable<|close|>tools<|sep|>", [])
    cut = f"<|open|>response<|sep|><|close|>response<|sep|>{TOOLS}{CALL1[:30]}"
    assert read(cut, section="") == ("", TOOLS + CALL1[:30], [])


def accepts(grammars, grammar: str, tok, text: str) -> bool:
    matcher = grammars.matcher(grammar)
    ids = tok.encode(text, add_special_tokens=False)
    return matcher.try_consume_tokens(ids) == len(ids) and matcher.is_accepting()


def test_the_grammars_hold_the_calls_inside_the_reply(tok):
    grammars = Grammars(tok)
    thought = "Let me think.<|close|>think<|sep|><|open|>response<|sep|>"
    auto = xtml.after_thought(tok, use(NUMBER, tok=tok).grammar(), "think", tools=True)
    assert accepts(grammars, auto, tok, f"{thought}On it.<|close|>response<|sep|>{TOOLS}{CALL1}{END}")
    assert accepts(grammars, auto, tok, f"{thought}Just text.<|close|>response<|sep|><|close|>message<|sep|>")
    assert not accepts(grammars, auto, tok, f"Thinking skipped.<|close|>response<|sep|>{TOOLS}{CALL1}{END}")
    bad = CALL1.replace(">1<", ">one<")
    assert not accepts(grammars, auto, tok, f"{thought}<|close|>response<|sep|>{TOOLS}{bad}{END}")
    required = use(NUMBER, tok=tok, tool_choice="required").grammar()
    for section, head in (("think", thought), ("response", ""), ("", "<|open|>response<|sep|>")):
        grammar = xtml.after_thought(tok, required, section, tools=True)
        assert accepts(grammars, grammar, tok, f"{head}<|close|>response<|sep|>{TOOLS}{CALL1}{END}")
        assert accepts(grammars, grammar, tok, f"{head}{TOOLS}{CALL1}<|close|>tools<|sep|>")
        assert not accepts(grammars, grammar, tok, f"{head}Chat instead.<|close|>response<|sep|><|close|>message<|sep|>")
    assert not accepts(grammars, xtml.after_thought(tok, required, "response", tools=True), tok, thought)
    answer = xtml.after_thought(tok, json_grammar({"type": "object", "required": ["a"], "properties": {
        "a": {"type": "integer"}}}, "response_format"), "think")
    assert accepts(grammars, answer, tok, f'{thought}{{"a": 1}}<|close|>response<|sep|><|close|>message<|sep|>')
    assert not accepts(grammars, answer, tok, f'{thought}{{"a": "x"}}<|close|>response<|sep|>')


def test_the_template_opens_the_thinking_and_the_budget_closes_it(tok):
    assert reasoning.detect(tok) == reasoning.XTML and FORMATS["kimi_k3"].name == "kimi_k3"
    messages = request().messages
    thinking = chat_prompt(tok, messages, None, True, {})
    off = chat_prompt(tok, messages, None, True, {"thinking": False})
    assert xtml.opened(tok, thinking) == "think" and xtml.opened(tok, off) == "response"
    budget = reasoning.budget(reasoning.XTML, tok, thinking, 16)
    assert tok.decode(list(budget.end_ids), skip_special_tokens=False) == "<|close|>think<|sep|><|open|>response<|sep|>"
    assert budget.start_ids == () and reasoning.budget(reasoning.XTML, tok, off, 16).start_ids


def test_the_reply_reader_streams_a_calls_arguments():
    properties = {"special_function": NUMBER["function"]["parameters"]["properties"]}
    reader = XtmlReply("response", KimiK3(), properties)
    two = ARG1 + ARG1.replace("arg1", "arg2").replace(">1<", ">2<")
    text = f"On it.<|close|>response<|sep|>{TOOLS}" + CALL1.replace(ARG1, two) + END
    cut = text.index("arg2")
    content, chunks = reader.feed(text[:cut])
    assert content == "On it." and chunks[0]["function"]["name"] == "special_function"
    assert "".join(c["function"].get("arguments", "") for c in chunks) == '{"arg1": 1'
    content, more = reader.feed(text[cut:])
    assert content == "" and reader.finish() == ""
    assert json.loads(reader.calls[0]["function"]["arguments"]) == {"arg1": 1, "arg2": 2}
