"""Kimi K2's calls, in a section of tokens of their own, each named functions.NAME:INDEX:

    <|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>
    {"city": "Paris"}<|tool_call_end|><|tool_calls_section_end|>
"""

import json
import re

from app.server.tools.base import json_lark, parameters
from app.server.tools.blocks import BlockFormat, arguments_of, json_value

SECTION, END_SECTION = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
CALL, ARGUMENTS, END_CALL = "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>"
ONE = re.compile(r"<\|tool_call_begin\|>\s*(?:functions\.)?([^\s:<]+)(?::\d+)?\s*<\|tool_call_argument_begin\|>"
                 r"(.*?)<\|tool_call_end\|>", re.S)


class KimiK2(BlockFormat):
    name = "kimi_k2"
    opener, closer = SECTION, END_SECTION
    markers = (SECTION, END_SECTION, CALL, ARGUMENTS, END_CALL)

    def body(self, functions, parallel):
        m = self.marker
        each = " | ".join(f'{json.dumps("functions." + f["name"] + ":")} INDEX {m(ARGUMENTS)} {json_lark(parameters(f))}'
                          for f in functions)
        more = "+" if parallel else ""
        return f"body: call{more} {m(END_SECTION)}\ncall: {m(CALL)} ({each}) {m(END_CALL)}\nINDEX: /[0-9]+/"

    def read(self, body, properties):
        calls = [(name, arguments_of(json_value(arguments))) for name, arguments in ONE.findall(body)]
        return None if not calls or any(a is None for _, a in calls) else calls

    def write_calls(self, calls):
        return SECTION + "".join(f"{CALL}functions.{n}:{i}{ARGUMENTS}{json.dumps(a, ensure_ascii=False)}{END_CALL}"
                                 for i, (n, a) in enumerate(calls)) + END_SECTION
