"""Solar Open's calls, between tokens of their own, each with an id, a name and JSON arguments:

    <|tool_calls|><|tool_call:begin|>ID<|tool_call:name|>get_weather<|tool_call:args|>{"city": "Paris"}
    <|tool_call:end|><|calls|>
"""

import json
import re
import secrets

from app.server.tools.base import json_lark, parameters
from app.server.tools.blocks import BlockFormat, arguments_of, json_value

CALLS, END_CALLS = "<|tool_calls|>", "<|calls|>"
BEGIN, NAME, ARGS, END = "<|tool_call:begin|>", "<|tool_call:name|>", "<|tool_call:args|>", "<|tool_call:end|>"
ONE = re.compile(r"<\|tool_call:begin\|>(.*?)<\|tool_call:name\|>(.*?)<\|tool_call:args\|>(.*?)<\|tool_call:end\|>", re.S)


class SolarOpen(BlockFormat):
    name = "solar_open"
    opener, closer = CALLS, END_CALLS
    markers = (CALLS, END_CALLS, BEGIN, NAME, ARGS, END)

    def body(self, functions, parallel):
        m = self.marker
        each = " | ".join(f'{json.dumps(f["name"])} {m(ARGS)} {json_lark(parameters(f))}' for f in functions)
        return (f"body: call{'+' if parallel else ''} {m(END_CALLS)}\n"
                f"call: {m(BEGIN)} ID {m(NAME)} ({each}) {m(END)}\nID: /[A-Za-z0-9_-]+/")

    def read(self, body, properties):
        calls = [(name.strip(), arguments_of(json_value(arguments))) for _, name, arguments in ONE.findall(body)]
        return None if not calls or any(a is None for _, a in calls) else calls

    def write_calls(self, calls):
        return CALLS + "".join(f"{BEGIN}{secrets.token_hex(5)}{NAME}{n}{ARGS}{json.dumps(a, ensure_ascii=False)}{END}"
                               for n, a in calls) + END_CALLS
