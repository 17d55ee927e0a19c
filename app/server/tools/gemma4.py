"""Gemma 4's calls: call:NAME and the arguments in braces, keys bare, strings between <|"|>
tokens, anything else as it is spelled:

    <|tool_call>call:get_weather{city:<|"|>Paris<|"|>,days:3}<tool_call|>

A call's arguments stream a parameter at a time (keyed.py).
"""

import json
import re

from app.server.tools.base import json_lark
from app.server.tools.blocks import json_value
from app.server.tools.keyed import WAIT, KeyedFormat

OPEN, CLOSE, QUOTE = "<|tool_call>", "<tool_call|>", '<|"|>'
CALL = re.compile(r"call:([^{\s<]+)\{")
KEY = re.compile(r"\s*,?\s*([^:{}\s,<]+):")


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
            if at >= len(text):
                raise ValueError("the value is not closed")
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


class Gemma4(KeyedFormat):
    name = "gemma4"
    opener, closer = OPEN, CLOSE
    markers = (OPEN, CLOSE, QUOTE)
    call_close_text = "}" + CLOSE

    def starts_call(self, text):
        found = CALL.match(text)
        if found:
            return found.group(1), found.end()
        return WAIT if "call:".startswith(text) or re.fullmatch(r"call:[^{\s<]*", text) else None

    def next_parameter(self, text, schemas):
        """A key and its value, once what follows the value (a comma, or the call's brace) is written."""
        found = KEY.match(text)
        if not found:
            return WAIT if re.fullmatch(r"\s*,?\s*[^:{}\s,<]*", text) else None
        try:
            value, end = read_value(text, found.end())
        except (ValueError, IndexError):
            return WAIT  # the value not whole yet (or never: the block's end reads it whole)
        if end >= len(text) or text[end] not in ",}":
            return WAIT if end >= len(text) else None
        return found.group(1), value, end

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
        body = body.strip()
        found = CALL.match(body)
        if not found:
            return None
        try:
            arguments, end = read_value(body, found.end() - 1)
        except (ValueError, IndexError):
            return None
        return [(found.group(1), arguments)] if isinstance(arguments, dict) and not body[end:].strip() else None

    def write_calls(self, calls):
        return "".join(f"{OPEN}call:{n}{gemma(a)}{CLOSE}" for n, a in calls)
