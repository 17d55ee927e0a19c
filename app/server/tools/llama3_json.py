"""Llama 3.x's JSON calls: a reply that begins with a call object (after <|python_tag|> or not)
is calls, several separated by ";":

    <|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": ...}

A reply that begins otherwise is text, as vLLM's llama3_json parser reads it.
"""

import json

import llguidance

from app.server.tools.base import JsonCalls, ToolFormat, call_schema, json_head, json_lark

TAG = "<|python_tag|>"


class Llama3Json(ToolFormat):
    name = "llama3_json"
    opener = TAG
    markers = (TAG,)

    def grammar(self, use):
        call = json_lark(call_schema(use.offered(), "parameters"))
        calls = f'call ("; " call)*' if use.parallel else "call"
        tag = f"{self.marker(TAG)}?"
        # auto: text that does not begin with "{" (nor the tag, where it is a token of its own), or calls
        start = f"start: {tag} calls" if use.choice != "auto" else f"start: TEXT | {tag} calls\nTEXT: /([^{{](.|\\n)*)?/"
        return llguidance.LLMatcher.grammar_from_lark(f"%llguidance {{}}\n{start}\ncalls: {calls}\ncall: {call}\n")

    def parser(self, use=None):
        return Llama3Parser()

    def write_calls(self, calls):
        return TAG + "; ".join(json.dumps({"name": n, "parameters": a}, ensure_ascii=False) for n, a in calls)


class Llama3Parser(JsonCalls):
    head_pattern = json_head("parameters|arguments")
    separator = ";"

    def begin(self) -> bool:
        rest = self.pending.lstrip()
        if not rest or (TAG.startswith(rest) and rest != TAG):
            return False  # the start is not clear yet
        if rest.startswith(TAG):
            self.opened, self.pending, self.state = TAG, rest[len(TAG):], "head"
        elif rest[0] == "{":
            self.pending, self.state = rest, "head"
        else:
            self.content, self.pending, self.state = self.pending, "", "after"
        return self.state == "head"
