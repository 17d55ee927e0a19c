"""What the formats that write calls as XML invocations share (MiniMax M2's, DeepSeek V3.2's
and V4's DSML, Glimmer's, MiniCPM's): an invoke tag naming the function, a tag a parameter,
often within a block:

    <minimax:tool_call>
    <invoke name="get_weather">
    <parameter name="city">Paris</parameter>
    </invoke>
    </minimax:tool_call>

A value is typed by the tool's schema, or, where the tag says string="true" or "false" (DSML),
by that. A call's arguments stream a parameter at a time (keyed.py).
"""

import json
import re
from functools import cached_property

from app.server.tools.blocks import bare_value, json_value
from app.server.tools.keyed import WAIT, KeyedFormat, tag_at


class InvokeXml(KeyedFormat):
    prefix = ""  # before each tag's name (DSML's ｜DSML｜)
    invoke, parameter = "invoke", "parameter"
    string_attribute = False  # whether each parameter says string="true" or "false"
    wrapped = True  # the invocations are within a block (opener, closer); else each is one

    @property
    def call_close_text(self) -> str:
        return self.end(self.invoke) if self.wrapped else self.closer

    @cached_property
    def _call(self) -> re.Pattern:
        """A call's start: its invoke tag, or without a block, the name after the opener."""
        if self.wrapped:
            return re.compile(rf'\s*{re.escape(self.tag(self.invoke))} name="([^"]+)">')
        return re.compile(r'([^"<>\n]+)">')

    @cached_property
    def _parameter(self) -> re.Pattern:
        return re.compile(rf'\s*{re.escape(self.tag(self.parameter))} name="([^"]+)"(?: string="(true|false)")?>'
                          rf"(.*?){re.escape(self.end(self.parameter))}", re.S)

    def starts_call(self, text):
        if self.wrapped:
            found = tag_at(text, self._call, (self.tag(self.invoke),))
        else:
            found = self._call.match(text) or (WAIT if re.fullmatch(r'[^"<>\n]*"?', text) else None)
        return found if found in (None, WAIT) else (found.group(1), found.end())

    def next_parameter(self, text, schemas):
        found = tag_at(text, self._parameter, (self.tag(self.parameter),))
        if found in (None, WAIT):
            return found
        key, kind, raw = found.groups()
        return key, self.value(raw.strip("\n"), kind, schemas.get(key, {})), found.end()

    def tag(self, name: str) -> str:
        return f"<{self.prefix}{name}"

    def end(self, name: str) -> str:
        return f"</{self.prefix}{name}>"

    def key_tag(self, key: str, value) -> str:
        kind = f' string="{"true" if isinstance(value, str) else "false"}"' if self.string_attribute else ""
        return f'{self.tag(self.parameter)} name="{key}"{kind}>'

    def body(self, functions, parallel):
        def key(name, schema):
            return json.dumps(self.key_tag(name, "" if schema.get("type") == "string" else 0))
        head = f'{self.tag(self.invoke)} name="' if self.wrapped else ""
        call = self.keyed_calls(functions, lambda name: f'{json.dumps(head + name + chr(34) + ">")} "\\n"?', key,
                                self.end(self.parameter), f'"\\n"? {json.dumps(self.end(self.invoke))}',
                                between='"\\n"?')
        if not self.wrapped:
            more = f' ("\\n"? {self.marker(self.opener)} call)*' if parallel else ""
            return f"body: call{more}\n{call}"
        more = '("\\n"? call)*' if parallel else ""
        return f'body: "\\n"? call {more} "\\n"? {self.marker(self.closer)}\n{call}'

    def read(self, body, properties):
        text = self.opener + body + self.closer if not self.wrapped else body
        invokes = re.findall(rf'{re.escape(self.tag(self.invoke))} name="([^"]+)">(.*?){re.escape(self.end(self.invoke))}',
                             text, re.S)
        if not invokes:
            return None
        param = re.compile(rf'{re.escape(self.tag(self.parameter))} name="([^"]+)"(?: string="(true|false)")?>'
                           rf"(.*?){re.escape(self.end(self.parameter))}", re.S)
        calls = []
        for name, inner in invokes:
            schemas = properties.get(name, {})
            calls.append((name, {key: self.value(raw.strip("\n"), kind, schemas.get(key, {}))
                                 for key, kind, raw in param.findall(inner)}))
        return calls

    @staticmethod
    def value(text: str, kind: str, schema: dict):
        if kind == "true":
            return text
        if kind == "false":
            value = json_value(text)
            return text if value is None and text != "null" else value
        return bare_value(text, schema)

    def write_calls(self, calls):
        def one(name, arguments):
            params = "".join(f"{self.key_tag(k, v)}{v if isinstance(v, str) else json.dumps(v, ensure_ascii=False)}"
                             f"{self.end(self.parameter)}\n" for k, v in arguments.items())
            return f'{self.tag(self.invoke)} name="{name}">\n{params}{self.end(self.invoke)}'
        if not self.wrapped:
            return "\n".join(one(n, a) for n, a in calls)
        return self.opener + "\n" + "\n".join(one(n, a) for n, a in calls) + "\n" + self.closer
