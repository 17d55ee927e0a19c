"""Seed-OSS's calls: Qwen3-Coder's function and parameter tags in a <seed:tool_call> block, a
value typed by the tool's schema:

    <seed:tool_call>
    <function=get_weather>
    <parameter=city>Paris</parameter>
    </function>
    </seed:tool_call>
"""

import json
import re

from app.server.tools.blocks import BlockFormat, bare_value

OPEN, CLOSE = "<seed:tool_call>", "</seed:tool_call>"
FUNCTION = re.compile(r"<function=([^>\n]+)>(.*?)</function>", re.S)
PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)</parameter>", re.S)


class SeedOss(BlockFormat):
    name = "seed_oss"
    opener, closer = OPEN, CLOSE
    markers = (OPEN, CLOSE)

    def body(self, functions, parallel):
        call = self.keyed_calls(functions, lambda name: json.dumps(f"<function={name}>") + ' "\\n"?',
                                lambda key, _: json.dumps(f"<parameter={key}>"), "</parameter>",
                                '"\\n"? "</function>"', between='"\\n"?')
        more = f'("\\n"? {self.marker(OPEN)} "\\n"? call "\\n"? {self.marker(CLOSE)})*' if parallel else ""
        return f'body: "\\n"? call "\\n"? {self.marker(CLOSE)} {more}\n{call}'

    def read(self, body, properties):
        calls = []
        for name, inner in FUNCTION.findall(body):
            schemas = properties.get(name.strip(), {})
            calls.append((name.strip(), {k.strip(): bare_value(v.strip("\n"), schemas.get(k.strip(), {}))
                                         for k, v in PARAMETER.findall(inner)}))
        return calls or None

    def write_calls(self, calls):
        return "\n".join(f"{OPEN}\n<function={n}>\n" + "".join(
            f"<parameter={k}>{v if isinstance(v, str) else json.dumps(v, ensure_ascii=False)}</parameter>\n"
            for k, v in a.items()) + f"</function>\n{CLOSE}" for n, a in calls)
