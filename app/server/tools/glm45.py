"""GLM 4.5-4.7's calls (and Ling 3's, Laguna's), a block each, every argument a key and a value:

    <tool_call>get_weather
    <arg_key>city</arg_key>
    <arg_value>Paris</arg_value>
    </tool_call>

GLM 4.7 writes them with no newlines between (glm47); either is read. A value is typed by the
tool's schema: a string as written, anything else as the JSON it spells. A call's arguments
stream a parameter at a time (keyed.py).
"""

import json
import re

from app.server.tools.blocks import bare_value
from app.server.tools.keyed import WAIT, KeyedFormat, tag_at

OPEN, CLOSE = "<tool_call>", "</tool_call>"
KEY, END_KEY, VALUE, END_VALUE = "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>"
PAIR = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.S)
STREAMED_PAIR = re.compile(r"\s*" + PAIR.pattern, re.S)
NAME = re.compile(r"([^\s<>]+)\s*(?=<arg_key>|</tool_call>)")  # a function's name: no spaces


class Glm45(KeyedFormat):
    name = "glm45"
    opener, closer = OPEN, CLOSE
    call_close_text = CLOSE
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

    def starts_call(self, text):
        found = NAME.match(text)
        if found:
            return found.group(1), found.end()
        tail = text[text.find("<"):] if "<" in text else ""
        return WAIT if not tail or KEY.startswith(tail) or CLOSE.startswith(tail) else None

    def next_parameter(self, text, schemas):
        found = tag_at(text, STREAMED_PAIR, (KEY,))
        if found in (None, WAIT):
            return found
        key = found.group(1).strip()
        return key, bare_value(found.group(2), schemas.get(key, {})), found.end()

    def read(self, body, properties):
        name, _, rest = body.partition(KEY)
        name = name.strip()
        if not name or any(c in name for c in "<> \t\n"):
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
