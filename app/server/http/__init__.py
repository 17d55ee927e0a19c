"""The socket layer under Hypercorn's protocol classes: the listener (accept, connection limits,
displacement), one Connection per socket (reads, writes, timeouts, close reasons) and the
HTTP/1.1 protocol with pipelining. It knows bytes and limits, never an API."""
