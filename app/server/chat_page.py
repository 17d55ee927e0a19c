"""GET /: the chat page, one static page (HTML, CSS and plain JavaScript in app/server/ui, no
build step, nothing fetched from elsewhere) that talks to the server over the WebSocket.

A browser cannot set an Authorization header on a WebSocket, so with --api-key the upgrade may
carry the key as a subprotocol instead, as Kubernetes' API server takes a bearer token:

    new WebSocket(url, ["spool", "spool.bearer." + base64url(key)])

The server then answers with the subprotocol "spool". The page itself and its files need no
key: they hold nothing but code, and the page asks for the key when /v1/models says 401.
"""

import base64
from functools import cache
from importlib.resources import files

from quart import Response

from app.server import keys
from app.server.errors import APIError
from app.server.state import ServerState

SUBPROTOCOL = "spool"
KEY_PREFIX = "spool.bearer."
FILES = {
    "index.html": "text/html; charset=utf-8",
    "chat.js": "text/javascript; charset=utf-8",
    "chat.css": "text/css; charset=utf-8",
}
# The page runs only its own script and talks only to its own origin (WebSocket included).
POLICY = ("default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; img-src 'self' data:;"
          " base-uri 'none'; form-action 'none'; frame-ancestors 'none'")


def is_page(path: str) -> bool:
    return path == "/" or path.startswith("/ui/")


def key_offered(websocket, key: str) -> bool:
    """The key in the Authorization header or in a spool.bearer.<base64url> subprotocol."""
    if keys.same(websocket.headers.get("Authorization", ""), f"Bearer {key}"):
        return True
    want = KEY_PREFIX + base64.urlsafe_b64encode(key.encode()).rstrip(b"=").decode()
    return any(keys.same(offered, want) for offered in websocket.requested_subprotocols)


@cache
def contents(name: str) -> bytes:
    return (files("app.server") / "ui" / name).read_bytes()


def respond(name: str) -> Response:
    return Response(contents(name), content_type=FILES[name],
                    headers={"Content-Security-Policy": POLICY, "Cache-Control": "no-cache",
                             "X-Content-Type-Options": "nosniff"})


async def chat_page(state: ServerState):
    return respond("index.html")


async def chat_page_file(state: ServerState, name: str):
    if name not in FILES:
        raise APIError(404, f"no file {name!r} in the chat page", code="not_found")
    return respond(name)
