"""Which web pages may drive the server. A key-less Spool on 127.0.0.1 (the default) is within
reach of every page its user opens, so three checks make the browser's own rules hold:

- Host, against DNS rebinding: a page on evil.example whose name later resolves to 127.0.0.1
  is same-origin with the server as the browser sees it, but its requests say Host:
  evil.example. Bound to a loopback address, the server answers loopback names only
  (--allowed-hosts widens that); bound elsewhere, any name, as the address is reachable anyway.
  /health answers whatever the Host, as probes address the server by its IP.
- Origin: a browser names the page behind every cross-origin request and every WebSocket
  (which CORS never guards). One that is neither the server's own (the Host it addressed,
  scheme aside, so a TLS proxy that keeps Host changes nothing) nor in --allowed-origins is
  refused, whatever the method: that stops the requests a page sends without asking first (a
  body-less POST /flush_cache). No Origin is a client that is not a browser: allowed.
- JSON bodies only (app/server/app.py): a page may send text/plain or a form without a
  preflight; a JSON body needs one, which only an allowed origin passes. A second lock, for a
  browser that leaves Origin out.

Allowed pages get CORS headers as vLLM's --allowed-origins gives them: their origin echoed,
Vary: Origin, and preflights answered with the methods and whatever headers they ask for.
"""

import ipaddress
import re
from dataclasses import dataclass

from app.server.errors import APIError

LOOPBACK_HOSTS = frozenset({"localhost", "127.0.0.1", "[::1]"})
ORIGIN = re.compile(r"[a-z][a-z0-9+.-]*://[^/?#\s]+")  # scheme://host[:port], nothing after
HOST = re.compile(r"\*|([a-z0-9_.-]+|\[[0-9a-f:.]+\])(:[0-9]+)?")  # what a Host header holds
METHODS = "DELETE, GET, OPTIONS, POST"
PREFLIGHT_MAX_AGE = "600"  # seconds a browser may reuse a preflight's answer
CLOSE = {"Connection": "close"}  # a refusal leaves the body unread: the connection goes


def hostname(authority: str) -> str:
    """A Host header without its port: localhost:8000 -> localhost, [::1]:8000 -> [::1]."""
    authority = authority.strip().lower()
    if authority.startswith("["):
        return authority.partition("]")[0] + "]"
    return authority.partition(":")[0]


def is_loopback(address: str) -> bool:
    if address.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(address.strip("[]")).is_loopback
    except ValueError:
        return False


@dataclass(frozen=True)
class OriginPolicy:
    origins: frozenset = frozenset()  # pages besides the server's own, lowercased; "*": any
    hosts: frozenset | None = LOOPBACK_HOSTS  # names Host may carry, ports aside; None: any

    @classmethod
    def from_args(cls, args) -> "OriginPolicy":
        """--allowed-origins and --allowed-hosts (the default by --host); a ValueError of one
        line for an entry that can never match."""
        origins = frozenset(o.strip().lower().rstrip("/") for o in args.allowed_origins or [])
        for origin in origins - {"*"}:
            if not ORIGIN.fullmatch(origin):
                raise ValueError(f"--allowed-origins: {origin!r} is not an origin (scheme://host[:port]) or *")
        if args.allowed_hosts:
            hosts = frozenset(hostname(h) for h in args.allowed_hosts)
            if bad := [h for h in args.allowed_hosts if not HOST.fullmatch(h.strip().lower())]:
                raise ValueError(f"--allowed-hosts: {bad[0]!r} is not a host name (name[:port], [v6][:port]) or *")
        else:
            hosts = LOOPBACK_HOSTS if is_loopback(args.host) else frozenset({"*"})
        return cls(origins, None if "*" in hosts else hosts)

    def allows_page(self, origin: str) -> bool:
        """A page of another origin that --allowed-origins lets in."""
        return "*" in self.origins or origin.lower() in self.origins

    def answers_to(self, host: str | None) -> bool:
        """No Host (HTTP/1.0: not a browser), or a name --allowed-hosts lets in."""
        return self.hosts is None or host is None or hostname(host) in self.hosts

    def admits(self, origin: str | None, host: str | None) -> bool:
        """No Origin (not a browser), the server's own (as Host addressed it, scheme aside), or
        a page --allowed-origins lets in."""
        return origin is None or origin.lower().partition("://")[2] == (host or "").lower() or self.allows_page(origin)

    def refusal(self, headers, path: str) -> APIError | None:
        """Why a request (or a WebSocket upgrade) with these headers is refused, or None."""
        host, origin = headers.get("Host"), headers.get("Origin")
        if not self.answers_to(host) and path != "/health":
            return APIError(400, f"this server does not answer to the host {host!r} (--allowed-hosts)",
                            code="host_not_allowed", headers=CLOSE)
        if not self.admits(origin, host):
            return APIError(403, f"pages from {origin!r} may not call this server (--allowed-origins)",
                            code="origin_not_allowed", headers=CLOSE)
        return None

    def cors_headers(self, method: str, headers) -> dict:
        """For a page --allowed-origins lets in, its origin echoed: the browser then lets it read
        the answer. A preflight also learns what it may send."""
        origin = headers.get("Origin")
        if origin is None or not self.allows_page(origin):
            return {}
        cors = {"Access-Control-Allow-Origin": origin}
        if is_preflight(method, headers):
            cors.update({"Access-Control-Allow-Methods": METHODS, "Access-Control-Max-Age": PREFLIGHT_MAX_AGE})
            if asked := headers.get("Access-Control-Request-Headers"):
                cors["Access-Control-Allow-Headers"] = asked  # whatever an allowed page asks (vLLM's "*")
        return cors


def is_preflight(method: str, headers) -> bool:
    """A browser asking before a request that is not "simple" (CORS); answered before the key
    check, as a preflight never carries the key."""
    return method == "OPTIONS" and "Origin" in headers and "Access-Control-Request-Method" in headers
