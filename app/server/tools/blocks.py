"""What the formats that write a call as one block share: the block read whole once it ends, and
the grammar of calls whose arguments are written a parameter at a time.

Most models' calls are a block between markers: a JSON list after a marker (Granite's), or tags
with a parameter in each (GLM's, MiniMax's). Such a block's calls are released when it ends, so
their arguments arrive whole; the grammar holds each to its schema all the same.
"""

import json
import re

from app.server.tools.base import CallStream, JsonValueEnd, ToolFormat, json_lark, parameters
from app.server.tools.qwen3_coder import typed

ANY = r"ANY_TEXT: /(.|\n)*/"  # a value up to a marker that is a token of its own


def json_end(text: str) -> int | None:
    """Where the JSON value at the start of text (after whitespace) ends; None: not yet."""
    start = len(text) - len(text.lstrip())
    if start == len(text):
        return None
    value = JsonValueEnd()
    n = value.feed(text[start:])
    return start + n if value.done else None


def json_value(text: str):
    """The JSON value text spells, else None."""
    try:
        return json.loads(text)
    except ValueError:
        return None


def arguments_of(value) -> dict | None:
    """A call's arguments, given as an object or as JSON text of one (Apriel's)."""
    if isinstance(value, str):
        value = json_value(value)
    return value if isinstance(value, dict) else None


def bare_value(text: str, schema: dict):
    """A parameter written as bare text, read as its schema says: a string stays text; anything
    else is the JSON it spells (else text)."""
    return json.loads(typed(text, schema))


def regex_literal(text: str) -> str:
    return re.escape(text).replace("/", "\\/")


class BlockFormat(ToolFormat):
    """A format whose calls come in blocks that open with `opener` and end with `closer` (or,
    with no closer, at the end of the JSON value after the opener). A subclass reads a block."""

    closer = ""

    def block_end(self, text: str) -> int | None:
        """Where the block that text begins (after its opener) ends, past any closer; None: not yet."""
        if not self.closer:
            return json_end(text)
        at = text.find(self.closer)
        return None if at < 0 else at + len(self.closer)

    def read(self, body: str, properties: dict[str, dict]) -> list[tuple[str, dict]] | None:
        """The calls (name, arguments) in a block's body, between opener and closer; None: the
        block is not calls. properties: each function's parameter schemas, by name."""
        raise NotImplementedError

    def parser(self, use):
        return BlockParser(self, {f["name"]: parameters(f).get("properties", {}) for f in use.functions})

    def value_rule(self, rule: str, schema: dict, end: str) -> list[str]:
        """Lark rules for a parameter's value written bare, then end: a string up to the first
        end (lazy), anything else as JSON."""
        if schema.get("type") == "string" and "enum" not in schema:
            count = "*"
            if "maxLength" in schema or "minLength" in schema:
                count = f"{{{schema.get('minLength', 0)},{schema.get('maxLength', '')}}}"
            if self.opens_with_token(end):
                if count == "*":
                    return [f"{rule}: ANY_TEXT {self.marker(end)}", ANY]
                return [f"{rule}: {rule.upper()}_TEXT {self.marker(end)}", f"{rule.upper()}_TEXT: /(.|\\n){count}/"]
            return [f"{rule}[lazy]: /(.|\\n){count}{regex_literal(end)}/"]
        if "enum" in schema and all(isinstance(v, str) for v in schema["enum"]):
            return [f"{rule}: ({' | '.join(json.dumps(v) for v in schema['enum'])}) {self.marker(end)}"]
        return [f"{rule}: {json_lark(schema)} {self.marker(end)}"]

    def keyed_calls(self, functions: list[dict], head, key, end, tail: str, between: str = "",
                    bare: bool = True) -> str:
        """Lark: `call`, any one function's call written a parameter at a time: head(name), then
        each parameter in the schema's order (optional unless required) as key(name, schema),
        its value (bare: a string as text up to end; else every value as JSON) and end, with
        between among them; then tail. head, key and between give Lark; end is text, or a
        function of the parameter's name that gives it."""
        rules, alternatives = [], []
        for i, f in enumerate(functions):
            schema = parameters(f)
            required = set(schema.get("required", []))
            props = list(schema.get("properties", {}).items())
            for j, (name, prop) in enumerate(props):
                closing = end(name) if callable(end) else end
                value = self.value_rule(f"f{i}p{j}v", prop, closing) if bare else [
                    f"f{i}p{j}v: {json_lark(prop)} {self.marker(closing) if closing else ''}"]
                rules += [f"f{i}p{j}: {key(name, prop)} f{i}p{j}v", *value]
            # f{i}a{j}: the parameters from j on, one written already; f{i}n{j}: none written yet
            rules += [f'f{i}a{len(props)}: ""', f'f{i}n{len(props)}: ""']
            for j, (name, _) in enumerate(props):
                later = f"{between} f{i}p{j} f{i}a{j + 1}"
                first = f"f{i}p{j} f{i}a{j + 1}"
                if name in required:
                    rules += [f"f{i}a{j}: {later}", f"f{i}n{j}: {first}"]
                else:
                    rules += [f"f{i}a{j}: {later} | f{i}a{j + 1}", f"f{i}n{j}: {first} | f{i}n{j + 1}"]
            alternatives.append(f"f{i}")
            rules.append(f"f{i}: {head(f['name'])} f{i}n0 {tail}")
        return "\n".join([f"call: {' | '.join(alternatives)}", *dict.fromkeys(rules)])


class BlockParser(CallStream):
    """Text until a block opens; then the block, read whole once it ends: its calls, or content
    when it is not calls. A block the output ends inside is content."""

    def __init__(self, fmt: BlockFormat, properties: dict[str, dict]):
        super().__init__()
        self.fmt, self.properties, self.inside = fmt, properties, False

    def step(self) -> bool:
        if not self.inside:
            self.inside = self.text_until(self.fmt.opener)
            return self.inside
        end = self.fmt.block_end(self.pending)
        if end is None:
            return False
        block, self.pending, self.inside = self.pending[:end], self.pending[end:], False
        release(self, self.fmt, block, self.properties)
        return True

    def finish(self) -> str:
        rest, self.pending = self.pending, ""
        return self.fmt.opener + rest if self.inside else rest


def release(stream: CallStream, fmt: BlockFormat, block: str, properties: dict[str, dict]) -> None:
    """A whole block (up to its closer) onto stream: its calls, or the block as content where it
    is not calls."""
    calls = fmt.read(block.removesuffix(fmt.closer) if fmt.closer else block, properties)
    if calls is None:
        stream.content += fmt.opener + block
    for name, arguments in calls or ():
        stream.open_call(name, json.dumps(arguments, ensure_ascii=False))


def named_calls(value, name_key: str = "name", arguments_key: str = "arguments") -> list[tuple[str, dict]] | None:
    """The calls in a JSON call object or list of them, {name_key: ..., arguments_key: {...}}
    (arguments as an object or as JSON text); None: not that."""
    calls = []
    for item in value if isinstance(value, list) else [value]:
        arguments = arguments_of(item.get(arguments_key, {})) if isinstance(item, dict) else None
        if arguments is None or not isinstance(item.get(name_key), str):
            return None
        calls.append((item[name_key], arguments))
    return calls or None


class JsonBlock(BlockFormat):
    """Calls as JSON after the opener: a list of call objects (listed), else one object a
    block; {name_key: ..., arguments_key: {...}} each."""

    name_key, arguments_key = "name", "arguments"
    listed = True

    def call_object(self, index: int, name: str, arguments: dict) -> dict:
        return {self.name_key: name, self.arguments_key: arguments}

    def object_schema(self, function: dict) -> dict:
        return {"type": "object", "additionalProperties": False, "required": [self.name_key, self.arguments_key],
                "properties": {self.name_key: {"const": function["name"]}, self.arguments_key: parameters(function)}}

    def body(self, functions, parallel):
        schemas = [self.object_schema(f) for f in functions]
        one = schemas[0] if len(schemas) == 1 else {"anyOf": schemas}
        close = f" {self.marker(self.closer)}" if self.closer else ""
        if self.listed:
            calls = {"type": "array", "minItems": 1, "items": one, **({} if parallel else {"maxItems": 1})}
            return f"body: {json_lark(calls)}{close}"
        more = f' ("\\n"? {self.marker(self.opener)} call{close})*' if parallel else ""
        return f"body: call{close}{more}\ncall: {json_lark(one)}"

    def read(self, body, properties):
        return named_calls(json_value(body), self.name_key, self.arguments_key)

    def write_calls(self, calls):
        objects = [json.dumps(self.call_object(i, n, a), ensure_ascii=False) for i, (n, a) in enumerate(calls)]
        if self.listed:
            return f"{self.opener}[{', '.join(objects)}]{self.closer}"
        return "\n".join(f"{self.opener}{o}{self.closer}" for o in objects)
