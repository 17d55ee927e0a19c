"""Functionary 3.1's calls: the function's name in the tag, its arguments as JSON:

    <function=get_weather>{"city": "Paris"}</function>
"""

import json

from app.server.tools.base import json_lark, parameters
from app.server.tools.blocks import BlockFormat, arguments_of, json_value

OPEN, CLOSE = "<function=", "</function>"


class FunctionaryV31(BlockFormat):
    name = "functionary_v31"
    opener, closer = OPEN, CLOSE
    markers = (OPEN, CLOSE)

    def body(self, functions, parallel):
        each = " | ".join(f'{json.dumps(f["name"] + ">")} {json_lark(parameters(f))}' for f in functions)
        more = f'("\\n"? {json.dumps(OPEN)} call)*' if parallel else ""
        return f'body: call {more}\ncall: ({each}) {json.dumps(CLOSE)}'

    def read(self, body, properties):
        name, _, arguments = body.partition(">")
        arguments = arguments_of(json_value(arguments))
        return None if arguments is None or not name.strip() else [(name.strip(), arguments)]

    def write_calls(self, calls):
        return "".join(f"{OPEN}{n}>{json.dumps(a, ensure_ascii=False)}{CLOSE}" for n, a in calls)
