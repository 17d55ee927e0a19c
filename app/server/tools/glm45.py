"""GLM 4.5-4.7's calls (and Ling 3's, Laguna's), a block each, every argument a key and a value:

    <tool_call>get_weather
    <arg_key>city</arg_key>
    <arg_value>Paris</arg_value>
    </tool_call>

GLM 4.7 writes them with no newlines between (glm47); either is read. A value is typed by the
tool's schema: a string as written, anything else as the JSON it spells.
"""

import json
import re

from app.server.tools.blocks import BlockFormat, bare_value

OPEN, CLOSE = "<tool_call>", "</tool_call>"
KEY, END_KEY, VALUE, END_VALUE = "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>"
PAIR = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.S)


class Glm45(BlockFormat):
    name = "glm45"
    opener, closer = OPEN, CLOSE
    markers = (OPEN, CLOSE, KEY, END_KEY, VALUE, END_VALUE)
    newline = "\n"  # between the name and each key and value, as the model writes them

    def body(self, functions, parallel):
        m, nl = self.marker, '"\\n"?'
        call = self.keyed_calls(
            functions, lambda name: f"{json.dumps(name)} {nl}",
            lambda key, _: f"{m(KEY)} {json.dumps(key)} {m(END_KEY)} {nl} {m(VALUE)}", END_VALUE, f"{nl} {m(CLOSE)}",
            between=nl)
        more = f'("\\n"? {m(OPEN)} call)*' if parallel else ""
        return f"body: call {more}\n{call}"

    def read(self, body, properties):
        name, _, rest = body.partition(KEY)
        name = name.strip()
        if not name or any(c in name for c in "<>\n"):
            return None
        schemas = properties.get(name, {})
        return [(name, {k.strip(): bare_value(v, schemas.get(k.strip(), {})) for k, v in PAIR.findall(KEY + rest)})]

    def write_calls(self, calls):
        nl = self.newline
        return "\n".join(OPEN + n + "".join(f"{nl}{KEY}{k}{END_KEY}{nl}{VALUE}{_text(v)}{END_VALUE}" for k, v in a.items())
                         + f"{nl}{CLOSE}" for n, a in calls)


class Glm47(Glm45):
    name = "glm47"
    newline = ""


def _text(value) -> str:
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
