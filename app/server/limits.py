"""What one client may hold of the server: every connection, header, body and WebSocket limit,
with defaults that protect a laptop, and the `serve` flags that change them.

The defaults follow what nginx and Hypercorn's deployment notes settle on: short keep-alive,
a deadline for request headers (slowloris), bounded request heads and bodies, and pings that
find dead WebSocket peers.
"""

from dataclasses import dataclass, fields

MIB = 1 << 20


@dataclass(frozen=True)
class Limits:
    max_connections: int = 512  # open at once; at the limit the longest-idle one makes room, else 503
    max_header_bytes: int = 16 * 1024  # request line plus headers; over it: 431
    max_headers: int = 100  # header fields in one request; over it: 431
    header_timeout: float = 10.0  # first byte of a request to the end of its headers; past it: 408
    body_timeout: float = 30.0  # end of the headers to the end of the body; past it: 408
    keep_alive_timeout: float = 5.0  # an idle keep-alive connection closes after this
    send_timeout: float = 30.0  # a peer that reads nothing for this long is dropped
    max_body_bytes: int = 4 * MIB  # request body; over it: 413
    ws_max_message_bytes: int = 4 * MIB  # one WebSocket message; over it: close 1009
    ws_ping_interval: float = 20.0  # the server pings each WebSocket this often
    ws_idle_timeout: float = 60.0  # nothing from the peer, pongs included, for this long: close 1001
    ws_max_generations: int = 32  # generations in flight on one WebSocket; over it: error frame (429)

    @classmethod
    def from_args(cls, args) -> "Limits":
        return cls(**{f.name: getattr(args, f.name) for f in fields(cls)})

    def check(self) -> None:
        """One ValueError line for a value that can never work."""
        for f in fields(self):
            if getattr(self, f.name) <= 0:
                raise ValueError(f"--{f.name.replace('_', '-')} must be positive")


FLAGS = {
    "max_connections": "most client connections open at once; at the limit the longest-idle one is closed to make"
                       " room, else the newcomer gets 503",
    "max_header_bytes": "most bytes in a request line plus headers (431 over it)",
    "max_headers": "most header fields in one request (431 over it)",
    "header_timeout": "seconds from a request's first byte to the end of its headers (408 past it)",
    "body_timeout": "seconds to receive a request body (408 past it)",
    "keep_alive_timeout": "seconds an idle keep-alive connection stays open",
    "send_timeout": "seconds a client may read nothing while the server writes before it is dropped",
    "max_body_bytes": "most bytes in a request body (413 over it)",
    "ws_max_message_bytes": "most bytes in one WebSocket message (close code 1009 over it)",
    "ws_ping_interval": "seconds between the server's WebSocket pings",
    "ws_idle_timeout": "seconds a WebSocket may send nothing, pongs included, before it is closed (1001)",
    "ws_max_generations": "most generations in flight on one WebSocket (an error frame, status 429, over it)",
}


def add_arguments(parser) -> None:
    group = parser.add_argument_group("limits", "what one client may hold (README: Limits and hardening)")
    defaults = Limits()
    for name, help_text in FLAGS.items():
        default = getattr(defaults, name)
        group.add_argument(f"--{name.replace('_', '-')}", type=type(default), default=default,
                           help=f"{help_text} (default: {default:g})" if isinstance(default, float)
                           else f"{help_text} (default: {default})")
