"""The quart-trio application: every route table's routes (each API folder's, the server's own,
the routers') bound to one ServerState, the access check before them (app/server/origins.py's
policy for browsers included), CORS headers after them, errors in OpenAI's shape (in
Anthropic's on its /v1/messages routes), and the request log around it all
(app/server/access_log.py). The one module that imports every API folder.

create_app() builds a fresh app around the state (Quart creates serving hooks once per app,
so tests build one per server).
"""

import functools
import logging

from quart import Response, request
from quart_trio import QuartTrio
from werkzeug.exceptions import HTTPException

from app.server import chat_page, keys, lora_routes, openapi, origins, routes, worker_routes
from app.server.access_log import AccessLog
from app.server.anthropic import routes as anthropic
from app.server.anthropic.schemas import error_body
from app.server.embeddings import routes as embeddings
from app.server.errors import APIError
from app.server.openai import routes as openai
from app.server.responses import routes as responses
from app.server.state import ServerState
from app.server.websocket import websocket_route

# what /openapi.json shows: each API's routes, then the server's own
DOCUMENTED = tuple(openai.DOCUMENTED + embeddings.DOCUMENTED + anthropic.DOCUMENTED + responses.DOCUMENTED
                   + routes.DOCUMENTED + lora_routes.DOCUMENTED)


async def openapi_spec(state: ServerState):
    return openapi.spec(state.model_name, DOCUMENTED)


# method, path, route: every HTTP route, each a function of the ServerState (and the path's parts)
ROUTES = (openai.ROUTES + embeddings.ROUTES + anthropic.ROUTES + responses.ROUTES + routes.ROUTES
          + [("GET", "/openapi.json", openapi_spec)] + worker_routes.ROUTES + lora_routes.ROUTES)
PAGE_ROUTES = [("GET", "/", chat_page.chat_page), ("GET", "/ui/<name>", chat_page.chat_page_file)]  # unless --no-ui

log = logging.getLogger("spool.server")


async def admit(state: ServerState):
    """A Host or an Origin the policy refuses (400, 403), a CORS preflight answered; then 503
    while loading and 401 without one of the keys (but for /health and the chat page), which
    comes as a bearer token or in x-api-key (app/server/keys.py); then the whole body, as an
    unread body would hang the keep-alive connection, which must be JSON (415): a page can send
    any other type without asking first."""
    if refusal := state.origins.refusal(request.headers, request.path):
        raise refusal
    if origins.is_preflight(request.method, request.headers):
        return Response(b"", status=204)  # cors() adds what the page may send, if it is allowed
    public = request.path == "/health" or (state.ui and chat_page.is_page(request.path))
    if state.engine is None and not public:
        raise APIError(503, "the model is still loading; retry shortly", code="loading",
                       headers={"Retry-After": "5"})
    if state.api_keys and not public and keys.presented(request.headers, state.api_keys) is None:
        raise APIError(401, "missing or invalid API key (send Authorization: Bearer <key>, or x-api-key)",
                       code="invalid_api_key")
    if request.method in ("POST", "PUT", "PATCH") and await request.get_data() and not request.is_json:
        raise APIError(415, f"a request body must be JSON, sent with Content-Type: application/json"
                            f" (got {request.content_type or 'none'})", code="unsupported_media_type")


async def cors(state: ServerState, response):
    """CORS headers for a page --allowed-origins lets in, on every answer, refusals included."""
    response.headers.update(state.origins.cors_headers(request.method, request.headers))
    if state.origins.origins:  # the answer depends on the Origin: caches must keep them apart
        response.vary.add("Origin")
    return response


def error_response(e: APIError):
    """e in OpenAI's shape, or in Anthropic's on its routes."""
    return e.response(error_body(e) if request.path.startswith(anthropic.PREFIX) else None)


async def api_error(e: APIError):
    response = error_response(e)
    if e.status in (408, 413):  # the rest of the body is never read
        response.headers["Connection"] = "close"
    return response


async def http_error(state: ServerState, e: HTTPException):
    message = {413: f"the request body is over --max-body-bytes ({state.limits.max_body_bytes})",
               408: f"the request body took longer than --body-timeout ({state.limits.body_timeout:g} s)"
               }.get(e.code, e.description or e.name)
    return await api_error(APIError(e.code or 500, message))


async def crash(e: Exception):
    log.exception("unhandled error")
    return error_response(APIError(500, f"internal error: {type(e).__name__}"))


def create_app(state: ServerState) -> QuartTrio:
    app = QuartTrio("spool")
    app.config["MAX_CONTENT_LENGTH"] = state.limits.max_body_bytes
    app.config["RESPONSE_TIMEOUT"] = None  # Spool enforces --request-timeout itself
    app.config["BODY_TIMEOUT"] = state.limits.body_timeout
    app.before_request(functools.partial(admit, state))
    app.after_request(functools.partial(cors, state))
    app.register_error_handler(APIError, api_error)
    app.register_error_handler(HTTPException, functools.partial(http_error, state))
    app.register_error_handler(Exception, crash)
    bound = {}  # one view per route, however many paths it answers
    for method, path, route in ROUTES + (PAGE_ROUTES if state.ui else []):
        view = bound.setdefault(route, functools.partial(route, state))
        app.add_url_rule(path, route.__name__, view, methods=[method])
    app.add_websocket("/v1/ws", "websocket_route", functools.partial(websocket_route, state))
    app.asgi_app = AccessLog(app.asgi_app)
    return app
