"""GPT-OSS's calls, in OpenAI's harmony format: each a message of its own, addressed to the
function, on the commentary channel:

    <|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>

(the recipient may come before the channel, as the template writes earlier calls). A reply is
messages, a header up to <|message|> and a body; the final channel's bodies (or a body with no
channel) are the content, and so are the commentary channel's to no one (preambles: what the
model tells the user it is about to do, before its calls), a blank line between messages; the
analysis channel's are the model's reasoning (app/server/harmony.py).
"""

import json
import re

import llguidance

from app.server.tools.base import CallStream, JsonValueEnd, ToolFormat, json_lark, parameters, partial_tag

START, CHANNEL, MESSAGE, CONSTRAIN = "<|start|>", "<|channel|>", "<|message|>", "<|constrain|>"
END, CALL, RETURN = "<|end|>", "<|call|>", "<|return|>"
RECIPIENT = re.compile(r"to=functions\.([^\s<]+)")
OPEN = "to=functions."


class OpenAI(ToolFormat):
    name = "openai"
    opener = OPEN
    markers = (START, CHANNEL, MESSAGE, CONSTRAIN, END, CALL, RETURN)

    def grammar(self, use):
        """Harmony messages: analysis (and commentary to no one) first, then the calls, or with
        auto a final answer instead."""
        m = self.marker
        final = f' | {m(CHANNEL)} "final" {m(MESSAGE)} TEXT' if use.choice == "auto" else ""
        start = f'start: notes ({m(CHANNEL)} "commentary" " to=functions." body{final})\nTEXT: /(.|\\n)*/'
        body = self.body(use.offered(), use.parallel)
        return llguidance.LLMatcher.grammar_from_lark(f"%llguidance {{}}\n{start}\n{self.notes()}\n{body}\n")

    def notes(self) -> str:
        """Lark: `notes`, the messages before an answer or a call, each ended by <|end|> and
        the next one's <|start|>assistant. A regex never holds an added token, so a note's text
        ends where <|end|> is written; where the markers are text, a lazy one ends at the first."""
        m = self.marker
        if END in self.added:
            text, rule = f"NOTE {m(END)}", "NOTE: /(.|\\n)*/"
        else:
            text, rule = "note", "note[lazy]: /(.|\\n)*<\\|end\\|>/"
        head = f'{m(CHANNEL)} ("analysis" | "commentary") {m(MESSAGE)}'
        return f'notes: ({head} {text} {m(START)} "assistant")*\n{rule}'

    def body(self, functions, parallel):
        m = self.marker
        each = " | ".join(f'{json.dumps(f["name"] + " ")} {m(CONSTRAIN)} "json" {m(MESSAGE)} {json_lark(parameters(f))}'
                          for f in functions)
        more = f'({m(START)} "assistant" {m(CHANNEL)} "commentary to=functions." call)*' if parallel else ""
        return f"body: call {more}\ncall: ({each}) {m(CALL)}"

    def parser(self, use=None):
        return HarmonyParser()

    def write_calls(self, calls):
        return (START + "assistant").join(
            f"{CHANNEL}commentary {OPEN}{n} {CONSTRAIN}json{MESSAGE}{json.dumps(a, ensure_ascii=False)}{CALL}"
            for n, a in calls)

    def write_result(self, content):
        return content


class HarmonyParser(CallStream):
    """Harmony messages out of streamed text: calls from the messages to a function, content
    from the final channel's (or a channel-less one's), reasoning from the analysis channel's
    (taken by take_reasoning; app/server/harmony.py)."""

    def __init__(self):
        super().__init__()
        self.state, self.channel, self.reasoning = "header", "final", ""
        self.read = False  # a header was read: the text is harmony
        self.spoke, self.gap = False, False  # content was written; a message since: a blank line first
        self.value: JsonValueEnd | None = None

    def step(self) -> bool:
        if self.state == "header":
            at = self.pending.find(MESSAGE)
            if at < 0:
                return False
            header, self.pending = self.pending[:at], self.pending[at + len(MESSAGE):]
            self.read = True
            call = RECIPIENT.search(header)
            if call:
                self.open_call(call.group(1))
                self.state, self.value = "arguments", JsonValueEnd()
            else:
                self.state, self.gap = "body", self.spoke
                self.channel = next((c for c in ("analysis", "commentary") if c in header), "final")
            return True
        if self.state == "arguments":
            if not self.calls[-1]["function"]["arguments"]:
                self.pending = self.pending.lstrip()
            n = self.value.feed(self.pending)
            self.add_arguments(self.pending[:n])
            self.pending = self.pending[n:]
            if self.value.done:
                self.state = "header"
                self.pending = self.pending.lstrip().removeprefix(CALL)
            return self.value.done
        ends = [(self.pending.find(tag), tag) for tag in (END, CALL, RETURN, START) if tag in self.pending]
        if not ends:
            keep = max(partial_tag(self.pending, tag) for tag in (END, CALL, RETURN, START))
            self.take(self.pending[:len(self.pending) - keep])
            self.pending = self.pending[len(self.pending) - keep:]
            return False
        at, tag = min(ends)
        self.take(self.pending[:at])
        self.pending, self.state = self.pending[at + (0 if tag == START else len(tag)):], "header"
        return True

    def take(self, text: str) -> None:
        if self.channel == "analysis":
            self.reasoning += text
        elif text:  # the final channel, or a preamble
            self.content += "\n\n" * self.gap + text
            self.spoke, self.gap = True, False

    def take_reasoning(self) -> str:
        """The analysis channel's text read since the last call."""
        out, self.reasoning = self.reasoning, ""
        return out

    def finish(self) -> str:
        rest, self.pending = self.pending, ""
        if not self.read and CHANNEL not in rest:
            return rest  # plain text, no harmony at all
        if self.state == "body":
            self.take(rest)
        out, self.content = self.content, ""
        return out
