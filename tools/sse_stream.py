"""A streamed POST read as server-sent events, as lean as the load generator can make it: h11
(the HTTP/1.1 state machine hypercorn serves with) over one trio TCP stream, the events split
from the body as bytes.

On a 2-core machine the load generator's CPU is taken from the server it measures: httpx's
streaming costs about 0.3 ms of CPU a token, which at the default model's 4-5 ms a token is
the gap between the served figure and the forward's. This path does the same work in a
fraction (BENCHMARKS.md, "Batch 1 through every tool"). Plain http:// only, one connection a
request; tools/loadtest.py takes httpx for https:// and --keep-alive.
"""

import json
from urllib.parse import urlsplit

import h11
import trio

READ = 1 << 16


class StreamError(Exception):
    """Why a stream ended early: connect, timeout or disconnected."""


async def events(url: str, body: dict, headers: dict, timeout: float):
    """Yield the response's status code, then the data of each event as it arrives (a
    non-200 response's body is not read)."""
    parts = urlsplit(url)
    try:
        stream = await trio.open_tcp_stream(parts.hostname, parts.port or 80)
    except OSError:
        raise StreamError("connect") from None
    conn = h11.Connection(h11.CLIENT)
    payload = json.dumps(body).encode()
    request = h11.Request(method="POST", target=parts.path or "/", headers=[
        ("Host", parts.netloc), ("Content-Type", "application/json"), ("Content-Length", str(len(payload))),
        ("Connection", "close"), *headers.items()])
    async with stream:
        try:
            await stream.send_all(conn.send(request) + conn.send(h11.Data(data=payload)) + conn.send(h11.EndOfMessage()))
            pending = b""
            while True:
                event = conn.next_event()
                if event is h11.NEED_DATA:
                    with trio.move_on_after(timeout) as waited:
                        conn.receive_data(await stream.receive_some(READ))
                    if waited.cancelled_caught:
                        raise StreamError("timeout")
                elif isinstance(event, h11.Response):
                    yield event.status_code
                    if event.status_code != 200:
                        return
                elif isinstance(event, h11.Data):
                    pending += event.data.replace(b"\r\n", b"\n")
                    *complete, pending = pending.split(b"\n\n")
                    for raw in complete:
                        for line in raw.split(b"\n"):
                            if line.startswith(b"data:"):
                                yield line[5:].strip().decode()
                elif isinstance(event, (h11.EndOfMessage, h11.ConnectionClosed)):
                    return
        except (h11.RemoteProtocolError, trio.BrokenResourceError, OSError):
            raise StreamError("disconnected") from None
