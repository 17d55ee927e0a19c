"""Hermes's format (Qwen2.5, Hermes, and the default for a template that names none):

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

several blocks one after another for parallel calls.
"""

import json

from app.server.tools.base import CallStream, JsonValueEnd, ToolFormat, call_schema, json_head, json_lark, whole_call

OPEN, CLOSE = "<tool_call>", "</tool_call>"
HEAD = json_head("arguments")


class Hermes(ToolFormat):
    name = "hermes"
    opener = OPEN
    markers = (OPEN, CLOSE)

    def body(self, functions, parallel):
        more = f'("\\n" {self.marker(OPEN)} call)*' if parallel else ""
        return f'body: call {more}\ncall: "\\n" {json_lark(call_schema(functions, "arguments"))} "\\n" {self.marker(CLOSE)}'

    def parser(self, use=None):
        return ToolCallParser()

    def how(self):
        return ("For each function call, return a json object with function name and arguments within"
                f' {OPEN}{CLOSE} XML tags:\n{OPEN}\n{{"name": <function-name>, "arguments": <args-json-object>}}\n{CLOSE}')

    def write_calls(self, calls):
        return "\n".join(f'{OPEN}\n{json.dumps({"name": n, "arguments": a}, ensure_ascii=False)}\n{CLOSE}'
                         for n, a in calls)


class ToolCallParser(CallStream):
    """Hermes blocks out of streamed text. A call written with its arguments before its name is
    released whole when its block closes; a block that is not JSON with a name stays content."""

    def __init__(self):
        super().__init__()
        self.in_block = False
        self.arguments: JsonValueEnd | None = None  # set while a call's arguments are released

    def step(self) -> bool:
        if not self.in_block:
            self.in_block = self.text_until(OPEN)
            self.arguments = None
            return self.in_block
        if self.arguments is None:
            head = HEAD.match(self.pending)
            if head:
                self.open_call(json.loads(head.group(1)))
                self.pending, self.arguments = self.pending[head.end():], JsonValueEnd()
                return True
            if CLOSE not in self.pending:
                return False
            body, self.pending = self.pending.split(CLOSE, 1)
            self.in_block = False
            call = whole_call(body)
            if call is None:
                self.content += OPEN + body + CLOSE
            else:
                self.open_call(*call)
            return True
        if not self.arguments.done:
            if not self.calls[-1]["function"]["arguments"]:  # no whitespace before the value
                self.pending = self.pending.lstrip()
            n = self.arguments.feed(self.pending)
            self.add_arguments(self.pending[:n])
            self.pending = self.pending[n:]
            return self.arguments.done
        at = self.pending.find(CLOSE)
        if at < 0:
            return False
        self.pending, self.in_block, self.arguments = self.pending[at + len(CLOSE):], False, None
        return True

    def finish(self) -> str:
        """Content still held at the end: a partial OPEN, or a block that never made a call."""
        rest, self.pending = self.pending, ""
        if self.in_block and self.arguments is None:
            return OPEN + rest
        return "" if self.in_block else rest
