"""Functionary 3.2's calls: each after >>> and the function's name on a line of its own, its
arguments as JSON (>>>all is the answer in text, not a call):

    >>>get_weather
    {"city": "Paris"}
"""

import json

from app.server.tools.base import json_lark, parameters
from app.server.tools.blocks import BlockFormat, arguments_of, json_end, json_value

OPEN = ">>>"


class FunctionaryV32(BlockFormat):
    name = "functionary_v32"
    opener = OPEN
    markers = (OPEN,)

    def body(self, functions, parallel):
        each = " | ".join(f'{json.dumps(f["name"] + chr(10))} {json_lark(parameters(f))}' for f in functions)
        more = f'("\\n"? {json.dumps(OPEN)} call)*' if parallel else ""
        return f"body: call {more}\ncall: {each}"

    def block_end(self, text):
        line = text.find("\n")
        if line < 0:
            return None
        if text[:line].strip() == "all":
            return line + 1  # the answer follows, as text
        end = json_end(text[line + 1:])
        return None if end is None else line + 1 + end

    def read(self, body, properties):
        name, _, arguments = body.partition("\n")
        arguments = arguments_of(json_value(arguments))
        return None if arguments is None or not name.strip() else [(name.strip(), arguments)]

    def write_calls(self, calls):
        return "\n".join(f"{OPEN}{n}\n{json.dumps(a, ensure_ascii=False)}" for n, a in calls)
