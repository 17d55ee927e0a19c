"""A reasoning item's encrypted_content, as Spool writes it: the thinking itself, encoded.

A client that keeps no responses on the server (store false, as Codex sends) asks for
include: ["reasoning.encrypted_content"] and sends the reasoning items back with the next turn,
so that the model sees its earlier thinking. OpenAI encrypts the blob because its reasoning is
hidden from the client; Spool shows the thinking in the item anyway, so the blob is only
encoded (base64 after a marker), which lets the next turn read it back without a key or a
store. A blob Spool did not write (OpenAI's, say) reads as no thinking.
"""

import base64
import binascii

MARKER = "spool-reasoning-v1:"


def seal(thinking: str) -> str:
    return MARKER + base64.b64encode(thinking.encode()).decode()


def unseal(blob: str | None) -> str:
    if not blob or not blob.startswith(MARKER):
        return ""
    try:
        return base64.b64decode(blob[len(MARKER):], validate=True).decode()
    except (binascii.Error, UnicodeDecodeError):
        return ""
