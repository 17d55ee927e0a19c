"""Tool calling: the tools into the prompt, the calls out of the model's text, and the grammar
that keeps a call valid.

Calls travel in the model's text the way Hermes and Qwen models write them:

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

A chat template that knows tools (its source mentions them) gets them as transformers passes
them: `tools=[...]`, and assistant tool_calls with their arguments as objects. For one that does
not, such as the default model's, SYSTEM_BLOCK describes the tools in a system message, earlier
calls are written as the blocks above and tool results as user messages in <tool_response> tags.

tool_choice, as vLLM reads it: "none" leaves the tools out of the prompt; "required" and a named
function hold the output to call blocks (several when parallel_tool_calls, else one); "auto"
lets the model write text, and once it opens a block a lazy grammar holds the call to the
functions' schemas, so every call made parses and validates. The finish reason is "tool_calls"
when calls were made, except for a named function, which ends "stop" as OpenAI's does.
"""

import json
import re
import secrets
from dataclasses import dataclass

import llguidance

from app.server.errors import APIError
from app.server.formats import JSON_WHITESPACE

OPEN, CLOSE = "<tool_call>", "</tool_call>"

SYSTEM_BLOCK = """You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{tools}
</tools>

For each function call, return a json object with function name and arguments within \
<tool_call></tool_call> XML tags:
<tool_call>
{{"name": <function-name>, "arguments": <args-json-object>}}
</tool_call>"""

NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}


@dataclass
class ToolUse:
    """What a chat request asks of tools: the functions, and how the model may call them."""

    functions: list[dict]  # OpenAI's function objects: name, description, parameters
    choice: str  # "auto", "required" or "named"
    named: str | None = None
    parallel: bool = True

    @classmethod
    def of(cls, req) -> "ToolUse | None":
        """None when the request offers no tools or says tool_choice "none"; a 400 for a
        tool_choice that cannot be met."""
        choice = req.tool_choice
        if not req.tools:
            if choice not in (None, "none", "auto"):
                raise APIError(400, "tool_choice needs tools", param="tool_choice")
            return None
        if choice == "none":
            return None
        functions = [tool.function.model_dump(exclude_none=True) for tool in req.tools]
        names = [f["name"] for f in functions]
        if len(set(names)) < len(names):
            raise APIError(400, "two tools have the same name", param="tools")
        if choice in (None, "auto", "required"):
            return cls(functions, choice or "auto", parallel=req.parallel_tool_calls)
        if choice.function.name not in names:
            raise APIError(400, f"tool_choice names {choice.function.name!r}, which is not among the tools",
                           param="tool_choice")
        return cls(functions, "named", named=choice.function.name, parallel=False)

    def finish_reason(self, reason: str, called: bool) -> str:
        if called and reason == "stop" and self.choice != "named":
            return "tool_calls"
        return reason

    def grammar(self) -> str:
        """llguidance Lark: call blocks whose JSON follows the functions' schemas."""
        functions = [f for f in self.functions if self.choice != "named" or f["name"] == self.named]
        calls = [{"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
                  "properties": {"name": {"const": f["name"]}, "arguments": f.get("parameters") or NO_PARAMETERS}}
                 for f in functions]
        schema = calls[0] if len(calls) == 1 else {"anyOf": calls}
        schema = {**schema, "x-guidance": {"whitespace_pattern": JSON_WHITESPACE}}
        more = f'("\\n" "{OPEN}" body)*' if self.parallel else ""
        if self.choice == "auto":  # free text, until the model opens a block
            start = f'start: TEXT | opened body {more}\nopened[lazy]: TEXT "{OPEN}"\nTEXT: /(.|\\n)*/'
        else:
            start = f'start: "{OPEN}" body {more}'
        lark = f'%llguidance {{}}\n{start}\nbody: "\\n" %json {json.dumps(schema)} "\\n{CLOSE}"\n'
        return llguidance.LLMatcher.grammar_from_lark(lark)  # the engine compiles it, or refuses it


def prompt_messages(messages: list[dict], tools: ToolUse | None, template_takes_tools: bool) -> tuple[list, dict]:
    """The messages and extra template variables for a chat with tools, or with earlier calls
    and tool results in its history."""
    if template_takes_tools:
        out = [{**m, "tool_calls": [_with_object_arguments(c) for c in m["tool_calls"]]} if m.get("tool_calls") else m
               for m in messages]
        return out, ({"tools": [{"type": "function", "function": f} for f in tools.functions]} if tools else {})
    out = []
    for m in messages:
        if m.get("tool_calls"):
            blocks = [f'{OPEN}\n{json.dumps(_call_json(c), ensure_ascii=False)}\n{CLOSE}' for c in m["tool_calls"]]
            out.append({"role": "assistant", "content": "\n".join(filter(None, [m.get("content")] + blocks))})
        elif m["role"] == "tool":
            out.append({"role": "user", "content": f'<tool_response>\n{m.get("content") or ""}\n</tool_response>'})
        else:
            out.append(m)
    if tools:
        block = SYSTEM_BLOCK.format(tools="\n".join(json.dumps({"type": "function", "function": f}, ensure_ascii=False)
                                                    for f in tools.functions))
        if out and out[0]["role"] in ("system", "developer"):
            out[0] = {**out[0], "content": f'{out[0]["content"]}\n\n{block}'}
        else:
            out.insert(0, {"role": "system", "content": block})
    return out, {}


def _arguments(call: dict):
    args = call.get("function", {}).get("arguments", "{}")
    if isinstance(args, str):
        try:
            return json.loads(args)
        except ValueError:
            raise APIError(400, "an assistant tool call's arguments are not valid JSON", param="messages") from None
    return args


def _with_object_arguments(call: dict) -> dict:
    return {**call, "function": {**call.get("function", {}), "arguments": _arguments(call)}}


def _call_json(call: dict) -> dict:
    return {"name": call.get("function", {}).get("name", ""), "arguments": _arguments(call)}


HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"arguments"\s*:\s*')


def partial_tag(text: str, tag: str) -> int:
    """How many characters at the end of text may be the start of tag (held until clear)."""
    return next((n for n in range(min(len(tag) - 1, len(text)), 0, -1) if tag.startswith(text[-n:])), 0)


def call_id() -> str:
    return f"call_{secrets.token_hex(12)}"


class JsonValueEnd:
    """Where one JSON value ends, in text that arrives in pieces."""

    def __init__(self):
        self.depth, self.in_string, self.escape, self.done = 0, False, False, False

    def feed(self, text: str) -> int:
        """How many leading characters of text belong to the value."""
        for i, ch in enumerate(text):
            if self.in_string:
                if self.escape:
                    self.escape = False
                elif ch == "\\":
                    self.escape = True
                elif ch == '"':
                    self.in_string = False
                    if self.depth == 0:
                        self.done = True
                        return i + 1
            elif ch == '"':
                self.in_string = True
            elif ch in "{[":
                self.depth += 1
            elif ch in "}]" or (self.depth == 0 and ch in ", \t\r\n"):
                if self.depth == 0:  # the end of a bare number, true, false or null
                    self.done = True
                    return i
                self.depth -= 1
                if self.depth == 0:
                    self.done = True
                    return i + 1
        return len(text)


class ToolCallParser:
    """Splits one choice's text, as it streams, into content and tool calls.

    feed() returns what a piece of text settles: content, and OpenAI's tool call chunks (the
    first of a call has its id, type and name; then the arguments follow as they are written).
    Text that may be the start of a block is held until it is clear. A call written with its
    arguments before its name is released whole when its block closes; a block that is not
    JSON with a name stays content.
    """

    def __init__(self):
        self.pending = ""
        self.in_block = False
        self.arguments: JsonValueEnd | None = None  # set while a call's arguments are released
        self.calls: list[dict] = []  # OpenAI's tool call objects, arguments as written so far

    def feed(self, text: str) -> tuple[str, list[dict]]:
        self.pending += text
        content, chunks = "", []
        while True:
            if not self.in_block:
                at = self.pending.find(OPEN)
                if at < 0:
                    keep = partial_tag(self.pending, OPEN)
                    content += self.pending[:len(self.pending) - keep]
                    self.pending = self.pending[len(self.pending) - keep:]
                    return content, chunks
                content += self.pending[:at]
                self.pending, self.in_block, self.arguments = self.pending[at + len(OPEN):], True, None
            elif self.arguments is None:
                head = HEAD.match(self.pending)
                if head:
                    chunks.append(self._open(json.loads(head.group(1)), ""))
                    self.pending, self.arguments = self.pending[head.end():], JsonValueEnd()
                elif CLOSE in self.pending:
                    body, self.pending = self.pending.split(CLOSE, 1)
                    self.in_block = False
                    call = _whole_call(body)
                    if call is None:
                        content += OPEN + body + CLOSE
                    else:
                        chunks.append(self._open(*call))
                else:
                    return content, chunks
            elif not self.arguments.done:
                if not self.calls[-1]["function"]["arguments"]:  # no whitespace before the value
                    self.pending = self.pending.lstrip()
                n = self.arguments.feed(self.pending)
                piece, self.pending = self.pending[:n], self.pending[n:]
                if piece:
                    self.calls[-1]["function"]["arguments"] += piece
                    chunks.append({"index": len(self.calls) - 1, "function": {"arguments": piece}})
                if not self.arguments.done:
                    return content, chunks
            else:
                at = self.pending.find(CLOSE)
                if at < 0:
                    return content, chunks
                self.pending, self.in_block, self.arguments = self.pending[at + len(CLOSE):], False, None

    def finish(self) -> str:
        """Content still held at the end: a partial OPEN, or a block that never made a call."""
        rest, self.pending = self.pending, ""
        if self.in_block and self.arguments is None:
            return OPEN + rest
        return "" if self.in_block else rest

    def _open(self, name: str, arguments: str) -> dict:
        call = {"id": call_id(), "type": "function", "function": {"name": name, "arguments": arguments}}
        self.calls.append(call)
        return {"index": len(self.calls) - 1, **call, "function": dict(call["function"])}


def _whole_call(body: str) -> tuple[str, str] | None:
    try:
        call = json.loads(body)
    except ValueError:
        return None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return None
    args = call.get("arguments", call.get("parameters", {}))
    return call["name"], json.dumps(args, ensure_ascii=False)
