"""OpenAI's chat completions and completions: their replies' schemas (the requests, which every
generation runs as, are app/server/schemas.py), a responder per shape, the SSE stream, and the
routes."""
