"""Qwen3-Coder's XML calls, one parameter a block, each value typed by the tool's schema:

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    </function>
    </tool_call>

A value's JSON is streamed as each parameter closes: `{"city": "Paris"`, then `, "unit": ...`,
then `}` when the function closes.
"""

import json
import re

from app.server.tools.base import CallStream, ToolFormat, json_lark, parameters, partial_tag

OPEN, CLOSE = "<tool_call>", "</tool_call>"
FUNCTION = re.compile(r"\s*<function=([^>\n]+)>")
PARAMETER = re.compile(r"\s*<parameter=([^>\n]+)>")  # the value after it, from one newline on
END_PARAMETER, END_FUNCTION = "</parameter>", "</function>"


def value_lark(rule: str, schema: dict) -> str:
    """The Lark rule for a parameter's value and the end of its block: a string bare (lazy:
    it ends at the first end tag, as the parser reads it), anything else as JSON."""
    kind, end = schema.get("type"), '"\\n</parameter>\\n"'
    if "enum" in schema:
        values = " | ".join(json.dumps(v if isinstance(v, str) else json.dumps(v)) for v in schema["enum"])
        return f"{rule}: ({values}) {end}"
    if kind == "string":
        count = f"{{0,{schema['maxLength']}}}" if "maxLength" in schema else "*"
        return f"{rule}[lazy]: /(.|\\n){count}\\n<\\/parameter>\\n/"
    return f"{rule}: {json_lark(schema)} {end}"  # numbers, booleans, objects ... as JSON, bounds and all


def typed(value: str, schema: dict) -> str:
    """The JSON of a value as written: a string where the schema says so (or the value is not
    JSON), else the value it spells."""
    if schema.get("type") == "string" or isinstance(next(iter(schema.get("enum", [])), None), str):
        return json.dumps(value, ensure_ascii=False)
    try:
        return json.dumps(json.loads(value), ensure_ascii=False)
    except ValueError:
        return json.dumps(value, ensure_ascii=False)


class Qwen3Coder(ToolFormat):
    name = "qwen3_coder"
    opener = OPEN
    markers = (OPEN, CLOSE)

    def body(self, functions, parallel):
        rules = []
        for i, f in enumerate(functions):
            schema = parameters(f)
            required = set(schema.get("required", []))
            params = []
            for j, (key, prop) in enumerate(schema.get("properties", {}).items()):
                rules += [f'f{i}p{j}: {json.dumps(f"<parameter={key}>")} "\\n" f{i}p{j}v', value_lark(f"f{i}p{j}v", prop)]
                params.append(f"f{i}p{j}" + ("" if key in required else "?"))
            opening = json.dumps(f"<function={f['name']}>\n")
            rules.append(f'f{i}: {opening} {" ".join(params)} "</function>"')
        more = f'("\\n" {self.marker(OPEN)} call)*' if parallel else ""
        calls = " | ".join(f"f{i}" for i in range(len(functions)))
        return "\n".join([f"body: call {more}", f'call: "\\n" ({calls}) "\\n" {self.marker(CLOSE)}', *rules])

    def parser(self, use):
        return Qwen3CoderParser({f["name"]: parameters(f).get("properties", {}) for f in use.functions})

    def write_calls(self, calls):
        return "\n".join(f"{OPEN}\n<function={n}>\n" + "".join(
            f"<parameter={k}>\n{v if isinstance(v, str) else json.dumps(v, ensure_ascii=False)}\n</parameter>\n"
            for k, v in a.items()) + f"</function>\n{CLOSE}" for n, a in calls)


class Qwen3CoderParser(CallStream):
    """Blocks out of streamed text, each parameter's JSON released as its block closes."""

    def __init__(self, properties: dict[str, dict]):
        super().__init__()
        self.properties = properties  # each function's parameter schemas, by name
        self.state = "text"
        self.key = ""

    def step(self) -> bool:
        if self.state == "text":
            if self.text_until(OPEN):
                self.state = "function"
                return True
            return False
        if self.state == "function":
            head = FUNCTION.match(self.pending)
            if head:
                self.open_call(head.group(1).strip())
                self.pending, self.state = self.pending[head.end():], "parameter"
                return True
            rest = self.pending.lstrip()
            if partial_tag(rest, "<function=") == len(rest) or (rest.startswith("<function=") and ">" not in rest):
                return False
            self.content, self.pending, self.state = self.content + OPEN + self.pending, "", "text"
            return True  # not a call: content
        if self.state == "parameter":
            head = PARAMETER.match(self.pending)
            if head:
                self.key, self.pending, self.state = head.group(1).strip(), self.pending[head.end():], "value"
                return True
            rest = self.pending.lstrip()
            if rest.startswith(END_FUNCTION):
                self.add_arguments("}" if self.calls[-1]["function"]["arguments"] else "{}")
                self.pending, self.state = rest[len(END_FUNCTION):], "end"
                return True
            return False
        if self.state == "value":
            at = self.pending.find(END_PARAMETER)
            if at < 0:
                return False
            value = self.pending[:at].removeprefix("\n").removesuffix("\n")
            schema = self.properties.get(self.calls[-1]["function"]["name"], {}).get(self.key, {})
            sep = ", " if self.calls[-1]["function"]["arguments"] else "{"
            self.add_arguments(f"{sep}{json.dumps(self.key, ensure_ascii=False)}: {typed(value, schema)}")
            self.pending, self.state = self.pending[at + len(END_PARAMETER):], "parameter"
            return True
        if CLOSE not in self.pending:  # end: the block's close
            return False
        self.pending, self.state = self.pending.split(CLOSE, 1)[1], "text"
        return True

    def finish(self) -> str:
        rest, self.pending = self.pending, ""
        if self.state == "function":
            return OPEN + rest
        return rest if self.state == "text" else ""
