"""Granite 3's calls: a JSON list after a <|tool_call|> marker, to the end of the list:

    <|tool_call|>[{"name": "get_weather", "arguments": {"city": "Paris"}}]
"""

import json

from app.server.tools.base import call_schema, json_lark
from app.server.tools.blocks import BlockFormat, json_value, named_calls

OPEN = "<|tool_call|>"


class Granite(BlockFormat):
    name = "granite"
    opener = OPEN
    markers = (OPEN,)

    def body(self, functions, parallel):
        calls = {"type": "array", "minItems": 1, "items": call_schema(functions, "arguments")}
        return f"body: {json_lark(calls if parallel else {**calls, 'maxItems': 1})}"

    def read(self, body, properties):
        return named_calls(json_value(body))

    def write_calls(self, calls):
        return OPEN + json.dumps([{"name": n, "arguments": a} for n, a in calls], ensure_ascii=False)
