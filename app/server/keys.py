"""The API keys a server takes (--api-key, one or several, as vLLM takes them) and which one a
request presents: as a bearer token or, as Anthropic's clients send it, in x-api-key.

What a key stores (a Response) is bound to its owner, the key's SHA-256, so the server never
keeps a key beside the data it guards; a key-less server's requests all share one owner.
"""

import hashlib
import hmac

NO_KEY = "no key"  # the owner on a server without --api-key


def same(given: str, expected: str) -> bool:
    """A constant-time comparison of a credential (bytes, so any header text compares)."""
    return hmac.compare_digest(given.encode(), expected.encode())


def presented(headers, keys) -> str | None:
    """The one of keys that headers carry, else None; each key is compared in full, so the time
    taken does not say which one came close."""
    bearer, header = headers.get("Authorization", ""), headers.get("x-api-key", "")
    found = None
    for key in keys:
        if same(bearer, f"Bearer {key}") | same(header, key):
            found = key
    return found


def owner(key: str | None) -> str:
    return hashlib.sha256(key.encode()).hexdigest() if key else NO_KEY
