"""Hypercorn's HTTP/1.1 protocol (h11, and wsproto after an upgrade), with Spool's changes:

- HTTP/1.1 only, as vLLM's, SGLang's and llama.cpp's servers: HTTP/2 with prior knowledge is
  answered by SETTINGS and GOAWAY with HTTP_1_1_REQUIRED, which an HTTP/2 client (gRPC's
  included) reports at once, and an `Upgrade: h2c` header is ignored;
- a request head over --max-headers fields or --max-header-bytes gets 431 (h11 bounds a head
  only while it is incomplete);
- a pipelined request never stops the reading (PauseSignal);
- two Hypercorn races closed, each with a comment where it is handled;
- every malformed request is reported to the connection, for the metric.
"""

import h2.config
import h2.connection
import h2.errors
import trio
from hypercorn.events import Closed
from hypercorn.protocol.events import Data, EndData, Response
from hypercorn.protocol.h11 import H11Protocol
from hypercorn.protocol.ws_stream import WSStream

DISCONNECT_GRACE = 1.0  # the most a closing stream waits to tell the app


def http2_refusal() -> bytes:
    conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=False))
    conn.initiate_connection()
    conn.close_connection(error_code=h2.errors.ErrorCodes.HTTP_1_1_REQUIRED,
                          additional_data=b"this server speaks HTTP/1.1 only")
    return conn.data_to_send()


HTTP2_REFUSAL = http2_refusal()


class Http2Preface(Exception):
    """The client opened with HTTP/2's connection preface."""


class Paused(Exception):
    """A pipelined request waits in h11's buffer until the response before it is done."""


class PauseSignal:
    """Stands in for Hypercorn's `can_read` event, which it awaits inside the read path when h11
    pauses on a pipelined request: reading would stop until the response is done, and a client
    that left meanwhile would go unnoticed, its generation running on. Instead of blocking,
    `wait` raises Paused to the connection, which goes on reading and calls resume() once the
    response is done; if that happened already, it returns as the event would."""

    def __init__(self):
        self.ready = True

    async def set(self) -> None:
        self.ready = True

    async def clear(self) -> None:
        self.ready = False

    async def wait(self) -> None:
        await trio.lowlevel.checkpoint()
        if not self.ready:
            raise Paused()


class Http1Protocol(H11Protocol):
    """Hypercorn's HTTP/1.1 protocol without its HTTP/2 switch, with a header-count limit, with
    pipelining that never stops reading, and with every malformed request reported to the
    connection."""

    def __init__(self, *args, max_headers: int, on_bad_request):
        super().__init__(*args)
        self.max_headers, self.on_bad_request = max_headers, on_bad_request
        self.refused_websocket = False
        self.can_read = PauseSignal()

    async def resume(self, data: bytes) -> None:
        """Go on with the pipelined request (and any bytes held back since) after a response."""
        if data:
            self.connection.receive_data(data)
        await self._handle_events()

    async def stream_send(self, event) -> None:
        # Hypercorn's WSStream answers frames sent before its handshake was accepted with a 400
        # (RFC 6455 4.1 forbids them), but marks itself closed only once that answer is written:
        # an app that accepts meanwhile sends a 101 after the 400, which h11 refuses. Once a
        # refusal is on its way, nothing more of that WebSocket goes out.
        if isinstance(event, Response) and isinstance(self.stream, WSStream) and event.status_code >= 400:
            self.refused_websocket = True
        elif self.refused_websocket and isinstance(event, (Response, Data, EndData)):
            return
        await super().stream_send(event)

    async def _check_protocol(self, event) -> None:
        if event.method == b"PRI" and event.target == b"*" and event.http_version == b"2.0":
            raise Http2Preface()
        # An `Upgrade: h2c` header is ignored: the request is answered in HTTP/1.1 (RFC 9110 7.8).

    async def _create_stream(self, request) -> None:
        # h11 bounds a head only while it is incomplete; one that arrived whole is measured here.
        head_bytes = len(request.method) + len(request.target) + sum(len(k) + len(v) + 4 for k, v in request.headers)
        if len(request.headers) > self.max_headers or head_bytes > self.config.h11_max_incomplete_size:
            await self._send_error_response(431)
            await self.send(Closed())
            return
        await super()._create_stream(request)

    async def _close_stream(self) -> None:
        """Hypercorn hands the app its disconnect through the app's bounded queue; an app that
        stopped reading a body (413, 408) never empties it, and the put would hold this
        connection open forever. The app's tasks end with the connection anyway."""
        with trio.move_on_after(DISCONNECT_GRACE):
            await super()._close_stream()
        self.stream = None

    async def _send_error_response(self, status_code: int) -> None:
        self.on_bad_request(status_code)
        await super()._send_error_response(status_code)
