"""Gemma 4's calls: call:NAME and the arguments in braces, keys bare, strings between <|"|>
tokens, anything else as it is spelled:

    <|tool_call>call:get_weather{city:<|"|>Paris<|"|>,days:3}<tool_call|>
"""

import json

from app.server.tools.base import json_lark
from app.server.tools.blocks import BlockFormat, json_value

OPEN, CLOSE, QUOTE = "<|tool_call>", "<tool_call|>", '<|"|>'


def gemma(value) -> str:
    if isinstance(value, str):
        return QUOTE + value + QUOTE
    if isinstance(value, dict):
        return "{" + ",".join(f"{k}:{gemma(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ",".join(gemma(v) for v in value) + "]"
    return json.dumps(value)


def read_value(text: str, at: int):
    """(the value written at text[at:], where it ends); ValueError where it is not one."""
    if text.startswith(QUOTE, at):
        end = text.index(QUOTE, at + len(QUOTE))
        return text[at + len(QUOTE):end], end + len(QUOTE)
    if text.startswith('"', at):
        return json.JSONDecoder().raw_decode(text, at)
    if text.startswith("{", at) or text.startswith("[", at):
        pairs, closing, at = text[at] == "{", "}" if text[at] == "{" else "]", at + 1
        out = {} if pairs else []
        while not text.startswith(closing, at):
            if pairs:
                colon = text.index(":", at)
                key, (value, at) = text[at:colon].strip().strip('"'), read_value(text, colon + 1)
                out[key] = value
            else:
                value, at = read_value(text, at)
                out.append(value)
            at += 1 if text.startswith(",", at) else 0
        return out, at + 1
    end = min((i for i in (text.find(c, at) for c in ",}]") if i >= 0), default=len(text))
    word = text[at:end].strip()
    value = json_value(word)
    return (word if value is None and word != "null" else value), end


class Gemma4(BlockFormat):
    name = "gemma4"
    opener, closer = OPEN, CLOSE
    markers = (OPEN, CLOSE, QUOTE)

    def value_rule(self, rule, schema, end):
        if schema.get("type") == "string":
            return super().value_rule(rule, schema, end)
        return [f"{rule}: {json_lark(schema)}"]

    def body(self, functions, parallel):
        def key(name, schema):
            return json.dumps(f"{name}:") + (f" {self.marker(QUOTE)}" if schema.get("type") == "string" else "")
        call = self.keyed_calls(functions, lambda name: json.dumps(f"call:{name}{{"), key, QUOTE, '"}"', between='","')
        more = f"({self.marker(OPEN)} call {self.marker(CLOSE)})*" if parallel else ""
        return f"body: call {self.marker(CLOSE)} {more}\n{call}"

    def read(self, body, properties):
        name, brace, rest = body.strip().removeprefix("call:").partition("{")
        try:
            arguments, end = read_value(brace + rest, 0)
        except (ValueError, IndexError):
            return None
        return [(name.strip(), arguments)] if name.strip() and not (brace + rest)[end:].strip() else None

    def write_calls(self, calls):
        return "".join(f"{OPEN}call:{n}{gemma(a)}{CLOSE}" for n, a in calls)
