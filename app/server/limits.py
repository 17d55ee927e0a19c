"""What one client may hold of the server: every connection, header, body and WebSocket limit,
what one request may ask for (app/server/request_limits.py checks those on its parsed body,
before any tokenizing), how long and how much its chat template may render, and the threads
that do a request's work off the event loop; with defaults that protect a laptop, and the
`serve` flags that change them.

The defaults follow what nginx and Hypercorn's deployment notes settle on: a deadline for
request headers (slowloris), bounded request heads and bodies, and pings that find dead
WebSocket peers. Keep-alive is 120 s, not Hypercorn's 5 s: a client's pool reuses a
connection idle up to its own expiry (the openai client's httpx 5 s, aiohttp 15 s, nginx's
upstream pool 60 s, Go's net/http and Rust's reqwest, which vLLM's and SGLang's routers use,
90 s), and a server that closes first races it: a request sent as the server's FIN leaves is
lost ("Server disconnected without sending a response"). Idle connections cost little here:
at --max-connections a newcomer displaces the one idle longest.
"""

from dataclasses import dataclass, field, fields

MIB = 1 << 20
STORE_BYTES = 64 * MIB  # the Responses store's default budget (--responses-store-bytes)
STORE_TTL = 3600.0  # and how long it keeps a response (--responses-store-ttl)


def limit(default, help_text: str):
    return field(default=default, metadata={"help": help_text})


@dataclass(frozen=True)
class Limits:
    max_connections: int = limit(512, "most client connections open at once; at the limit a newcomer that sends a"
                                      " whole request head within 1 s takes the place of the connection idle"
                                      " longest, else it gets 503")
    max_header_bytes: int = limit(16 * 1024, "most bytes in a request line plus headers (431 over it)")
    max_headers: int = limit(100, "most header fields in one request (431 over it)")
    header_timeout: float = limit(10.0, "seconds from a request's first byte to the end of its headers"
                                        " (408 past it)")
    body_timeout: float = limit(30.0, "seconds to receive a request body (408 past it)")
    keep_alive_timeout: float = limit(120.0, "seconds an idle keep-alive connection stays open")
    send_timeout: float = limit(30.0, "seconds a client may read nothing while the server writes before it is"
                                      " dropped")
    max_body_bytes: int = limit(4 * MIB, "most bytes in a request body (413 over it)")
    ws_max_message_bytes: int = limit(4 * MIB, "most bytes in one WebSocket message (close code 1009 over it)")
    ws_ping_interval: float = limit(20.0, "seconds between the server's WebSocket pings")
    ws_idle_timeout: float = limit(60.0, "seconds a WebSocket may send nothing, pongs included, before it is"
                                         " closed (1001)")
    ws_max_generations: int = limit(32, "most generations in flight on one WebSocket (an error frame, status 429,"
                                        " over it)")
    max_choices_per_request: int = limit(1024, "most choices one request may ask for: a completions request's prompts"
                                               " times its n (each choice is one request in the queue); 400 over it, or"
                                               " over --max-queue, which such a request could never fit in. vLLM has"
                                               " no such limit; its queue is unbounded")
    max_embedding_inputs: int = limit(2048, "most inputs in one /v1/embeddings request, as OpenAI takes (400 over"
                                            " it; --max-queue bounds them too)")
    max_messages: int = limit(4096, "most messages in one chat request (a Messages request's messages, a Responses"
                                    " conversation's items) (400 over it)")
    max_tools: int = limit(128, "most tools one request offers, as OpenAI takes (400 over it)")
    max_schema_bytes: int = limit(64 * 1024, "most bytes of one JSON schema (a tool's parameters, a response format's"
                                             " schema), written as compact JSON (400 over it)")
    max_stop_strings: int = limit(64, "most stop strings in one request; OpenAI takes 4, vLLM any number (400 over"
                                      " it)")
    max_stop_chars: int = limit(256, "most characters in one stop string (400 over it)")
    chat_template_timeout: float = limit(10.0, "seconds the chat template may take to render one request's prompt"
                                               " (400 past it)")
    max_chat_template_chars: int = limit(16 * MIB, "most characters the chat template may render for one request"
                                                   " (400 over it)")
    request_threads: int = limit(2, "worker threads that parse request bodies, render chat templates, tokenize and"
                                    " compile grammars at once, off the event loop; more requests wait their turn")

    @classmethod
    def from_args(cls, args) -> "Limits":
        return cls(**{f.name: getattr(args, f.name) for f in fields(cls)})

    def validate(self) -> None:
        """One ValueError line for a value that can never work."""
        for f in fields(self):
            if getattr(self, f.name) <= 0:
                raise ValueError(f"--{f.name.replace('_', '-')} must be positive")


def add_arguments(parser) -> None:
    group = parser.add_argument_group("limits", "what one client may hold (docs/serving.md: Limits and hardening)")
    for f in fields(Limits):
        shown = f"{f.default:g}" if isinstance(f.default, float) else f"{f.default}"
        group.add_argument(f"--{f.name.replace('_', '-')}", type=type(f.default), default=f.default,
                           help=f"{f.metadata['help']} (default: {shown})")
