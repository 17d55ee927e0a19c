"""Calls written as a Python list of calls with keyword arguments (vLLM's pythonic: Llama 3.2's
and 4's prompts, Gemma 3's, and LFM2's, between its markers):

    [get_weather(city="Paris", days=3), get_time()]
    <|tool_call_start|>[get_weather(city="Paris")]<|tool_call_end|>

Bare, a reply that begins with "[" is calls, as vLLM reads it; values are Python literals (JSON's
true, false and null read too).
"""

import ast
import json

import llguidance

from app.server.tools.blocks import BlockFormat

LFM_OPEN, LFM_CLOSE = "<|tool_call_start|>", "<|tool_call_end|>"
LFM_SIGNS = (LFM_OPEN, "<|tool_list_start|>", "List of tools: [")  # an LFM2 template
NAMES = {"true": True, "false": False, "null": None, "True": True, "False": False, "None": None}


def literal(node):
    """The value a Python (or JSON) literal spells; ValueError for anything else."""
    if isinstance(node, ast.Name) and node.id in NAMES:
        return NAMES[node.id]
    if isinstance(node, (ast.List, ast.Tuple)):
        return [literal(e) for e in node.elts]
    if isinstance(node, ast.Dict):
        return {literal(k): literal(v) for k, v in zip(node.keys, node.values)}
    return ast.literal_eval(node)


def python(value) -> str:
    if isinstance(value, bool) or value is None:
        return repr(value)
    if isinstance(value, dict):
        return "{" + ", ".join(f"{python(k)}: {python(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ", ".join(python(v) for v in value) + "]"
    return json.dumps(value, ensure_ascii=False)  # a string in double quotes, or a number


class Pythonic(BlockFormat):
    name = "pythonic"

    def __init__(self, tokenizer=None, wrapped: bool | None = None):
        super().__init__(tokenizer)
        template = getattr(tokenizer, "chat_template_source", "")
        self.wrapped = any(sign in template for sign in LFM_SIGNS) if wrapped is None else wrapped
        self.opener, self.closer = (LFM_OPEN, LFM_CLOSE) if self.wrapped else ("[", "")
        self.markers = (LFM_OPEN, LFM_CLOSE) if self.wrapped else ()

    def grammar(self, use):
        if self.wrapped:
            return super().grammar(use)
        body = self.body(use.offered(), use.parallel)
        start = 'start: "[" body' if use.choice != "auto" else 'start: TEXT | "[" body\nTEXT: /([^\\[](.|\\n)*)?/'
        return llguidance.LLMatcher.grammar_from_lark(f"%llguidance {{}}\n{start}\n{body}\n")

    def body(self, functions, parallel):
        call = self.keyed_calls(functions, lambda name: json.dumps(name + "("), lambda key, _: json.dumps(key + "="),
                                "", '")"', between='", "', bare=False)
        more = '(", " call)*' if parallel else ""
        end = f'"]" {self.marker(LFM_CLOSE)}' if self.wrapped else '"]"'
        lead = '"[" ' if self.wrapped else ""  # bare, the "[" is the opener
        return f"body: {lead}call {more} {end}\n{call}"

    def block_end(self, text):
        if self.closer:
            return super().block_end(text)
        for i, ch in enumerate(text):
            if ch == "]":
                try:
                    ast.parse("[" + text[:i + 1], mode="eval")
                    return i + 1
                except SyntaxError:
                    continue
        return None

    def read(self, body, properties):
        try:
            tree = ast.parse((body if self.wrapped else "[" + body).strip(), mode="eval").body
            if not isinstance(tree, ast.List) or not tree.elts:
                return None
            calls = []
            for call in tree.elts:
                if not isinstance(call, ast.Call) or not isinstance(call.func, ast.Name) or call.args:
                    return None
                calls.append((call.func.id, {k.arg: literal(k.value) for k in call.keywords}))
            return calls
        except (SyntaxError, ValueError, TypeError):
            return None

    def write_calls(self, calls):
        text = "[" + ", ".join(f"{n}({', '.join(f'{k}={python(v)}' for k, v in a.items())})" for n, a in calls) + "]"
        return f"{LFM_OPEN}{text}{LFM_CLOSE}" if self.wrapped else text
