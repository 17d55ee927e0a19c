"""MiniMax M1's calls: JSON objects a line each, in <tool_calls> tags:

    <tool_calls>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_calls>
"""

import json

from app.server.tools.blocks import JsonBlock, json_value, named_calls


class MiniMax(JsonBlock):
    name = "minimax"
    opener, closer = "<tool_calls>", "</tool_calls>"
    markers = (opener, closer)
    listed = False

    def body(self, functions, parallel):
        call = super().body(functions, False).split("\n", 1)[1]  # the "call" rule
        more = '("\\n" call)*' if parallel else ""
        return f'body: "\\n" call {more} "\\n" {self.marker(self.closer)}\n{call}'

    def read(self, body, properties):
        lines = [json_value(line) for line in body.splitlines() if line.strip()]
        calls = [named_calls(line) for line in lines]
        return None if not calls or None in calls else [c for one in calls for c in one]

    def write_calls(self, calls):
        lines = "\n".join(json.dumps({"name": n, "arguments": a}, ensure_ascii=False) for n, a in calls)
        return f"{self.opener}\n{lines}\n{self.closer}"
