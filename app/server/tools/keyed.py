"""Streaming for the block formats that write a call a parameter at a time (XML invocations,
GLM's keys and values, Kimi K3's XTML): a call opens as soon as its name is written, and its
arguments' JSON grows as each parameter closes (`{"city": "Paris"`, then `, "days": 3`, then
`}`), as Qwen3-Coder's do, where a block format (blocks.py) would give the calls whole when the
block ends. A coding agent's long argument (a file to write) then arrives as it is written.

A format says where a call starts (its name), where a parameter ends (its key and value), and
where a call and the block end; each answers with what it read and how far, WAIT (it may be
there once more text comes) or None (it is not there). A block whose first call does not read
is read whole at its end instead, content where it is not calls, as blocks.py reads it.
"""

import json
import re
from functools import cached_property

from app.server.tools.base import CallStream, parameters
from app.server.tools.blocks import BlockFormat, release

WAIT = "wait"


def tag_at(text: str, pattern: re.Pattern, starts: tuple[str, ...]):
    """pattern's match at the start of text (after whitespace); WAIT where text could still
    become one (it is empty, or a start of one of starts, or starts with one); else None."""
    found = pattern.match(text)
    if found:
        return found
    rest = text.lstrip()
    if any(s.startswith(rest) or rest.startswith(s) for s in starts):
        return WAIT
    return None


class KeyedParser(CallStream):
    """Text until a block opens; then its calls, each opened at its name and its arguments
    streamed a parameter at a time; then text again (after_block: a subclass's state for
    what follows a block, Kimi K3's reply reader's)."""

    after_block = "text"

    def __init__(self, fmt, properties: dict[str, dict]):
        super().__init__()
        self.fmt, self.properties = fmt, properties
        self.state = "text"  # text, call (one may start), arguments, whole (the block read at its end)
        self.opened = 0  # calls opened in this block
        self.written = ""  # of the open call's arguments: "" none yet, "keys" some, "whole" all at once

    def step(self) -> bool:
        if self.state == "text":
            if self.text_until(self.fmt.opener):
                self.state, self.opened = "call", 0
                return True
            return False
        return {"call": self.call, "arguments": self.arguments, "whole": self.whole}[self.state]()

    def call(self) -> bool:
        if self.opened:  # after a call: the block's end, or another call
            end = tag_at(self.pending, self.fmt.block_close, (self.fmt.closer,))
            if end == WAIT:
                return False
            if end is not None:
                self.pending, self.state = self.pending[end.end():], self.after_block
                return True
        start = self.fmt.starts_call(self.pending)
        if start == WAIT:
            return False
        if start is None:  # not a call: a first one makes the block read whole; after calls, text
            self.state = self.after_block if self.opened else "whole"
            return True
        self.name, end = start
        self.open_call(self.name)
        self.pending, self.state, self.written = self.pending[end:], "arguments", ""
        self.opened += 1
        return True

    def arguments(self) -> bool:
        found = self.fmt.next_parameter(self.pending, self.properties.get(self.name, {}))
        if found not in (None, WAIT):
            key, value, end = found
            if key is None:  # the arguments whole, as one JSON object
                piece, self.written = json.dumps(value, ensure_ascii=False), "whole"
            else:
                pair = f"{json.dumps(key, ensure_ascii=False)}: {json.dumps(value, ensure_ascii=False)}"
                piece, self.written = (", " if self.written else "{") + pair, "keys"
            self.add_arguments(piece)
            self.pending = self.pending[end:]
            return True
        end = tag_at(self.pending, self.fmt.call_close, (self.fmt.call_close_text,))
        if end in (None, WAIT):
            return False  # a parameter or the call's end not whole yet
        self.add_arguments({"": "{}", "keys": "}", "whole": ""}[self.written])
        self.pending = self.pending[end.end():]
        self.state = self.after_block if self.fmt.call_close_text.endswith(self.fmt.closer) else "call"
        return True

    def whole(self) -> bool:
        """The block read once it ends: its calls, or content where it is not calls (blocks.py's way)."""
        end = self.fmt.block_end(self.pending)
        if end is None:
            return False
        block, self.pending, self.state = self.pending[:end], self.pending[end:], self.after_block
        release(self, self.fmt, block, self.properties)
        return True

    def finish(self) -> str:
        rest, self.pending = self.pending, ""
        if self.state in ("call", "whole") and not self.opened:
            return self.fmt.opener + rest
        return rest if self.state == "text" else ""


class KeyedFormat(BlockFormat):
    """A block format whose calls stream (KeyedParser). A subclass gives starts_call and
    next_parameter, and the call's closing text (call_close_text; the closer itself where each call
    is a block of its own)."""

    call_close_text = ""

    def starts_call(self, text: str):
        """(the call's name, how far it was read) where text starts a call; WAIT; or None."""
        raise NotImplementedError

    def next_parameter(self, text: str, schemas: dict):
        """(key, value, how far) where text starts with a whole parameter (key None: the
        arguments whole); WAIT; or None."""
        raise NotImplementedError

    @cached_property
    def block_close(self) -> re.Pattern:
        return re.compile(r"\s*" + re.escape(self.closer))

    @cached_property
    def call_close(self) -> re.Pattern:
        return re.compile(r"\s*" + re.escape(self.call_close_text))

    def parser(self, use):
        return KeyedParser(self, {f["name"]: parameters(f).get("properties", {}) for f in use.functions})
