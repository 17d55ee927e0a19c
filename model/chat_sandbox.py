"""The Jinja sandbox a chat template renders in: transformers' (immutable, trim_blocks,
lstrip_blocks, loop controls, `raise_exception`, `strftime_now`, a `tojson` that keeps non-ASCII
text and takes json.dumps's keywords, `{% generation %}` blocks), bounded in time and size.

Two things go past transformers, as llama.cpp's renderer does, for real templates that need them:
a list the template builds may grow and shrink (Kimi K2's queue of call ids: append and pop),
and `tojson` writes what `map` yields as a list (llama.cpp's DeepSeek-R1 template).

A render is bounded in time and size, since a client's messages and template variables drive the
template's loops: it is read part by part (Template.generate), counting characters and watching
a deadline, and every call the template makes (range, a macro, an append) checks the deadline
too, so a loop that writes nothing cannot run on unseen; a string or list repeated with *, and a
list grown by append, is held to the size.
"""

import json
import time
from collections.abc import Iterator
from contextvars import ContextVar
from datetime import datetime

from jinja2.ext import Extension
from jinja2.sandbox import ImmutableSandboxedEnvironment, SandboxedEnvironment

LIST_CHANGES = frozenset({"append", "extend", "insert", "pop"})  # what templates do to their own lists


class ChatTemplateError(ValueError):
    """A template that rejects the messages (its raise_exception), or fails to render."""


class RenderBounds:
    """How long and how much one render may take; None: no bound."""

    def __init__(self, seconds: float | None = None, chars: int | None = None):
        self.seconds, self.chars = seconds, chars
        self.deadline = time.monotonic() + seconds if seconds is not None else None

    def check_time(self) -> None:
        if self.deadline is not None and time.monotonic() > self.deadline:
            raise ChatTemplateError(f"the chat template took longer than {self.seconds:g} s to render these messages")

    def check_size(self, chars: int) -> None:
        if self.chars is not None and chars > self.chars:
            raise ChatTemplateError(f"the chat template rendered more than {self.chars} characters for these messages")


bounds: ContextVar[RenderBounds] = ContextVar("render_bounds", default=RenderBounds())  # per thread


class GenerationBlocks(Extension):
    """{% generation %}...{% endgeneration %}: transformers marks the assistant's own tokens with
    it (for a training mask); a prompt is just the block's body."""

    tags = {"generation"}

    def parse(self, parser):
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


class BoundedSandbox(ImmutableSandboxedEnvironment):
    """transformers' sandbox, with the render's bounds checked at every call and every *."""

    intercepted_binops = frozenset({"*"})

    def is_safe_attribute(self, obj, attr, value):
        if type(obj) is list and attr in LIST_CHANGES:  # noqa: E721 (a list, not a subclass)
            return SandboxedEnvironment.is_safe_attribute(self, obj, attr, value)
        return super().is_safe_attribute(obj, attr, value)

    def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 (Jinja's own signature)
        bounds.get().check_time()
        out = super().call(__context, __obj, *args, **kwargs)
        grown = getattr(__obj, "__self__", None)
        if type(grown) is list:  # noqa: E721
            bounds.get().check_size(len(grown))
        return out

    def call_binop(self, context, operator, left, right):
        if operator == "*":
            sized, times = (left, right) if isinstance(right, int) else (right, left)
            if isinstance(sized, (str, list, tuple)) and isinstance(times, int):
                bounds.get().check_size(len(sized) * times)
        return super().call_binop(context, operator, left, right)


def raise_exception(message):
    raise ChatTemplateError(message)


def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys,
                      default=_listed)


def _listed(value):
    if isinstance(value, Iterator):
        return list(value)
    raise TypeError(f"Object of type {type(value).__name__} is not JSON serializable")


def environment() -> BoundedSandbox:
    env = BoundedSandbox(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols", GenerationBlocks])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env
