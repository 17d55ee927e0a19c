"""Hunyuan 3's calls: GLM's keys and values, in tags marked :opensource, the name before a
separator, the calls within a block:

    <tool_calls:opensource>
    <tool_call:opensource>get_weather<tool_sep:opensource>
    <arg_key:opensource>city</arg_key:opensource>
    <arg_value:opensource>Paris</arg_value:opensource>
    </tool_call:opensource>
    </tool_calls:opensource>
"""

import json
import re

from app.server.tools.blocks import BlockFormat, bare_value

CALLS, END_CALLS = "<tool_calls:opensource>", "</tool_calls:opensource>"
CALL, SEP, END_CALL = "<tool_call:opensource>", "<tool_sep:opensource>", "</tool_call:opensource>"
KEY, END_KEY = "<arg_key:opensource>", "</arg_key:opensource>"
VALUE, END_VALUE = "<arg_value:opensource>", "</arg_value:opensource>"
ONE = re.compile(f"{CALL}(.*?){SEP}(.*?){END_CALL}", re.S)
PAIR = re.compile(f"{KEY}(.*?){END_KEY}\\s*{VALUE}(.*?){END_VALUE}", re.S)


class Hy3(BlockFormat):
    name = "hy3"
    opener, closer = CALLS, END_CALLS
    markers = (CALLS, END_CALLS, CALL, SEP, END_CALL, KEY, END_KEY, VALUE, END_VALUE)

    def body(self, functions, parallel):
        m, nl = self.marker, '"\\n"?'
        call = self.keyed_calls(functions, lambda name: f"{m(CALL)} {json.dumps(name)} {m(SEP)} {nl}",
                                lambda key, _: f"{m(KEY)} {json.dumps(key)} {m(END_KEY)} {nl} {m(VALUE)}",
                                END_VALUE, f"{nl} {m(END_CALL)}", between=nl)
        more = f"({nl} call)*" if parallel else ""
        return f"body: {nl} call {more} {nl} {m(END_CALLS)}\n{call}"

    def read(self, body, properties):
        calls = []
        for name, inner in ONE.findall(body):
            schemas = properties.get(name.strip(), {})
            calls.append((name.strip(), {k.strip(): bare_value(v, schemas.get(k.strip(), {}))
                                         for k, v in PAIR.findall(inner)}))
        return calls or None

    def write_calls(self, calls):
        def text(v):
            return v if isinstance(v, str) else json.dumps(v, ensure_ascii=False)
        return CALLS + "\n" + "\n".join(
            f"{CALL}{n}{SEP}\n" + "".join(f"{KEY}{k}{END_KEY}\n{VALUE}{text(v)}{END_VALUE}\n" for k, v in a.items())
            + END_CALL for n, a in calls) + "\n" + END_CALLS
