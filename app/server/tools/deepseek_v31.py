"""DeepSeek V3.1's calls: DeepSeek V3's tokens, the name and its JSON arguments apart only by
the separator token:

    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Paris"}<｜tool▁call▁end｜><｜tool▁calls▁end｜>
"""

import json
import re

from app.server.tools.base import json_lark, parameters
from app.server.tools.blocks import BlockFormat, arguments_of, json_value
from app.server.tools.deepseek_v3 import CALL_BEGIN, CALL_END, CALLS_BEGIN, CALLS_END, OUTPUT_BEGIN, OUTPUT_END, SEP

ONE = re.compile(f"{CALL_BEGIN}(.*?){SEP}(.*?){CALL_END}", re.S)


class DeepSeekV31(BlockFormat):
    name = "deepseek_v31"
    opener, closer = CALLS_BEGIN, CALLS_END
    markers = (CALLS_BEGIN, CALL_BEGIN, SEP, CALL_END, CALLS_END)

    def body(self, functions, parallel):
        m = self.marker
        each = " | ".join(f'{json.dumps(f["name"])} {m(SEP)} {json_lark(parameters(f))}' for f in functions)
        return f"body: call{'+' if parallel else ''} {m(CALLS_END)}\ncall: {m(CALL_BEGIN)} ({each}) {m(CALL_END)}"

    def read(self, body, properties):
        calls = [(name.strip(), arguments_of(json_value(arguments))) for name, arguments in ONE.findall(body)]
        return None if not calls or any(a is None for _, a in calls) else calls

    def write_calls(self, calls):
        return CALLS_BEGIN + "".join(f"{CALL_BEGIN}{n}{SEP}{json.dumps(a, ensure_ascii=False)}{CALL_END}"
                                     for n, a in calls) + CALLS_END

    def write_result(self, content):
        return f"{OUTPUT_BEGIN}{content}{OUTPUT_END}"
