"""One client connection: Hypercorn's HTTP/1.1 and WebSocket protocol code over a Trio socket,
with Spool's socket handling around it. It replaces Hypercorn's TCPServer for two reasons.

The protocol (h11 and wsproto, driven by Hypercorn's classes, with Spool's fixes) is in
http1.py. The crash this layer fixes (hypercorn 0.18): TCPServer writes under a lock, but its close path calls
`send_eof` outside that lock. An HTTP/2 client that sent GOAWAY while a response was being
written (SGLang's router does, at start-up) made `send_eof` and `send_all` meet on the socket:
trio.BusyResourceError, which TCPServer does not catch, escaped into the server's nursery and
ended the process. Here every write, the EOF included, takes one lock and has a deadline, and
whatever escapes the protocol code closes this connection only: logged once with the peer's
address and counted under `spool:connections_closed_total{reason="error"}`.

The timers a production server keeps, which TCPServer does not: request headers must arrive
within --header-timeout of their first byte (slowloris), an idle keep-alive connection closes,
a peer that stops reading is dropped, and a WebSocket that sends nothing, not even pongs, is
closed. While a pipelined request waits for the response before it, its bytes are held here and
reading goes on, so a client that leaves is seen at once.
"""

import functools
import json
import logging

import trio
from hypercorn.events import Closed, RawData, Updated
from hypercorn.protocol.ws_stream import WSStream
from hypercorn.trio.task_group import TaskGroup
from hypercorn.typing import ConnectionState
from wsproto.events import CloseConnection
from wsproto.utilities import LocalProtocolError

from app.server.errors import APIError
from app.server.http.http1 import HTTP2_REFUSAL, Http1Protocol, Http2Preface, Paused
from model.errors import is_failure

log = logging.getLogger("spool.connection")

MAX_RECV = 1 << 16
LINGER = 2.0  # after our last byte, read and discard this long so the peer gets it rather than a reset
APP_EXIT_GRACE = 5.0  # the app's tasks get this long to finish once the connection has ended
WS_SHUTDOWN_GRACE = 0.5  # on shutdown, a WebSocket's last frames get this long before close 1001


def canned_response(status: int, reason: str, message: str, code: str, headers: dict | None = None) -> bytes:
    """A whole HTTP/1.1 error response with OpenAI's error body, for the socket layer, which
    answers before (or instead of) the app."""
    body = json.dumps(APIError(status, message, code=code).body()).encode()
    head = {"content-type": "application/json", "content-length": str(len(body)), "connection": "close",
            **(headers or {})}
    lines = "".join(f"{k}: {v}\r\n" for k, v in head.items())
    return f"HTTP/1.1 {status} {reason}\r\n{lines}\r\n".encode() + body


def address(getname) -> tuple[str, int] | None:
    """(host, port) of a socket's end, or None once the peer is gone."""
    try:
        host, port, *_ = getname()
        return host, port
    except (OSError, ValueError):
        return None


async def half_close(stream) -> None:
    """Our side's end: TCP's FIN, the peer still free to send; a TLS stream can only close
    whole (its close_notify, then the socket)."""
    if isinstance(stream, trio.SSLStream):
        await stream.aclose()
    else:
        await stream.send_eof()


class Connection:
    """The socket side of one client: a read loop feeding the protocol, one lock for writes, and
    a watch task for the deadlines. `reason` says why it closed (the metric's label)."""

    def __init__(self, stream: trio.SocketStream, server, head: bytes = b""):
        self.stream, self.server, self.limits = stream, server, server.limits
        self.socket = getattr(stream, "transport_stream", stream).socket  # under TLS, the TCP socket
        self.peer_address = address(self.socket.getpeername)
        self.peer = "%s:%s" % self.peer_address if self.peer_address else "unknown peer"
        now = trio.current_time()
        self.reason: str | None = None
        self.busy = False  # a request, or a WebSocket, is in flight
        self.idle_since = now  # when it last became ready for a request
        self.partial_since: float | None = None  # first byte of a request whose headers are still coming
        self.last_received = now
        self.write_closed = False
        self.finished = False
        self.head = head  # bytes the listener read before handing the socket over
        self.held = b""  # bytes of a pipelined request, while the one before it is answered
        self.paused = False  # h11 holds a pipelined request until the response before it is done
        self.resuming = False  # that response is done: hand h11 the held bytes and go on
        self.send_lock = trio.Lock()
        self.read_scope = trio.CancelScope()
        self.receiving = trio.CancelScope()
        self.timer = trio.CancelScope()
        self.protocol: Http1Protocol | None = None

    @property
    def websocket(self) -> bool:
        return isinstance(getattr(self.protocol, "stream", None), WSStream)

    @property
    def waiting_since(self) -> float | None:
        """When it began to hold a slot without a request in flight; None while one is."""
        if self.busy or self.write_closed:
            return None
        return self.partial_since if self.partial_since is not None else self.idle_since

    def close_reason(self, reason: str) -> None:
        if self.reason is None:
            self.reason = reason

    async def run(self) -> None:
        server = self.server
        try:
            with trio.CancelScope() as ending:
                async with TaskGroup() as task_group:
                    self.protocol = Http1Protocol(
                        server.app, server.config, server.context, task_group,
                        ConnectionState(server.lifespan_state.copy()), False, self.peer_address,
                        address(self.socket.getsockname),
                        self.protocol_send, max_headers=self.limits.max_headers, on_bad_request=self.bad_request)
                    task_group.spawn(self.watch)
                    await self.read()
                    self.close_reason("client")
                    self.finished = True
                    self.timer.cancel()
                    ending.deadline = trio.current_time() + APP_EXIT_GRACE
                    await self.protocol.handle(Closed())  # the app sees the disconnect
        except* BaseException as group:
            # a handler's error, or a native library's panic (pyo3's is a BaseException), ends
            # this connection alone; a cancellation, an interrupt or an exit goes on up
            failed, fatal = group.split(is_failure)
            if failed is not None:
                self.reason = "error"
                log.warning(f"connection from {self.peer} failed and was closed: {failed.exceptions[0]!r}",
                            exc_info=failed)
            if fatal is not None:
                raise fatal
        finally:
            self.abort(self.reason or "shutdown")

    async def read(self) -> None:
        """Feed the protocol until the peer closes; after our side closed, discard for LINGER.
        While h11 holds a pipelined request (paused), later bytes wait in `held` (h11 would
        buffer them unbounded) and reading goes on, so a client that leaves is seen at once."""
        with self.read_scope:
            while True:
                if self.resuming:
                    data, self.held, self.paused, self.resuming = self.held, b"", False, False
                    feed = functools.partial(self.protocol.resume, data)
                elif self.head:
                    feed = functools.partial(self.protocol.handle, RawData(self.head))
                    self.head = b""
                else:
                    with trio.CancelScope() as self.receiving:  # cancelled when a pipelined request may go
                        try:
                            data = await self.stream.receive_some(MAX_RECV)
                        except (trio.BrokenResourceError, trio.ClosedResourceError):
                            return
                    if self.receiving.cancelled_caught:
                        continue
                    if not data:
                        return
                    self.last_received = trio.current_time()
                    if self.write_closed:
                        continue
                    if self.paused:
                        self.held += data
                        if len(self.held) > self.limits.max_header_bytes + self.limits.max_body_bytes:
                            self.abort("bad_request")  # pipelining more than a whole request
                        continue
                    feed = functools.partial(self.protocol.handle, RawData(data))
                if not self.busy and self.partial_since is None:
                    self.partial_since = trio.current_time()
                    self.timer.cancel()  # the header deadline may come before the keep-alive one
                try:
                    await feed()
                except Paused:
                    self.paused = True
                except Http2Preface:
                    await self.close("http2", HTTP2_REFUSAL)

    async def protocol_send(self, event) -> None:
        if isinstance(event, RawData):
            await self.write(event.data)
        elif isinstance(event, Closed):
            await self.close("done")
        elif isinstance(event, Updated):
            self.busy = not event.idle
            self.partial_since = None
            if event.idle:
                self.idle_since = trio.current_time()
                if self.paused:
                    self.resuming = True  # the pipelined request's turn
                    self.receiving.cancel()
            self.timer.cancel()  # the deadline depends on what is in flight

    def bad_request(self, status: int) -> None:
        self.close_reason("bad_request")
        log.debug(f"{self.peer}: malformed request, answered {status}")

    async def on_socket(self, action) -> None:
        """The one way to write: under the send lock, so data and the EOF never meet on the
        socket. Shielded, the wait for the lock included: writers are often app tasks that are
        being cancelled, and a write cut short, or skipped after the protocol counted it as sent,
        would corrupt the stream. Bounded, so a peer that stops reading cannot hold the
        connection (or a shutdown) forever."""
        with trio.CancelScope(shield=True), trio.move_on_after(self.limits.send_timeout) as deadline:
            async with self.send_lock:
                if self.write_closed:
                    return
                try:
                    await action()
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    self.abort("client")
                    return
        if deadline.cancelled_caught:
            self.abort("send_timeout")

    async def write(self, data: bytes) -> None:
        await self.on_socket(functools.partial(self.stream.send_all, data))

    async def close(self, reason: str, last: bytes = b"") -> None:
        """Our side is done: the last bytes, if any, then EOF, then linger so the peer reads them.
        The reason is recorded first: a peer that reads the last bytes and hangs up at once would
        otherwise be counted as having left ("client"). The close must happen even if the task
        asking for it is being cancelled (Quart cancels its response task when the app learns of
        a disconnect): on_socket shields it."""
        self.close_reason(reason)
        if last:
            await self.write(last)

        async def send_eof():
            self.write_closed = True
            await half_close(self.stream)

        await self.on_socket(send_eof)
        self.read_scope.deadline = min(self.read_scope.deadline, trio.current_time() + LINGER)

    def abort(self, reason: str) -> None:
        """Close the socket now: a blocked read or write wakes with ClosedResourceError."""
        self.close_reason(reason)
        self.write_closed = True
        self.read_scope.cancel()
        self.socket.close()

    def deadline(self) -> float:
        limits, server = self.limits, self.server
        if self.websocket:
            deadline = self.last_received + limits.ws_idle_timeout
            if server.terminating_since is not None:
                deadline = min(deadline, server.terminating_since + WS_SHUTDOWN_GRACE)
            return deadline
        if self.busy or self.write_closed:
            return float("inf")
        if server.terminating_since is not None:
            return server.terminating_since
        if self.partial_since is not None:
            return self.partial_since + limits.header_timeout
        return self.idle_since + limits.keep_alive_timeout

    async def watch(self) -> None:
        """Sleep until the deadline that the connection's state sets; state changes that bring it
        closer cancel `timer`, and a deadline found later than first thought is slept to again."""
        while not self.finished:
            with trio.CancelScope(deadline=self.deadline()) as self.timer:
                await trio.sleep_forever()
            if not self.finished and trio.current_time() >= self.deadline():
                await self.expire()
                return

    async def expire(self) -> None:
        shutting_down = self.server.terminating_since is not None
        if self.websocket:
            try:
                frame = self.protocol.stream.connection.send(CloseConnection(
                    code=1001, reason="server shutting down" if shutting_down else "idle timeout"))
            except (AttributeError, LocalProtocolError):  # not accepted yet, or a close is under way
                frame = b""
            await self.close("shutdown" if shutting_down else "ws_idle", frame)
        elif shutting_down:
            await self.close("shutdown")
        elif self.partial_since is not None:
            await self.close("header_timeout", canned_response(
                408, "Request Timeout", f"the request headers took longer than --header-timeout"
                f" ({self.limits.header_timeout:g} s)", "header_timeout"))
        else:
            await self.close("keep_alive")
