"""MiniMax M3's calls: XML invocations in a tool_call block, every tag after the namespace
marker ]<]minimax[>[, each parameter a tag of its own name, and nested objects and lists
written out as tags too (a list's members as <item>):

    ]<]minimax[>[<tool_call>
    ]<]minimax[>[<invoke name="get_weather">]<]minimax[>[<city>Paris]<]minimax[>[</city>]<]minimax[>[</invoke>
    ]<]minimax[>[</tool_call>

A leaf's text is typed by the tool's schema: a string as written, anything else as the JSON
it spells. A null is left out, as the template leaves it out. A call's arguments stream a
parameter at a time (keyed.py), each once its own closing tag is written.
"""

import json
import re

from app.server.tools.blocks import bare_value
from app.server.tools.keyed import WAIT, KeyedFormat, tag_at

NS = "]<]minimax[>["
OPEN, CLOSE = f"{NS}<tool_call>", f"{NS}</tool_call>"
TAG = re.compile(re.escape(NS) + r"<(/?)([^<>\n]+)>")
INVOKE = re.compile(r'invoke name="([^"]+)"')
STARTS_CALL = re.compile(r"\s*" + re.escape(NS) + "<" + INVOKE.pattern + ">")
STARTS_PARAMETER = re.compile(r"\s*" + re.escape(NS) + r"<([^/<>\n][^<>\n]*)>")


def tree(text: str) -> list[tuple[str, object]] | None:
    """The elements text writes, (tag, value): a leaf's value is its text, anything else a
    list of its elements; None where the tags do not nest."""
    stack: list[tuple[str, list, int]] = [("", [], 0)]
    for found in TAG.finditer(text):
        closing, tag = found.groups()
        if not closing:
            stack.append((tag, [], found.end()))
            continue
        name, children, start = stack.pop()
        if len(stack) == 0 or name.split(" ")[0] != tag:
            return None
        stack[-1][1].append((name, children if children else text[start:found.start()]))
    return stack[0][1] if len(stack) == 1 else None


def typed(value, schema: dict):
    """An element's value as the schema reads it."""
    kind = schema.get("type")
    if isinstance(value, str):
        if kind in ("array", "object") and not value.strip():
            return [] if kind == "array" else {}
        return bare_value(value, schema)
    if kind == "array" or (kind != "object" and all(tag == "item" for tag, _ in value)):
        return [typed(v, schema.get("items", {})) for _, v in value]
    properties = schema.get("properties", {})
    return {tag: typed(v, properties.get(tag, {})) for tag, v in value}


def xml(value) -> str:
    """A value as the template writes it (its to_xml)."""
    if isinstance(value, dict):
        return "".join(f"{NS}<{k}>{xml(v)}{NS}</{k}>" for k, v in value.items() if v is not None)
    if isinstance(value, list):
        return "".join(f"{NS}<item>{xml(v)}{NS}</item>" for v in value)
    return json.dumps(value) if isinstance(value, bool) else str(value)


class MiniMaxM3(KeyedFormat):
    name = "minimax_m3"
    opener, closer = OPEN, CLOSE
    markers = (OPEN, CLOSE, NS)
    call_close_text = f"{NS}</invoke>"

    def starts_call(self, text):
        found = tag_at(text, STARTS_CALL, (f"{NS}<invoke",))
        return found if found in (None, WAIT) else (found.group(1), found.end())

    def next_parameter(self, text, schemas):
        """A parameter once its own closing tag is written: the tags inside it counted."""
        found = tag_at(text, STARTS_PARAMETER, (f"{NS}<",))
        if found in (None, WAIT):
            return found
        key, depth = found.group(1), 0
        for tag in TAG.finditer(text, found.end()):
            closing, name = tag.groups()
            if closing and depth == 0:
                if name != key:
                    return None
                inner = text[found.end():tag.start()]
                elements = tree(inner)
                return key, typed(elements or inner, schemas.get(key, {})), tag.end()
            depth += -1 if closing else 1
        return WAIT

    def value_rule(self, rule, schema, end):
        """A list or an object as tags (each member's own value rule); anything else as any
        format's bare value."""
        m, kind = self.marker, schema.get("type")
        if kind == "array":
            return [f"{rule}: {rule}i* {m(end)}", f"{rule}i: {m(NS + '<item>')} {rule}v",
                    *self.value_rule(f"{rule}v", schema.get("items", {}), f"{NS}</item>")]
        if kind == "object" and schema.get("properties"):
            rules, members = [], []
            for j, (key, prop) in enumerate(schema["properties"].items()):
                members.append(f"{rule}m{j}")
                rules += [f"{rule}m{j}: {m(f'{NS}<{key}>')} {rule}m{j}v",
                          *self.value_rule(f"{rule}m{j}v", prop, f"{NS}</{key}>")]
            return [f"{rule}: ({' | '.join(members)})* {m(end)}", *rules]
        return super().value_rule(rule, schema, end)

    def body(self, functions, parallel):
        m, nl = self.marker, '"\\n"?'
        call = self.keyed_calls(functions, lambda name: m(f'{NS}<invoke name="{name}">'),
                                lambda key, _: m(f"{NS}<{key}>"), lambda key: f"{NS}</{key}>",
                                f"{m(NS + '</invoke>')} {nl}")
        more = "call*" if parallel else ""
        return f'body: "\\n"? call {more} {m(CLOSE)}\n{call}'

    def read(self, body, properties):
        elements = tree(body)
        invokes = [(INVOKE.fullmatch(tag), value) for tag, value in elements or ()]
        if not invokes or not all(found for found, _ in invokes):
            return None
        calls = []
        for found, value in invokes:
            name = found.group(1)
            schema = {"type": "object", "properties": properties.get(name, {})}
            calls.append((name, typed(value if isinstance(value, list) else [], schema)))
        return calls

    def write_calls(self, calls):
        return OPEN + "\n" + "".join(f'{NS}<invoke name="{n}">{xml(a)}{NS}</invoke>\n' for n, a in calls) + CLOSE
