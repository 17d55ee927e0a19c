"""Mistral's calls, after a [TOOL_CALLS] token: a JSON list,

    [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": ...}]

or, in the newer templates (those that write [ARGS]), each call on its own:

    [TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]{}

(Mistral Small 3.2's template writes an earlier call's id between: name[CALL_ID]id[ARGS]).
"""

import json

from app.server.tools.base import (JsonCalls, JsonValueEnd, ToolFormat, call_schema, json_lark, nine_alphanumerics,
                                   parameters)

TOOL_CALLS, ARGS, CALL_ID = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"


class Mistral(ToolFormat):
    name = "mistral"
    opener = TOOL_CALLS
    markers = (TOOL_CALLS, ARGS)

    def __init__(self, tokenizer=None, args_marker: bool | None = None):
        super().__init__(tokenizer)
        template = getattr(tokenizer, "chat_template_source", "")
        self.args_marker = ARGS in template if args_marker is None else args_marker

    def body(self, functions, parallel):
        if not self.args_marker:
            calls = {"type": "array", "minItems": 1, "items": call_schema(functions, "arguments")}
            return f"body: {json_lark(calls if parallel else {**calls, 'maxItems': 1})}"
        each = " | ".join(f"{json.dumps(f['name'])} {self.marker(ARGS)} {json_lark(parameters(f))}" for f in functions)
        more = f" ({self.marker(TOOL_CALLS)} call)*" if parallel else ""
        return f"body: call{more}\ncall: {each}"

    def parser(self, use=None):
        return MistralParser()

    def template_id(self, given: str) -> str:
        return nine_alphanumerics(given)

    def write_calls(self, calls):
        if self.args_marker:
            return "".join(f"{TOOL_CALLS}{n}{ARGS}{json.dumps(a, ensure_ascii=False)}" for n, a in calls)
        return TOOL_CALLS + json.dumps([{"name": n, "arguments": a} for n, a in calls], ensure_ascii=False)


class MistralParser(JsonCalls):
    """Either form: after [TOOL_CALLS], a "[" opens a list; anything else is a name up to [ARGS]."""

    separator, end = ",", "]"
    new_id = staticmethod(nine_alphanumerics)

    def __init__(self):
        super().__init__()
        self.bare = False  # the newer form: arguments with no call object around them

    def begin(self) -> bool:
        if not self.text_until(TOOL_CALLS):
            return False
        self.opened, self.state = TOOL_CALLS, "open"
        return True

    def step(self) -> bool:
        if self.state == "open":
            rest = self.pending.lstrip()
            if not rest:
                return False
            if rest[0] == "[":
                self.opened, self.pending, self.state = TOOL_CALLS + "[", rest[1:], "head"
                return True
            if ARGS not in rest:
                return False
            name, self.pending = rest.split(ARGS, 1)
            self.open_call(name.split(CALL_ID)[0].strip())
            self.state, self.value, self.bare = "args", JsonValueEnd(), True
            return True
        going = super().step()
        if self.state == "close" and self.bare:
            self.state = "text"
        return going

    def finish(self) -> str:
        if self.state == "open":
            rest, self.pending = self.pending, ""
            return self.opened + rest
        return super().finish()
