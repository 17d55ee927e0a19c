"""A custom (freeform) tool's Lark grammar as one regular expression.

A custom tool's call reaches the model as a function of one string, `input` (tools.py), so it
goes through every tool-call format's grammar as a JSON string; llguidance holds a JSON
string's text to a schema's `pattern`, escapes and all. A Lark grammar whose rules never
recur (Codex's apply_patch grammar is one) describes a regular language, which this module
writes out as that pattern: rules inlined from `start`, literals escaped, terminals' regexes
kept, `%import common.X` for the usual terminals. A grammar that recurs, or uses what is not
read here (%ignore, templates, other imports), is NotRegular: its tool's input then goes
unconstrained.
"""

import ast
import re

# the common.lark terminals a freeform grammar imports, as regexes
COMMON = {"LF": r"\n", "CR": r"\r", "NEWLINE": r"(?:\r?\n)+", "WS": r"[ \t\f\r\n]+", "WS_INLINE": r"[ \t]+",
          "DIGIT": "[0-9]", "HEXDIGIT": "[0-9a-fA-F]", "INT": "[0-9]+", "LETTER": "[A-Za-z]", "WORD": "[A-Za-z]+",
          "CNAME": "[_A-Za-z][_A-Za-z0-9]*", "ESCAPED_STRING": r'"(?:[^"\\]|\\.)*"'}

TOKEN = re.compile(r"""\s*(?:
    (?P<string>"(?:[^"\\\n]|\\.)*"i?)
  | (?P<regex>/(?:[^/\\\n]|\\.)+/[imsx]*)
  | (?P<arrow>->)
  | (?P<range>\.\.)
  | (?P<name>[_A-Za-z][_A-Za-z0-9]*)
  | (?P<number>[0-9]+)
  | (?P<op>[|()\[\]?*+~])
)""", re.VERBOSE)
RULE = re.compile(r"\s*\??([_A-Za-z][_A-Za-z0-9]*)(?:\.-?[0-9]+)?\s*:(.*)", re.DOTALL)


class NotRegular(ValueError):
    """The grammar is not read as one regex (why is the message)."""


def lark_regex(grammar: str) -> str:
    """The language of a Lark grammar's `start` rule as one regex (NotRegular when it is not)."""
    rules = rule_bodies(grammar)
    if "start" not in rules:
        raise NotRegular("the grammar has no start rule")
    return Inliner(rules).regex("start")


def rule_bodies(grammar: str) -> dict[str, str]:
    """Each rule's (or terminal's) right-hand side, continuation lines joined; imports as
    regexes, marked with a leading NUL."""
    rules: dict[str, str] = {}
    last = None
    for line in grammar.splitlines():
        line = re.sub(r"^\s*//.*", "", line)
        if not line.strip():
            continue
        if line.lstrip().startswith("%import"):
            for name in imported(line):
                rules[name] = "\0" + COMMON[name]
            continue
        if line.lstrip().startswith("%"):
            raise NotRegular(f"{line.split()[0]} is not read here")
        if line.lstrip().startswith("|") and last is not None:
            rules[last] += " " + line.strip()
            continue
        rule = RULE.match(line)
        if rule is None:
            raise NotRegular(f"cannot read the line {line.strip()!r}")
        last = rule.group(1)
        rules[last] = rule.group(2)
    return rules


def imported(line: str) -> list[str]:
    found = re.fullmatch(r"\s*%import\s+common\s*(?:\.\s*(\w+)|\(([\w\s,]+)\))\s*(?:->\s*\w+)?\s*", line)
    names = [found.group(1)] if found and found.group(1) else \
        [n.strip() for n in found.group(2).split(",")] if found else []
    if not names or any(n not in COMMON for n in names):
        raise NotRegular(f"cannot import {line.strip()!r}")
    return names


class Inliner:
    """Rules expanded into regexes, each once, refusing one that reaches itself."""

    def __init__(self, rules: dict[str, str]):
        self.rules, self.done, self.open = rules, {}, set()

    def regex(self, name: str) -> str:
        if name in self.done:
            return self.done[name]
        if name not in self.rules:
            raise NotRegular(f"{name} is not defined")
        if name in self.open:
            raise NotRegular(f"{name} recurs")
        self.open.add(name)
        body = self.rules[name]
        if body.startswith("\0"):
            out = body[1:]
        else:
            tokens = tokenize(body)
            out, rest = self.alternatives(tokens)
            if rest:
                raise NotRegular(f"cannot read {name} past {rest[0][1]!r}")
        self.open.discard(name)
        self.done[name] = out
        return out

    def alternatives(self, tokens: list) -> tuple[str, list]:
        options = []
        while True:
            sequence, tokens = self.sequence(tokens)
            options.append(sequence)
            if not tokens or tokens[0] != ("op", "|"):
                break
            tokens = tokens[1:]
        return (options[0] if len(options) == 1 else "(?:" + "|".join(options) + ")"), tokens

    def sequence(self, tokens: list) -> tuple[str, list]:
        out = ""
        while tokens and tokens[0] not in (("op", "|"), ("op", ")"), ("op", "]")):
            if tokens[0][0] == "arrow":  # an alias names the tree's node; the text is the same
                tokens = tokens[2:]
                continue
            item, tokens = self.atom(tokens)
            out += item
        return out, tokens

    def atom(self, tokens: list) -> tuple[str, list]:
        (kind, text), tokens = tokens[0], tokens[1:]
        if (kind, text) in (("op", "("), ("op", "[")):
            inner, tokens = self.alternatives(tokens)
            closing = ")" if text == "(" else "]"
            if not tokens or tokens[0] != ("op", closing):
                raise NotRegular(f"an unclosed {text}")
            out, tokens = f"(?:{inner})" + ("?" if text == "[" else ""), tokens[1:]
        elif kind == "string":
            out = literal(text)
            if tokens and tokens[0][0] == "range" and len(tokens) > 1 and tokens[1][0] == "string":
                out, tokens = f"[{re.escape(string_value(text))}-{re.escape(string_value(tokens[1][1]))}]", tokens[2:]
        elif kind == "regex":
            body, flags = text[1:].rsplit("/", 1)
            body = body.replace("\\/", "/")
            out = f"(?{flags}:{body})" if flags else f"(?:{body})"
        elif kind == "name":
            out = f"(?:{self.regex(text)})"
        else:
            raise NotRegular(f"unexpected {text!r}")
        if tokens and tokens[0][0] == "op" and tokens[0][1] in "?*+":
            out, tokens = out + tokens[0][1], tokens[1:]
        elif tokens and tokens[0] == ("op", "~"):
            out, tokens = repeat(out, tokens[1:])
        return out, tokens


def repeat(out: str, tokens: list) -> tuple[str, list]:
    """item ~ n, or item ~ n..m."""
    if not tokens or tokens[0][0] != "number":
        raise NotRegular("~ needs a count")
    low, tokens = tokens[0][1], tokens[1:]
    if len(tokens) > 1 and tokens[0][0] == "range" and tokens[1][0] == "number":
        return f"{out}{{{low},{tokens[1][1]}}}", tokens[2:]
    return f"{out}{{{low}}}", tokens


def tokenize(body: str) -> list[tuple[str, str]]:
    tokens, at = [], 0
    while body[at:].strip():
        found = TOKEN.match(body, at)
        if found is None:
            raise NotRegular(f"cannot read {body[at:].strip()[:20]!r}")
        tokens.append((found.lastgroup, found.group(found.lastgroup)))
        at = found.end()
    return tokens


def string_value(text: str) -> str:
    try:
        return ast.literal_eval(text.rstrip("i"))
    except (ValueError, SyntaxError):
        raise NotRegular(f"cannot read the string {text}") from None


def literal(text: str) -> str:
    escaped = re.escape(string_value(text))
    return f"(?i:{escaped})" if text.endswith("i") else escaped
