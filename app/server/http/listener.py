"""Spool's HTTP listener: accepts TCP connections and runs each one (connection.py) in its own
task, under --max-connections, with the app's ASGI lifespan around it. It takes the place of
`hypercorn.trio.serve`, whose connections can fail into the server's nursery; the protocol code
(HTTP/1.1 by h11, WebSocket by wsproto) is still Hypercorn's.

At the connection limit a newcomer is on probation: once it has sent a whole request head (a
real client does at once) it displaces the connection that has waited longest without a
request in flight (an idle keep-alive, or one still trickling its headers), as nginx reuses
idle keep-alive connections. A newcomer that sends no head within PROBATION seconds, or finds
every connection busy, gets 503 with Retry-After. So slow clients cannot lock out fast ones,
and cannot churn the server either: evicting on arrival let each reconnecting slowloris evict
another (40,000 evictions in 30 s at 600 of them, BENCHMARKS.md).
"""

import functools
import logging
import resource
from collections import Counter
from dataclasses import dataclass, field

import trio
from hypercorn.app_wrappers import ASGIWrapper
from hypercorn.config import Config as HypercornConfig
from hypercorn.trio.lifespan import Lifespan
from hypercorn.trio.worker_context import WorkerContext

from app.server.http.connection import LINGER, MAX_RECV, Connection, canned_response, half_close
from app.server.limits import Limits

log = logging.getLogger("spool.listener")

CLOSE_REASONS = ("client", "done", "keep_alive", "shutdown", "bad_request", "header_timeout", "send_timeout",
                 "ws_idle", "http2", "evicted", "limit", "error")
PROBATION = 1.0  # seconds a newcomer at the limit has to send a whole request head
REFUSAL = canned_response(503, "Service Unavailable", "too many connections; retry shortly", "too_many_connections",
                          {"retry-after": "1"})


@dataclass
class ConnectionStats:
    """Read by /metrics: connections open now, and every closed one by why it closed."""
    open: int = 0
    closed: Counter = field(default_factory=Counter)


class HttpServer:
    """Every connection the listener accepted: the limit, probation and eviction, and shutdown.
    Connections read their settings (app, Hypercorn config, limits) from here."""

    def __init__(self, app, limits: Limits, stats: ConnectionStats):
        self.limits, self.stats = limits, stats
        self.app = ASGIWrapper(app)
        self.config = hypercorn_config(limits)
        self.context = WorkerContext(None)
        self.lifespan_state: dict = {}
        self.connections: dict[Connection, None] = {}  # open ones, oldest first
        self.probation_scopes: dict = {}  # newcomers at the limit without a whole request head yet, oldest first
        self.terminating_since: float | None = None

    async def handle(self, stream: trio.SocketStream) -> None:
        """One accepted socket, start to end; never raises but Cancelled."""
        head = b""
        if len(self.connections) >= self.limits.max_connections:
            head = await self.probation(stream)
            if head is None or (len(self.connections) >= self.limits.max_connections and not self.evict()):
                await refuse(stream, linger=bool(head))
                self.stats.closed["limit"] += 1
                return
        conn = Connection(stream, self, head)
        self.connections[conn] = None
        self.stats.open += 1
        try:
            await conn.run()
        finally:
            self.connections.pop(conn, None)
            self.stats.open -= 1
            self.stats.closed[conn.reason] += 1
            if conn.reason not in ("client", "done", "keep_alive", "shutdown"):
                log.debug(f"closed {conn.peer}: {conn.reason}")

    async def probation(self, stream: trio.SocketStream) -> bytes | None:
        """What a newcomer at the limit sent, once it holds a whole request head; None if it
        sends none in time. Probation holds at most --max-connections sockets: past that the
        one on probation longest goes (a real client is there for milliseconds)."""
        if len(self.probation_scopes) >= self.limits.max_connections:
            self.probation_scopes.pop(next(iter(self.probation_scopes))).cancel()
        scope = trio.CancelScope(deadline=trio.current_time() + PROBATION)
        self.probation_scopes[scope] = scope
        data = b""
        try:
            with scope:
                while b"\r\n\r\n" not in data and len(data) <= self.limits.max_header_bytes:
                    if not (chunk := await stream.receive_some(MAX_RECV)):
                        return None
                    data += chunk
                return data
            return None
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            return None
        finally:
            self.probation_scopes.pop(scope, None)

    def evict(self) -> bool:
        """Close the connection that has waited longest with no request in flight."""
        waiting = [(since, id(c), c) for c in self.connections if (since := c.waiting_since) is not None]
        if not waiting:
            return False
        victim = min(waiting)[2]
        self.connections.pop(victim)
        victim.abort("evicted")
        return True

    async def terminate(self) -> None:
        """Shutdown: idle connections close now, busy ones after their response."""
        self.terminating_since = trio.current_time()
        await self.context.terminated.set()  # Hypercorn's h11 code then closes after each response
        for conn in self.connections:
            conn.timer.cancel()


async def refuse(stream: trio.SocketStream, linger: bool) -> None:
    """503, then, for a client that sent its request, linger so it reads the 503 rather than a
    reset; one that never finished its head is not worth the wait."""
    with trio.move_on_after(LINGER if linger else 0.1):
        try:
            await stream.send_all(REFUSAL)
            await half_close(stream)
            while linger and await stream.receive_some(MAX_RECV):
                pass
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass


def hypercorn_config(limits: Limits) -> HypercornConfig:
    """The settings Hypercorn's protocol code reads; Spool's own timers do the rest."""
    config = HypercornConfig()
    config.h11_max_incomplete_size = limits.max_header_bytes
    config.websocket_max_message_size = limits.ws_max_message_bytes
    config.websocket_ping_interval = limits.ws_ping_interval
    config.accesslog = None  # Spool writes its own access line per request
    config.errorlog = logging.getLogger("hypercorn.error")
    return config


def raise_open_files_limit(needed: int) -> None:
    """Each connection is a file descriptor; lift the soft limit toward the hard one if it is
    below what --max-connections needs (macOS starts at 256)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft >= needed:
        return
    target = needed if hard == resource.RLIM_INFINITY else min(needed, hard)
    resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    if target < needed:
        log.warning(f"open files are limited to {target}; --max-connections may be refused at accept")


async def serve_http(app, limits: Limits, stats: ConnectionStats, host: str, port: int, shutdown_trigger,
                     graceful_timeout: float, tls=None, task_status=trio.TASK_STATUS_IGNORED) -> None:
    """Listen on host:port until shutdown_trigger returns, then stop accepting, let busy
    connections finish for graceful_timeout, and close the rest. Bind errors raise OSError. tls:
    an ssl.SSLContext to serve HTTPS with."""
    raise_open_files_limit(limits.max_connections + 64)
    server = HttpServer(app, limits, stats)
    lifespan = Lifespan(server.app, server.config, server.lifespan_state)
    async with trio.open_nursery() as lifespan_nursery:
        await lifespan_nursery.start(lifespan.handle_lifespan)
        await lifespan.wait_for_startup()
        listeners = await trio.open_tcp_listeners(port, host=host)
        if tls is not None:  # HTTPS: each connection's TLS handshake happens on its first read or write
            listeners = [trio.SSLListener(listener, tls, https_compatible=True) for listener in listeners]
        async with trio.open_nursery() as connections:
            async with trio.open_nursery() as accepting:
                accepting.start_soon(functools.partial(
                    trio.serve_listeners, server.handle, listeners, handler_nursery=connections))
                task_status.started()
                await shutdown_trigger()
                accepting.cancel_scope.cancel()  # closes the listeners
            await server.terminate()
            connections.cancel_scope.deadline = trio.current_time() + graceful_timeout
        await lifespan.wait_for_shutdown()
        lifespan_nursery.cancel_scope.cancel()
