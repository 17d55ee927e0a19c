"""One log line per request on spool.http, as vLLM's and llama-server's users read their
servers' logs: method, path, status and latency, and for a generation its id, tokens, TTFT
and finish reasons. It is written when the response's last byte has gone, so a stream's line
knows its tokens and its length; probes that orchestrators poll log at DEBUG, so polling them
leaves no INFO line.

An ASGI middleware around the app keeps a record per request, which sees every answer, the
app's refusals (401, 503...) included. A Generation made while serving the request attaches
itself to the record (a context variable the request's tasks inherit), and the line reads its
final counts. On the WebSocket, each generation gets a line of its own (method WS, a status
for how it ended) and the socket one line when it closes (101, or the refusal's status).
"""

import logging
import time
from contextvars import ContextVar
from dataclasses import dataclass, field

log = logging.getLogger("spool.http")

PROBES = frozenset({"/health", "/metrics", "/get_load"})  # what orchestrators and routers poll
CLIENT_GONE = 499  # nginx's status for a client that left before its response began


def ms(seconds: float) -> float:
    return round(1000 * seconds, 1)


@dataclass
class Record:
    """What one request's line says; written once."""

    remote: str
    method: str
    path: str
    started: float = field(default_factory=time.monotonic)
    status: int | None = None
    generation: object = None  # the Generation the request ran, read when the line is written
    written: bool = False

    def write(self) -> None:
        if self.written:
            return
        self.written = True
        level = logging.DEBUG if self.path in PROBES else logging.INFO
        if not log.isEnabledFor(level):
            return
        fields = {"remote": self.remote, "method": self.method, "path": self.path,
                  "status": self.status or CLIENT_GONE, "latency_ms": ms(time.monotonic() - self.started)}
        if self.generation is not None:
            fields.update(generation_fields(self.generation, self.started))
        log.log(level, text(fields), extra={"fields": fields})


def generation_fields(gen, started: float) -> dict:
    """The usage the client saw; a choice cut off before its final frame (the client gone, the
    deadline) counts the tokens it got."""
    completion = sum(c.completion_tokens if c.finish_reason else len(c.token_ids) for c in gen.choices.values())
    fields = {"request_id": gen.id, "prompt_tokens": gen.usage().prompt_tokens, "completion_tokens": completion}
    if gen.first_token_at is not None:
        fields["ttft_ms"] = ms(gen.first_token_at - started)
    fields["finish_reason"] = ",".join(sorted({c.finish_reason or "aborted" for c in gen.choices.values()}))
    return fields


def text(f: dict) -> str:
    """ADDRESS METHOD PATH STATUS LATENCY, then the generation's fields, as key=value."""
    line = f"{f['remote']} {f['method']} {f['path']} {f['status']} {f['latency_ms']:.0f}ms"
    if "request_id" in f:
        line += f" id={f['request_id']} prompt_tokens={f['prompt_tokens']} completion_tokens={f['completion_tokens']}"
        if "ttft_ms" in f:
            line += f" ttft={f['ttft_ms']:.0f}ms"
        line += f" finish={f['finish_reason']}"
    return line


current: ContextVar[Record | None] = ContextVar("spool_access_record", default=None)


def attach(gen) -> None:
    """The HTTP request being served runs gen: its line carries gen's tokens."""
    record = current.get()
    if record is not None:
        record.generation = gen


def websocket_line(remote: str, path: str, status: int, started: float, gen=None) -> None:
    """One generate frame's line: a generation's (from its submit), or a refused frame's."""
    Record(remote, "WS", path, started, status, gen).write()


class AccessLog:
    """ASGI middleware: a Record per HTTP request and per WebSocket, written when the response's
    last body message has gone, or when the app returns (a client gone mid-response)."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        record = Record((scope.get("client") or ("-",))[0], scope.get("method", "GET"), scope["path"])
        token = current.set(record if scope["type"] == "http" else None)

        async def watched(message) -> None:
            kind = message["type"]
            if kind in ("http.response.start", "websocket.http.response.start"):
                record.status = message["status"]
            elif kind == "websocket.accept":
                record.status = 101
            elif kind == "websocket.close" and record.status is None:
                record.status = 403  # Hypercorn refuses an upgrade the app closes before accepting
            await send(message)
            if kind == "http.response.body" and not message.get("more_body", False):
                record.write()

        try:
            await self.app(scope, receive, watched)
        except Exception:
            record.status = record.status or 500  # Hypercorn answers 500 for what escapes the app
            raise
        finally:
            current.reset(token)
            record.write()
