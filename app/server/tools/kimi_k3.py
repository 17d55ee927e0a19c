"""Kimi K3's calls, in XTML: tags built of <|open|>, <|close|> and <|sep|> tokens, a call a tag
naming its tool, each argument a tag with its key and type (a string as written, anything else
as JSON), or the arguments whole as a json tag:

    <|open|>tools<|sep|><|open|>call tool="get_weather" index="1"<|sep|>
    <|open|>argument key="city" type="string"<|sep|>Paris<|close|>argument<|sep|>
    <|open|>argument key="days" type="number"<|sep|>3<|close|>argument<|sep|><|close|>call<|sep|><|close|>tools<|sep|>

(without the line breaks). The reply around them is XTML too; app/server/xtml.py reads it.
A call's arguments stream a parameter at a time (keyed.py).
"""

import html
import json
import re

import llguidance

from app.server.tools.blocks import arguments_of, bare_value, json_value
from app.server.tools.keyed import WAIT, KeyedFormat, tag_at

OPEN, CLOSE, SEP = "<|open|>", "<|close|>", "<|sep|>"
TYPES = {"string": "string", "integer": "number", "number": "number", "boolean": "boolean", "object": "object",
         "array": "array", "null": "null"}


def open_tag(tag: str, **attributes) -> str:
    return OPEN + tag + "".join(f' {k}="{escape(v)}"' for k, v in attributes.items()) + SEP


def close_tag(tag: str) -> str:
    return CLOSE + tag + SEP


def escape(value) -> str:
    """An attribute's value, as the template escapes it."""
    return str(value).replace("&", "&amp;").replace('"', "&quot;")


def xtml_type(value) -> str:
    """The type a value's argument tag names, as the template names it."""
    if isinstance(value, bool):
        return "boolean"
    if value is None:
        return "null"
    return {str: "string", dict: "object", list: "array"}.get(type(value), "number")


CALL = re.compile(re.escape(OPEN) + r'call tool="([^"]*)"[^<]*?' + re.escape(SEP) + "(.*?)" + re.escape(close_tag("call")),
                  re.S)
ARGUMENT = re.compile(re.escape(OPEN) + r'argument key="([^"]*)"(?: type="(\w+)")?' + re.escape(SEP) + "(.*?)"
                      + re.escape(close_tag("argument")), re.S)
WHOLE = re.compile(re.escape(OPEN) + r"json\b[^<]*?" + re.escape(SEP) + "(.*?)" + re.escape(close_tag("json")), re.S)


STARTS_CALL, STARTS_ARGUMENT, STARTS_WHOLE = (re.compile(r"\s*" + p.pattern, re.S) for p in (
    re.compile(re.escape(OPEN) + r'call tool="([^"]*)"[^<]*?' + re.escape(SEP)), ARGUMENT, WHOLE))


def value(text: str, kind: str | None, schema: dict):
    """An argument's text, read as its tag's type says (else as the schema says)."""
    if kind == "string":
        return text
    if kind is None:
        return bare_value(text, schema)
    found = json_value(text)
    return text if found is None and text.strip() != "null" else found


class KimiK3(KeyedFormat):
    name = "kimi_k3"
    opener, closer = open_tag("tools"), close_tag("tools")
    markers = (OPEN, CLOSE, SEP)
    call_close_text = close_tag("call")

    def starts_call(self, text):
        found = tag_at(text, STARTS_CALL, (OPEN + "call",))
        return found if found in (None, WAIT) else (html.unescape(found.group(1)), found.end())

    def next_parameter(self, text, schemas):
        whole = tag_at(text, STARTS_WHOLE, (OPEN + "json",))
        if whole not in (None, WAIT):
            arguments = arguments_of(whole.group(1))
            return None if arguments is None else (None, arguments, whole.end())
        found = tag_at(text, STARTS_ARGUMENT, (OPEN + "argument",))
        if found in (None, WAIT):
            return WAIT if WAIT in (whole, found) else None
        key, kind, raw = found.groups()
        key = html.unescape(key)
        return key, value(raw, kind or None, schemas.get(key, {})), found.end()

    def grammar(self, use):
        """Where XTML's marks are tokens, the response the calls follow too (a required call's
        is empty), and the message's close after them; the thinking before is xtml.py's."""
        if not self.opens_with_token(self.opener):
            return super().grammar(use)
        m, responded = self.marker, f"({self.marker(close_tag('response'))})?"
        response = f"TEXT? {responded}" if use.choice == "auto" else responded
        calls = f"({m(self.opener)} body)" + ("?" if use.choice == "auto" else "")
        start = f"start: {response} {calls} ({m(close_tag('message'))})?\nTEXT: /(.|\\n)+/"
        body = self.body(use.offered(), use.parallel)
        return llguidance.LLMatcher.grammar_from_lark(f"%llguidance {{}}\n{start}\n{body}\n")

    def body(self, functions, parallel):
        m = self.marker

        def head(name):
            return f"""{m(OPEN + f'call tool="{escape(name)}" index="')} INDEX {m('"' + SEP)}"""

        def key(name, schema):
            kind = TYPES.get(schema.get("type")) if isinstance(schema.get("type"), str) else None
            return f"""{m(OPEN + f'argument key="{escape(name)}" type="')} {json.dumps(kind) if kind else "TYPE"} {m('"' + SEP)}"""

        call = self.keyed_calls(functions, head, key, close_tag("argument"), m(close_tag("call")))
        more = "call*" if parallel else ""
        return f'body: call {more} {m(self.closer)}\n{call}\nINDEX: /[0-9]+/\nTYPE: /[a-z]+/'

    def read(self, body, properties):
        calls = []
        for name, inner in CALL.findall(body):
            name = html.unescape(name)
            schemas = properties.get(name, {})
            whole = WHOLE.search(inner)
            arguments = arguments_of(whole.group(1)) if whole else {
                html.unescape(k): value(text, kind or None, schemas.get(html.unescape(k), {}))
                for k, kind, text in ARGUMENT.findall(inner)}
            if arguments is None:
                return None
            calls.append((name, arguments))
        return calls or None

    def write_calls(self, calls):
        def argument(k, v):
            text = v if isinstance(v, str) else json.dumps(v, ensure_ascii=False)
            return open_tag("argument", key=k, type=xtml_type(v)) + text + close_tag("argument")
        return self.opener + "".join(open_tag("call", tool=n, index=i + 1) + "".join(argument(k, v) for k, v in a.items())
                                     + close_tag("call") for i, (n, a) in enumerate(calls)) + self.closer
