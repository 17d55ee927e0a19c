"""The Responses store: random ids, each response bound to the key that stored it (another key's
is the same 404 as an unknown id), a TTL on an injected clock, and a byte budget that evicts the
least recently used; then the same end to end through the official `openai` client against a
tiny model served with two API keys."""

import hashlib
import re

import httpx
import openai
import pytest
from trio_websocket import HandshakeError, open_websocket_url

from app.server import keys
from app.server.errors import APIError
from app.server.responses.store import ResponseStore, new_id
from live_server import LiveServer

ID = re.compile(r"resp_[0-9a-f]{48}")
ALICE, BOB = keys.owner("alice-key"), keys.owner("bob-key")


class Clock:
    """A clock the test moves by hand."""

    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def response(rid: str, size: int = 200) -> dict:
    return {"id": rid, "text": "x" * size}


def not_found(call) -> APIError:
    with pytest.raises(APIError) as e:
        call()
    assert e.value.status == 404 and e.value.code == "response_not_found"
    return e.value


def held(store: ResponseStore) -> int:
    """What the entries weigh, counted afresh."""
    return sum(stored.nbytes for stored in store.entries.values())


def test_ids_are_random_and_distinct():
    ids = [new_id() for _ in range(2000)]
    assert all(ID.fullmatch(i) for i in ids), ids[:3]
    assert len(set(ids)) == len(ids)
    assert len({i[5:13] for i in ids}) > 1900  # no shared prefix, as a counter's ids would have


def test_an_owner_is_the_keys_hash_and_never_the_key():
    assert ALICE == hashlib.sha256(b"alice-key").hexdigest() and "alice-key" not in ALICE
    assert ALICE != BOB and keys.owner(None) == keys.NO_KEY


def test_the_key_presented_is_read_from_bearer_or_x_api_key():
    configured = ("alice-key", "bob-key")
    assert keys.presented({"Authorization": "Bearer bob-key"}, configured) == "bob-key"
    assert keys.presented({"x-api-key": "alice-key"}, configured) == "alice-key"
    assert keys.presented({"Authorization": "Bearer carol-key"}, configured) is None
    assert keys.presented({"Authorization": "bob-key"}, configured) is None  # no "Bearer "
    assert keys.presented({"Authorization": "Bearer bob-key"}, ()) is None  # a key-less server: no key


def test_a_response_is_found_only_under_the_key_that_stored_it():
    store = ResponseStore()
    store.put(ALICE, response("resp_a"), [{"content": "hi"}])
    assert store.get(ALICE, "resp_a").response["id"] == "resp_a"
    other = not_found(lambda: store.get(BOB, "resp_a", "previous_response_id"))
    unknown = not_found(lambda: store.get(BOB, "resp_never", "previous_response_id"))
    assert other.param == unknown.param == "previous_response_id"
    assert other.message == unknown.message.replace("resp_never", "resp_a")  # says nothing more
    not_found(lambda: store.get(keys.NO_KEY, "resp_a"))
    not_found(lambda: store.delete(BOB, "resp_a"))
    assert store.get(ALICE, "resp_a").conversation == [{"content": "hi"}]  # BOB's delete left it
    store.delete(ALICE, "resp_a")
    not_found(lambda: store.get(ALICE, "resp_a"))
    assert store.nbytes == 0 and not store.entries and not store.expiring


def test_a_response_expires_ttl_seconds_after_it_was_stored():
    clock = Clock()
    store = ResponseStore(ttl=60, clock=clock)
    store.put(ALICE, response("resp_old"), [])
    clock.now += 30
    store.put(ALICE, response("resp_new"), [])
    clock.now += 29.9
    assert store.get(ALICE, "resp_old")  # a read does not make it live longer
    clock.now += 0.1  # resp_old is 60 s old
    not_found(lambda: store.get(ALICE, "resp_old"))
    assert list(store.entries) == ["resp_new"] and store.nbytes == held(store) > 0
    clock.now += 29.9
    assert store.get(ALICE, "resp_new")
    clock.now += 0.1
    not_found(lambda: store.delete(ALICE, "resp_new"))
    assert store.nbytes == 0 and not store.entries and not store.expiring


def test_a_put_sweeps_what_expired_unread():
    clock = Clock()
    store = ResponseStore(ttl=10, clock=clock)
    for i in range(3):
        store.put(ALICE, response(f"resp_{i}"), [])
        clock.now += 4  # stored at 0, 4 and 8 s
    clock.now += 2  # resp_0 is 14 s old, resp_1 10 s (expired), resp_2 6 s
    store.put(BOB, response("resp_bob"), [])
    assert list(store.entries) == ["resp_2", "resp_bob"] and list(store.expiring) == ["resp_2", "resp_bob"]
    assert store.nbytes == held(store)


def test_the_byte_budget_evicts_the_least_recently_used_first():
    size = len('{"id": "resp_0", "text": "' + "x" * 200 + '"}') + len("[]")  # the JSON of each
    store = ResponseStore(max_bytes=3 * size)
    for i in range(3):
        store.put(ALICE, response(f"resp_{i}"), [])
    assert store.nbytes == 3 * size == held(store)
    store.get(ALICE, "resp_0")  # now the most recently used
    store.put(BOB, response("resp_3"), [])
    assert list(store.entries) == ["resp_2", "resp_0", "resp_3"] and store.nbytes == 3 * size
    not_found(lambda: store.get(ALICE, "resp_1"))
    store.put(ALICE, response("resp_big", 3 * size), [])  # larger than the whole store: not kept
    assert "resp_big" not in store.entries and list(store.entries) == ["resp_2", "resp_0", "resp_3"]


def test_bytes_held_stay_exact_through_replacements_and_deletes():
    store = ResponseStore(max_bytes=10_000)
    store.put(ALICE, response("resp_a", 100), [])
    store.put(ALICE, response("resp_b", 300), [{"content": "y" * 50}])
    store.put(ALICE, response("resp_a", 1000), [])  # the same id again: replaced, not counted twice
    assert len(store.entries) == 2 and store.nbytes == held(store)
    assert store.nbytes == len('{"id": "resp_a", "text": "' + "x" * 1000 + '"}') + 2 + store.entries["resp_b"].nbytes
    store.delete(ALICE, "resp_b")
    assert store.nbytes == held(store) == store.entries["resp_a"].nbytes
    store.delete(ALICE, "resp_a")
    assert store.nbytes == 0


# -- end to end: a tiny model served with two keys ------------------------------------------

A_KEY, B_KEY = "key-for-a", "key-for-b"


@pytest.fixture(scope="module")
def server(tiny_dir):
    s = LiveServer("--model", str(tiny_dir), "--kv-cache-gib", "0.05", "--api-key", A_KEY, B_KEY)
    yield s
    assert s.stop() == 0, s.output()


@pytest.fixture(scope="module")
def clients(server):
    with server.openai_client(api_key=A_KEY) as a, server.openai_client(api_key=B_KEY) as b:
        yield a, b


def create(client, **kwargs):
    return client.responses.create(model=client.models.list().data[0].id, input="Hello", max_output_tokens=4,
                                   temperature=0, **kwargs)


def test_either_key_is_taken_and_no_other(server, clients):
    a, b = clients
    assert a.models.list().data and b.models.list().data
    assert httpx.get(server.url + "/v1/models", headers={"x-api-key": B_KEY}, timeout=30).status_code == 200
    with server.openai_client(api_key="key-for-c") as c, pytest.raises(openai.AuthenticationError):
        c.models.list()


async def test_a_websocket_opens_with_either_key(server):
    url = server.url.replace("http", "ws") + "/v1/ws"
    for key in (A_KEY, B_KEY):
        async with open_websocket_url(url, extra_headers=[("Authorization", f"Bearer {key}")]) as ws:
            assert not ws.closed
    with pytest.raises(HandshakeError):
        async with open_websocket_url(url, extra_headers=[("Authorization", "Bearer key-for-c")]):
            pass


def test_a_stored_response_is_its_keys_alone(server, clients):
    a, b = clients
    first = create(a, store=True)
    assert ID.fullmatch(first.id) and all(item.id.endswith(f"_{first.id[5:]}_0") for item in first.output)
    assert a.responses.retrieve(first.id).output_text == first.output_text
    with pytest.raises(openai.NotFoundError) as other:
        b.responses.retrieve(first.id)
    with pytest.raises(openai.NotFoundError) as unknown:
        b.responses.retrieve(new_id())
    assert other.value.body["code"] == unknown.value.body["code"] == "response_not_found"
    with pytest.raises(openai.NotFoundError) as continued:
        create(b, previous_response_id=first.id)
    assert continued.value.body["param"] == "previous_response_id"
    with pytest.raises(openai.NotFoundError):
        b.responses.delete(first.id)
    second = create(a, previous_response_id=first.id)  # B's attempts left it to A
    assert second.previous_response_id == first.id and second.usage.input_tokens > first.usage.input_tokens
    raw = httpx.get(f"{server.url}/v1/responses/{first.id}", headers={"x-api-key": A_KEY}, timeout=30)
    assert raw.status_code == 200 and raw.json()["id"] == first.id  # the same key as x-api-key
    a.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        a.responses.retrieve(first.id)


def test_a_streamed_response_is_stored_under_its_key(clients):
    a, b = clients
    with a.responses.stream(model=a.models.list().data[0].id, input="Hello", max_output_tokens=4) as stream:
        final = list(stream)[-1].response  # response.incomplete: the tiny model runs to max_output_tokens
    assert ID.fullmatch(final.id) and a.responses.retrieve(final.id).id == final.id
    with pytest.raises(openai.NotFoundError):
        b.responses.retrieve(final.id)


def test_a_keyless_server_stores_under_no_key_and_ids_differ_across_restarts(tiny_dir):
    """Without --api-key whatever bearer a client sends is no key, so every client reads what any
    stored; and a restarted server's first ids are new, where a counter's would repeat."""
    seen = []
    for _ in range(2):
        s = LiveServer("--model", str(tiny_dir), "--kv-cache-gib", "0.05")
        try:
            with s.openai_client(api_key="one") as one, s.openai_client(api_key="two") as two:
                seen += [create(one).id, create(two).id]
                assert two.responses.retrieve(seen[-2]).id == seen[-2]
                assert one.responses.retrieve(seen[-1]).id == seen[-1]
        finally:
            assert s.stop() == 0, s.output()
    assert len(set(seen)) == 4 and all(ID.fullmatch(i) for i in seen)
