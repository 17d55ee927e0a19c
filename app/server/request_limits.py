"""What one request may ask for, checked on its parsed body before any tokenizing: choices
(prompts x n), embedding inputs, messages, tools, each JSON schema's size, stop strings. Each
limit over is a 400 naming the field, so a body that would take seconds of work is refused in
a moment; a request with more choices than the queue ever holds (--max-queue) is a 400 too, not
a 429: retrying it could never help.

Each API's request model checks its own body (check_limits) with the helpers here, in its own
field names (a Messages request's stop_sequences, a Responses request's input), since that is
what its client sent; this module knows no API.
"""

import json

from app.server.errors import APIError, decode_json, validate
from app.server.limits import Limits


def parse(model, raw: bytes, limits: Limits, max_queue: int):
    """A body as model, or a 400: not JSON, not the model, or over a limit."""
    return validated(model, decode_json(raw), limits, max_queue)


def validated(model, data, limits: Limits, max_queue: int):
    """Decoded JSON as model, or a 400: not the model, or over a limit. A request with limits
    checks them itself (its check_limits, with the helpers below), in its own field names."""
    req = validate(model, data)
    if hasattr(req, "check_limits"):
        req.check_limits(limits, max_queue)
    return req


def at_most(param: str, what: str, count: int, most: int, flag: str) -> None:
    if count > most:
        raise APIError(400, f"{param} has {count} {what}; this server takes at most {most} ({flag})", param=param)


def count_prompts(prompt) -> int:
    """The prompts a prompt (or embedding input) field holds: a string, or one list of token
    ids, is one."""
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
        return 1
    return len(prompt)


def check_choice_count(prompts: int, n: int, limits: Limits, max_queue: int) -> None:
    """prompts x n choices, each a request in the queue."""
    choices = prompts * n
    param = "prompt" if prompts > 1 else "n"
    for most, flag in ((limits.max_choices_per_request, "--max-choices-per-request"),
                       (max_queue, "--max-queue, the most requests the queue holds")):
        if choices > most:
            raise APIError(400, f"the request asks for {choices} choices ({prompts} prompts x n {n}); this server"
                                f" takes at most {most} ({flag})", param=param)


def check_stops(stop, param: str, limits: Limits) -> None:
    stops = [stop] if isinstance(stop, str) else stop or []
    at_most(param, "stop strings", len(stops), limits.max_stop_strings, "--max-stop-strings")
    longest = max(map(len, stops), default=0)
    if longest > limits.max_stop_chars:
        raise APIError(400, f"{param} has a stop string of {longest} characters; this server takes at most"
                            f" {limits.max_stop_chars} (--max-stop-chars)", param=param)


def check_tools(tools, limits: Limits, schema_of, schema_field: str) -> None:
    at_most("tools", "tools", len(tools or ()), limits.max_tools, "--max-tools")
    for i, tool in enumerate(tools or ()):
        check_schema(schema_of(tool), f"tools.{i}.{schema_field}", limits)


def check_format_schemas(req, limits: Limits) -> None:
    """The JSON schemas a request's output format may carry, under any of its names."""
    fmt, so = req.response_format, req.structured_outputs
    for param, schema in (("response_format.json_schema.schema", fmt and fmt.json_schema and fmt.json_schema.schema_),
                          ("guided_json", req.guided_json), ("json_schema", req.json_schema),
                          ("structured_outputs.json", so and so.json_)):
        check_schema(schema, param, limits)


def check_schema(schema, param: str, limits: Limits) -> None:
    if schema is None:
        return
    text = schema if isinstance(schema, str) else json.dumps(schema, separators=(",", ":"), ensure_ascii=False)
    size = len(text.encode())
    if size > limits.max_schema_bytes:
        raise APIError(400, f"{param} is a schema of {size} bytes; this server takes at most {limits.max_schema_bytes}"
                            f" (--max-schema-bytes)", param=param)
