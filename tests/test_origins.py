"""Which web pages may drive the server (app/server/origins.py): Host against DNS rebinding,
Origin on every request and on the WebSocket, JSON-only bodies, CORS for --allowed-origins.
Through the app's own test client, with an engine that only counts what reaches it; the real
browser's side is in tests/test_chat_page.py."""

import argparse
import json

import pytest
import trio
from quart.testing import WebsocketResponseError

from app.flags import name_list
from app.server.app import create_app
from app.server.origins import LOOPBACK_HOSTS, OriginPolicy
from app.server.state import ServerState

PAGE = "http://localhost:3000"
EVIL = "http://evil.example"


class CountingEngine:
    """What the routes here reach of an engine: /flush_cache counts its calls."""

    def __init__(self):
        self.flushes = 0
        self.pool = self
        self.config = argparse.Namespace(max_queue=1024)  # what the request limits read

    def flush(self) -> int:
        self.flushes += 1
        return 0


def policy(host="127.0.0.1", origins=None, hosts=None) -> OriginPolicy:
    return OriginPolicy.from_args(argparse.Namespace(host=host, allowed_origins=origins, allowed_hosts=hosts))


def client(origins: OriginPolicy = OriginPolicy(), **state):
    engine = CountingEngine()
    app = create_app(ServerState(model_name="m", engine=engine, origins=origins, **state))
    return app.test_client(), engine


async def answer(response) -> tuple[int, dict]:
    return response.status_code, json.loads(await response.get_data())


async def upgrade_refusal(http, headers: dict):
    """The HTTP answer to a WebSocket upgrade that the app refuses before accepting."""
    refusals = []
    with trio.fail_after(5):
        try:
            async with http.websocket("/v1/ws", headers=headers) as ws:
                await ws.receive()
        except* WebsocketResponseError as group:
            refusals = group.exceptions
    (refusal,) = refusals
    return refusal.response


# --- the policy from its flags ---------------------------------------------------------------------

def test_hosts_default_by_the_address_bound():
    assert policy("127.0.0.1").hosts == policy("localhost").hosts == policy("::1").hosts == LOOPBACK_HOSTS
    assert policy("0.0.0.0").hosts is None and policy("192.168.1.5").hosts is None  # any, as before
    assert policy("0.0.0.0", hosts=["spool.internal:8000", "LB.example"]).hosts == {"spool.internal", "lb.example"}
    assert policy("127.0.0.1", hosts=["*"]).hosts is None
    assert policy().origins == frozenset()  # none beyond the server's own


@pytest.mark.parametrize("origins,hosts", [(["localhost:3000"], None), (["http://a.example/path"], None),
                                           (["null"], None), (None, ["http://spool.internal"])])
def test_an_entry_that_can_never_match_is_refused_at_start(origins, hosts):
    with pytest.raises(ValueError, match="--allowed-"):
        policy(origins=origins, hosts=hosts)


def test_lists_are_json_as_vllm_takes_them_or_comma_separated():
    assert name_list('["http://localhost:3000", "https://app.example"]') == ["http://localhost:3000",
                                                                              "https://app.example"]
    assert name_list("http://a:1, http://b:2") == ["http://a:1", "http://b:2"] and name_list("*") == ["*"]
    with pytest.raises(ValueError):
        name_list('[1, 2]')
    origins = policy(origins=name_list('["HTTP://LocalHost:3000/"]')).origins
    assert origins == {PAGE}  # origins compare as browsers write them: lowercase, no slash


# --- Host, against DNS rebinding ------------------------------------------------------------------

@pytest.mark.parametrize("host", ["127.0.0.1:8000", "localhost:8000", "[::1]:8000", "localhost", "LOCALHOST:1"])
async def test_loopback_names_are_answered_by_default(host):
    http, _ = client()
    assert (await http.get("/v1/models", headers={"Host": host})).status_code == 200


@pytest.mark.parametrize("host", ["evil.example", "evil.example:8000", "127.0.0.1.evil.example:8000",
                                  "localhost.evil.example", "192.168.1.5:8000"])
async def test_another_name_gets_400_in_openais_shape(host):
    http, engine = client()
    status, body = await answer(await http.get("/v1/models", headers={"Host": host}))
    assert status == 400 and body["error"]["code"] == "host_not_allowed" and host in body["error"]["message"]
    refused = await http.post("/flush_cache", headers={"Host": host})
    assert refused.status_code == 400 and refused.headers["Connection"] == "close" and engine.flushes == 0
    assert (await upgrade_refusal(http, {"Host": host})).status_code == 400
    assert (await http.get("/health", headers={"Host": host})).status_code != 400  # probes use the IP


async def test_allowed_hosts_replace_the_default_and_bound_elsewhere_any_host_is_answered():
    http, _ = client(policy("0.0.0.0", hosts=["spool.internal"]))
    assert (await http.get("/v1/models", headers={"Host": "spool.internal:8000"})).status_code == 200
    assert (await http.get("/v1/models", headers={"Host": "localhost:8000"})).status_code == 400
    http, _ = client(policy("0.0.0.0"))
    assert (await http.get("/v1/models", headers={"Host": "evil.example"})).status_code == 200


# --- Origin ------------------------------------------------------------------------------------------

async def test_a_page_of_another_origin_is_refused_whatever_it_asks():
    http, engine = client()
    status, body = await answer(await http.post("/flush_cache", headers={"Origin": EVIL}))  # no preflight
    assert status == 403 and body["error"]["code"] == "origin_not_allowed" and engine.flushes == 0
    assert body["error"]["type"] == "permission_error"
    for origin in (EVIL, "null", "http://localhost:8001", "http://localhost", "http://127.0.0.1:8000"):
        refused = await http.get("/v1/models", headers={"Host": "localhost:8000", "Origin": origin})
        assert refused.status_code == 403 and "Access-Control-Allow-Origin" not in refused.headers
    # Anthropic's route answers in its shape
    status, body = await answer(await http.post("/v1/messages", json={}, headers={"Origin": EVIL}))
    assert status == 403 and body["type"] == "error" and body["error"]["type"] == "permission_error"


async def test_no_origin_and_the_servers_own_pass():
    http, engine = client()
    assert (await http.post("/flush_cache")).status_code == 200 and engine.flushes == 1  # curl, clients
    own = await http.post("/flush_cache", headers={"Host": "127.0.0.1:8000", "Origin": "http://127.0.0.1:8000"})
    assert own.status_code == 200 and engine.flushes == 2
    assert "Access-Control-Allow-Origin" not in own.headers  # same origin needs no CORS
    behind_tls = await http.get("/v1/models", headers={"Host": "localhost", "Origin": "https://localhost"})
    assert behind_tls.status_code == 200  # a proxy that keeps Host: the scheme is not compared


async def test_the_websocket_checks_the_origin_before_anything():
    http, _ = client()
    refused = await upgrade_refusal(http, {"Origin": EVIL})
    assert refused.status_code == 403
    assert json.loads(await refused.get_data())["error"]["code"] == "origin_not_allowed"
    for headers in ({}, {"Host": "localhost:8000", "Origin": "http://localhost:8000"}):
        async with http.websocket("/v1/ws", headers=headers) as ws:
            await ws.send('{"type": "cancel", "id": "x"}')
            assert json.loads(await ws.receive())["error"]["message"] == "no generation 'x' is running on this socket"
    http, _ = client(policy(origins=[PAGE]))
    async with http.websocket("/v1/ws", headers={"Origin": PAGE}) as ws:
        await ws.send("{}")
        assert json.loads(await ws.receive())["type"] == "error"  # accepted: the frame was read


# --- JSON bodies only --------------------------------------------------------------------------------

@pytest.mark.parametrize("content_type,body", [
    ("text/plain;charset=UTF-8", '{"messages": [{"role": "user", "content": "hi"}]}'),  # a page's fetch
    ("application/x-www-form-urlencoded", "messages=hi"),  # a form, or curl -d without -H
    ("multipart/form-data; boundary=x", "--x\r\n\r\nhi\r\n--x--\r\n"),
    (None, '{"messages": []}'),  # a page's Blob body goes out with no type
])
async def test_a_body_that_is_not_json_gets_415(content_type, body):
    http, _ = client()
    headers = {"Content-Type": content_type} if content_type else {}
    for path in ("/v1/chat/completions", "/tokenize", "/flush_cache"):
        status, reply = await answer(await http.post(path, data=body, headers=headers))
        assert status == 415 and reply["error"]["code"] == "unsupported_media_type", (path, reply)
        assert reply["error"]["type"] == "invalid_request_error" and "application/json" in reply["error"]["message"]
    status, reply = await answer(await http.post("/v1/messages", data=body, headers=headers))
    assert status == 415 and reply["error"]["type"] == "invalid_request_error"  # Anthropic's shape


@pytest.mark.parametrize("content_type", ["application/json", "application/json; charset=utf-8",
                                          "Application/JSON", "application/vnd.api+json"])
async def test_a_json_body_reaches_the_route(content_type):
    http, _ = client()
    status, reply = await answer(await http.post("/v1/chat/completions", data="{}",
                                                 headers={"Content-Type": content_type}))
    assert status == 400 and reply["error"]["param"] == "messages"  # the route's own check


# --- CORS for --allowed-origins ---------------------------------------------------------------------

async def test_an_allowed_page_gets_its_origin_back_and_others_get_nothing():
    http, engine = client(policy(origins=[PAGE, "https://app.example"]))
    allowed = await http.post("/flush_cache", headers={"Origin": PAGE})
    assert allowed.status_code == 200 and engine.flushes == 1
    assert allowed.headers["Access-Control-Allow-Origin"] == PAGE and "Origin" in allowed.headers["Vary"]
    refused = await http.post("/flush_cache", headers={"Origin": EVIL})
    assert refused.status_code == 403 and "Access-Control-Allow-Origin" not in refused.headers
    assert engine.flushes == 1
    plain = await http.get("/v1/models")  # no Origin: no CORS, but caches are told it matters
    assert "Access-Control-Allow-Origin" not in plain.headers and "Origin" in plain.headers["Vary"]
    text = await http.post("/v1/chat/completions", data="{}", headers={"Origin": PAGE, "Content-Type": "text/plain"})
    assert text.status_code == 415 and text.headers["Access-Control-Allow-Origin"] == PAGE  # it reads why


PREFLIGHT = {"Access-Control-Request-Method": "POST",
             "Access-Control-Request-Headers": "authorization, content-type, x-api-key, anthropic-version"}


async def test_a_preflight_from_an_allowed_page_is_answered_without_the_key():
    http, engine = client(policy(origins=[PAGE]), api_keys=("k",))
    reply = await http.options("/v1/chat/completions", headers={"Origin": PAGE, **PREFLIGHT})
    assert reply.status_code == 204 and reply.headers["Access-Control-Allow-Origin"] == PAGE
    assert {"POST", "GET", "DELETE"} <= {m.strip() for m in reply.headers["Access-Control-Allow-Methods"].split(",")}
    assert reply.headers["Access-Control-Allow-Headers"] == PREFLIGHT["Access-Control-Request-Headers"]
    assert int(reply.headers["Access-Control-Max-Age"]) > 0
    refused = await http.options("/v1/chat/completions", headers={"Origin": EVIL, **PREFLIGHT})
    assert refused.status_code == 403 and "Access-Control-Allow-Origin" not in refused.headers
    unkeyed = await http.post("/flush_cache", headers={"Origin": PAGE})  # the page reads the 401
    assert unkeyed.status_code == 401 and unkeyed.headers["Access-Control-Allow-Origin"] == PAGE
    keyed = await http.post("/flush_cache", headers={"Origin": PAGE, "Authorization": "Bearer k"})
    assert keyed.status_code == 200 and engine.flushes == 1


async def test_star_lets_any_page_in():
    http, engine = client(policy(origins=["*"]))
    for origin in (EVIL, "null"):
        reply = await http.post("/flush_cache", headers={"Origin": origin})
        assert reply.status_code == 200 and reply.headers["Access-Control-Allow-Origin"] == origin
    assert engine.flushes == 2
