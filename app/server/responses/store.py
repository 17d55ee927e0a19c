"""The Responses store: what previous_response_id, GET and DELETE /v1/responses/{id} read.

A stored response is bound to the API key that stored it (its owner, app/server/keys.py) and
lives --responses-store-ttl seconds; past --responses-store-bytes the least recently used go
first. Another key's response, an expired one and an unknown id are the same 404, so a 404
never says that an id exists. Ids are random (new_id), never a counter: a counter's ids repeat
after a restart and on every replica, and one could be guessed.
"""

import json
import logging
import secrets
import time
from collections import OrderedDict
from dataclasses import dataclass

from app.server.errors import APIError
from app.server.limits import STORE_BYTES, STORE_TTL

log = logging.getLogger("spool.server")


def new_id() -> str:
    """A response's id: 192 random bits, as long as OpenAI's, so no one can guess another's and
    none repeats after a restart or on another replica."""
    return "resp_" + secrets.token_hex(24)


@dataclass
class Stored:
    response: dict  # the Response object as it was sent
    conversation: list[dict]  # every input item up to this response, then its output items
    owner: str  # the key that stored it, as keys.owner gives it
    nbytes: int
    expires: float  # on the store's clock


class ResponseStore:
    """Stored responses, each found only by the key that stored it and only for ttl seconds
    after; least recently used first out once they pass a byte budget."""

    def __init__(self, max_bytes: int = STORE_BYTES, ttl: float = STORE_TTL, clock=time.monotonic):
        self.max_bytes, self.ttl, self.clock = max_bytes, ttl, clock
        self.nbytes = 0
        self.entries: OrderedDict[str, Stored] = OrderedDict()  # least recently used first
        self.expiring: OrderedDict[str, float] = OrderedDict()  # the same ids, first stored first

    def put(self, owner: str, response: dict, conversation: list[dict]) -> None:
        self.sweep()
        nbytes = len(json.dumps(response)) + len(json.dumps(conversation))
        if nbytes > self.max_bytes:
            log.warning(f"response {response['id']} ({nbytes} bytes) is larger than the whole store; not stored")
            return
        self.drop(response["id"])
        stored = Stored(response, conversation, owner, nbytes, self.clock() + self.ttl)
        self.entries[response["id"]] = stored
        self.expiring[response["id"]] = stored.expires
        self.nbytes += nbytes
        while self.nbytes > self.max_bytes:
            self.drop(next(iter(self.entries)))

    def get(self, owner: str, response_id: str, param: str | None = None) -> Stored:
        """The stored response (now the most recently used), or a 404: the same 404 for an id
        never stored, evicted, expired, deleted or stored by another key."""
        self.sweep()
        stored = self.entries.get(response_id)
        if stored is None or stored.owner != owner:
            raise APIError(404, f"no stored response has the id {response_id!r} (it may have expired or been"
                                " evicted, or made with store false)", param=param, code="response_not_found")
        self.entries.move_to_end(response_id)
        return stored

    def delete(self, owner: str, response_id: str) -> None:
        self.get(owner, response_id)
        self.drop(response_id)

    def sweep(self) -> None:
        """Drop what has expired: the first stored, as every entry lives the same ttl."""
        now = self.clock()
        while self.expiring and next(iter(self.expiring.values())) <= now:
            self.drop(next(iter(self.expiring)))

    def drop(self, response_id: str) -> None:
        stored = self.entries.pop(response_id, None)
        if stored is not None:
            del self.expiring[response_id]
            self.nbytes -= stored.nbytes
