"""What every tool-call format shares: the markers it writes (a token of their own, or text),
the JSON schema of one call, and the streaming parser's bookkeeping (OpenAI's tool call chunks)."""

import hashlib
import json
import re
import secrets

import llguidance

from app.server.formats import JSON_WHITESPACE

NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}

SYSTEM_BLOCK = """You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{tools}
</tools>

{how}"""

NAME = r'"(?:[^"\\]|\\.)*"'  # a JSON string


def partial_tag(text: str, tag: str) -> int:
    """How many characters at the end of text may be the start of tag (held until clear)."""
    return next((n for n in range(min(len(tag) - 1, len(text)), 0, -1) if tag.startswith(text[-n:])), 0)


def call_id() -> str:
    return f"call_{secrets.token_hex(12)}"


def nine_alphanumerics(given: str | None = None) -> str:
    """Mistral's call ids, which its templates check: a new one, or a client's id made one
    (itself if it is one; else its last nine letters and digits; a short one hashed), the same
    for a call and its result."""
    if given is None:
        return secrets.token_hex(5)[:9]
    kept = "".join(c for c in given if c.isascii() and c.isalnum())
    return kept[-9:] if len(kept) >= 9 else hashlib.sha256(given.encode()).hexdigest()[:9]


def parameters(function: dict) -> dict:
    return function.get("parameters") or NO_PARAMETERS


def json_lark(schema: dict) -> str:
    """A %json element of a Lark grammar, with the server's bounded whitespace. Lenient: a
    keyword llguidance does not implement (propertyNames, in two of Claude Code's tools) goes
    unenforced rather than refusing the request, since an agent's tools are written for the
    validators of the APIs it was made for."""
    return "%json " + json.dumps({**schema, "x-guidance": {"whitespace_pattern": JSON_WHITESPACE, "lenient": True}})


def call_schema(functions: list[dict], arguments_key: str) -> dict:
    """{"name": ..., arguments_key: {...}} for any of the functions."""
    calls = [{"type": "object", "additionalProperties": False, "required": ["name", arguments_key],
              "properties": {"name": {"const": f["name"]}, arguments_key: parameters(f)}} for f in functions]
    return calls[0] if len(calls) == 1 else {"anyOf": calls}


class ToolFormat:
    """How one family of models writes tool calls. A format is made once at start-up, with the
    tokenizer: a marker that is a token of its own (added to the vocabulary) is named by its id
    in a grammar, since llguidance never spells an added token out of text."""

    name = ""
    opener = ""  # the text that opens the calls
    markers: tuple[str, ...] = ()  # every marker the parser reads, the opener among them

    def template_id(self, given: str) -> str:
        """An earlier call's id (and its result's tool_call_id) as the chat template takes it."""
        return given

    def __init__(self, tokenizer=None):
        self.added = {} if tokenizer is None else {t.content: i for i, t in tokenizer.hf.get_added_tokens_decoder().items()}
        self._added_pattern = None

    def marker_ids(self) -> set[int]:
        """The ids of the added tokens the markers are written with: the detokenizer must keep
        them in the text even when the tokenizer calls them special (Mistral's [TOOL_CALLS]), or
        the parser would never see a call."""
        return {piece for text in self.markers for piece in self.pieces(text) if isinstance(piece, int)}

    def pieces(self, text: str) -> list[str | int]:
        """text as the tokenizer splits it first: the ids of the added tokens in it (the longest
        at each place), and the text between them."""
        if not self.added:
            return [text] if text else []
        if self._added_pattern is None:
            names = sorted(self.added, key=len, reverse=True)
            self._added_pattern = re.compile("|".join(map(re.escape, names)))
        out, at = [], 0
        for found in self._added_pattern.finditer(text):
            out += [text[at:found.start()]] if found.start() > at else []
            out.append(self.added[found.group()])
            at = found.end()
        return out + ([text[at:]] if at < len(text) else [])

    def opens_with_token(self, text: str) -> bool:
        """Whether text begins with an added token, which free text (that never spells one)
        cannot run into."""
        return isinstance(next(iter(self.pieces(text)), None), int)

    def marker(self, text: str) -> str:
        """A Lark element for text: the ids of the added tokens in it, the rest as text."""
        return " ".join(f"<[{p}]>" if isinstance(p, int) else json.dumps(p, ensure_ascii=False)
                        for p in self.pieces(text)) or '""'

    def grammar(self, use) -> str:
        """llguidance Lark: required and named choices begin with the calls; auto lets the model
        write text, and once it opens calls holds them to the functions' schemas (lazily, when
        the opener is text: the free text could otherwise swallow it)."""
        body = self.body(use.offered(), use.parallel)
        opener = self.marker(self.opener)
        if use.choice != "auto":
            start = f"start: {opener} body"
        elif self.opens_with_token(self.opener):
            start = f"start: TEXT ({opener} body)?\nTEXT: /(.|\\n)*/"
        else:
            start = f"start: TEXT | opened body\nopened[lazy]: TEXT {opener}\nTEXT: /(.|\\n)*/"
        return llguidance.LLMatcher.grammar_from_lark(f"%llguidance {{}}\n{start}\n{body}\n")

    def body(self, functions: list[dict], parallel: bool) -> str:
        """Lark rules: `body`, the calls after the opener."""
        raise NotImplementedError

    def parser(self, use):
        raise NotImplementedError

    def write_calls(self, calls: list[tuple[str, dict]]) -> str:
        """An assistant's earlier calls (name, arguments) as the model writes them."""
        raise NotImplementedError

    def write_result(self, content: str) -> str:
        """A tool's result, as a user message for a template that knows no tool role."""
        return f"<tool_response>\n{content}\n</tool_response>"

    def instructions(self, functions: list[dict]) -> str:
        """The system message that describes the tools to a template that does not take them."""
        tools = "\n".join(json.dumps({"type": "function", "function": f}, ensure_ascii=False) for f in functions)
        return SYSTEM_BLOCK.format(tools=tools, how=self.how())

    def how(self) -> str:
        return "To call a function, write:\n" + self.write_calls([("<function-name>", {"<argument>": "<value>"})])


class JsonValueEnd:
    """Where one JSON value ends, in text that arrives in pieces."""

    def __init__(self):
        self.depth, self.in_string, self.escape, self.done = 0, False, False, False

    def feed(self, text: str) -> int:
        """How many leading characters of text belong to the value."""
        for i, ch in enumerate(text):
            if self.in_string:
                if self.escape:
                    self.escape = False
                elif ch == "\\":
                    self.escape = True
                elif ch == '"':
                    self.in_string = False
                    if self.depth == 0:
                        self.done = True
                        return i + 1
            elif ch == '"':
                self.in_string = True
            elif ch in "{[":
                self.depth += 1
            elif ch in "}]" or (self.depth == 0 and ch in ", \t\r\n"):
                if self.depth == 0:  # the end of a bare number, true, false or null
                    self.done = True
                    return i
                self.depth -= 1
                if self.depth == 0:
                    self.done = True
                    return i + 1
        return len(text)


class CallStream:
    """A format's parser: feed() returns what a piece of text settles, content and OpenAI's
    tool call chunks (the first of a call has its id, type and name; then its arguments follow
    as they are written); finish() returns the content still held at the end.

    A subclass's step() takes what it can from self.pending and says whether to go on."""

    def __init__(self):
        self.pending = ""
        self.calls: list[dict] = []  # OpenAI's tool call objects, arguments as written so far
        self.content, self.chunks = "", []

    def feed(self, text: str) -> tuple[str, list[dict]]:
        self.pending += text
        while self.step():
            pass
        out = self.content, self.chunks
        self.content, self.chunks = "", []
        return out

    def step(self) -> bool:
        raise NotImplementedError

    new_id = staticmethod(call_id)  # a call's id, as the format's templates accept them

    def open_call(self, name: str, arguments: str = "") -> None:
        call = {"id": self.new_id(), "type": "function", "function": {"name": name, "arguments": arguments}}
        self.calls.append(call)
        self.chunks.append({"index": len(self.calls) - 1, **call, "function": dict(call["function"])})

    def add_arguments(self, piece: str) -> None:
        if piece:
            self.calls[-1]["function"]["arguments"] += piece
            self.chunks.append({"index": len(self.calls) - 1, "function": {"arguments": piece}})

    def text_until(self, tag: str) -> bool:
        """Content up to tag (True: found, and consumed), holding a partial tag back."""
        at = self.pending.find(tag)
        if at < 0:
            keep = partial_tag(self.pending, tag)
            self.content += self.pending[:len(self.pending) - keep]
            self.pending = self.pending[len(self.pending) - keep:]
            return False
        self.content += self.pending[:at]
        self.pending = self.pending[at + len(tag):]
        return True


def whole_call(body: str) -> tuple[str, str] | None:
    """(name, arguments) of a call written as one JSON object in any key order, else None."""
    try:
        call = json.loads(body)
    except ValueError:
        return None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return None
    return call["name"], json.dumps(call.get("arguments", call.get("parameters", {})), ensure_ascii=False)


def json_head(arguments_keys: str) -> re.Pattern:
    """The start of a JSON call up to its arguments: {"name": "...", "arguments": """
    return re.compile(rf'\s*\{{\s*"name"\s*:\s*({NAME})\s*,\s*"(?:{arguments_keys})"\s*:\s*')


class JsonCalls(CallStream):
    """Calls written as JSON objects, {"name": ..., "arguments": {...}}, one after another with a
    separator between them; each call's arguments stream as they are written. A subclass's
    begin() finds where the calls start (state "head"); the text before them is content, and so
    is the rest once something other than a call follows, or a call does not parse."""

    head_pattern = json_head("arguments")
    separator = ","
    end = ""  # the character that closes the calls, if any

    def __init__(self):
        super().__init__()
        self.state = "text"
        self.opened = ""  # the opener the calls began with, given back as content if none parses
        self.value: JsonValueEnd | None = None

    def begin(self) -> bool:
        raise NotImplementedError

    def step(self) -> bool:
        if self.state == "text":
            return self.begin()
        if self.state == "head":
            return self.head()
        if self.state == "args":
            if not self.calls[-1]["function"]["arguments"]:  # no whitespace before the value
                self.pending = self.pending.lstrip()
            n = self.value.feed(self.pending)
            self.add_arguments(self.pending[:n])
            self.pending = self.pending[n:]
            if self.value.done:
                self.state = "close"
            return self.value.done
        rest = self.pending.lstrip()
        if not rest:
            return False
        if self.state == "close":  # the call object's own }
            self.pending, self.state = rest[1:] if rest[0] == "}" else rest, "between"
        elif rest[0] == self.separator:
            self.pending, self.state = rest[1:], "head"
        elif self.end and rest[0] == self.end:
            self.pending, self.state = rest[1:], "after"
        else:
            self.state = "after"
        if self.state == "after":
            self.content, self.pending = self.content + self.pending, ""
            return False
        return True

    def head(self) -> bool:
        head = self.head_pattern.match(self.pending)
        if head:
            self.open_call(json.loads(head.group(1)))
            self.pending, self.state, self.value = self.pending[head.end():], "args", JsonValueEnd()
            return True
        rest = self.pending.lstrip()
        if not rest:
            return False
        end = JsonValueEnd()
        n = end.feed(rest) if rest[0] == "{" else 0
        if rest[0] == "{" and not end.done:
            return False  # maybe a call with its keys in another order: wait for its end
        call = whole_call(rest[:n]) if n else None
        if call is None:
            self.content += (self.opened if not self.calls else "") + self.pending
            self.pending, self.state = "", "after"
            return False
        self.open_call(*call)
        self.pending, self.state = rest[n:], "between"
        return True

    def finish(self) -> str:
        rest, self.pending = self.pending, ""
        if self.state == "head" and not self.calls:
            return self.opened + rest
        return rest if self.state in ("text", "after") else ""
