"""DeepSeek V3's calls, between tokens of their own, arguments in a JSON code block:

    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather
    ```json
    {"city": "Paris"}
    ```<｜tool▁call▁end｜>
    <｜tool▁call▁begin｜>...<｜tool▁call▁end｜><｜tool▁calls▁end｜>
"""

import json
import re

from app.server.tools.base import CallStream, JsonValueEnd, ToolFormat, json_lark, parameters, partial_tag

CALLS_BEGIN, CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CALL_BEGIN, CALL_END, SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
OUTPUT_BEGIN, OUTPUT_END = "<｜tool▁output▁begin｜>", "<｜tool▁output▁end｜>"
NEWLINE_JSON = "\n```json\n"  # between a call's name and its arguments
HEAD = re.compile(rf"\s*\w+{SEP}([^\n]*)\n```(?:json)?\n")


class DeepSeekV3(ToolFormat):
    name = "deepseek_v3"
    opener = CALLS_BEGIN
    markers = (CALLS_BEGIN, CALL_BEGIN, SEP, CALL_END, CALLS_END)

    def body(self, functions, parallel):
        m = self.marker
        more = f'("\\n" call)*' if parallel else ""
        each = " | ".join(f'{json.dumps(name + NEWLINE_JSON)} {json_lark(schema)} "\\n```"'
                          for name, schema in ((f["name"], parameters(f)) for f in functions))
        return (f"body: call {more} {m(CALLS_END)}\n"
                f'call: {m(CALL_BEGIN)} "function" {m(SEP)} function {m(CALL_END)}\nfunction: {each}')

    def parser(self, use=None):
        return DeepSeekV3Parser()

    def write_calls(self, calls):
        return CALLS_BEGIN + "\n".join(
            f"{CALL_BEGIN}function{SEP}{n}\n```json\n{json.dumps(a, ensure_ascii=False)}\n```{CALL_END}"
            for n, a in calls) + CALLS_END

    def write_result(self, content):
        return f"{OUTPUT_BEGIN}{content}{OUTPUT_END}"


class DeepSeekV3Parser(CallStream):
    """Text until the calls begin, then each call: its name, then its arguments as written."""

    def __init__(self):
        super().__init__()
        self.state = "text"
        self.value: JsonValueEnd | None = None

    def step(self) -> bool:
        if self.state == "text":
            if self.text_until(CALLS_BEGIN):
                self.state = "call"
                return True
            return False
        if self.state == "call":  # the next call, or the end of them
            rest = self.pending.lstrip()
            for tag, state in ((CALL_BEGIN, "name"), (CALLS_END, "text")):
                if rest.startswith(tag):
                    self.pending, self.state = rest[len(tag):], state
                    return True
            if any(partial_tag(rest, tag) == len(rest) for tag in (CALL_BEGIN, CALLS_END)):
                return False
            self.state = "text"  # not a call: the rest is content
            return True
        if self.state == "name":
            head = HEAD.match(self.pending)
            if head is None:
                return False
            self.open_call(head.group(1).strip())
            self.pending, self.state, self.value = self.pending[head.end():], "args", JsonValueEnd()
            return True
        if self.state == "args":
            n = self.value.feed(self.pending)
            self.add_arguments(self.pending[:n])
            self.pending = self.pending[n:]
            if self.value.done:
                self.state = "tail"
            return self.value.done
        if CALL_END not in self.pending:  # tail: the code block's end
            return False
        self.pending, self.state = self.pending.split(CALL_END, 1)[1], "call"
        return True

    def finish(self) -> str:
        rest, self.pending = self.pending, ""
        if self.state == "name":  # a call that never named its function
            return ("" if self.calls else CALLS_BEGIN) + CALL_BEGIN + rest
        return rest if self.state == "text" else ""
