"""What one request may ask for, checked on its parsed body before any tokenizing: choices
(prompts x n), embedding inputs, messages, tools, each JSON schema's size, stop strings. Each
limit over is a 400 naming the field, so a body that would take seconds of work is refused in
a moment; a request with more choices than the queue ever holds (--max-queue) is a 400 too, not
a 429: retrying it could never help.

Every API's body is checked in its own field names (a Messages request's stop_sequences, a
Responses request's input), since that is what its client sent.
"""

import json

from app.server.errors import APIError, decode_json, validate
from app.server.limits import Limits
from app.server.messages_schemas import CountTokensRequest, MessagesRequest
from app.server.responses_schemas import ResponsesRequest
from app.server.schemas import ChatCompletionRequest, EmbeddingRequest, SamplingFields, TokenizeRequest


def parse(model, raw: bytes, limits: Limits, max_queue: int):
    """A body as model, or a 400: not JSON, not the model, or over a limit."""
    return validated(model, decode_json(raw), limits, max_queue)


def validated(model, data, limits: Limits, max_queue: int):
    """Decoded JSON as model, or a 400: not the model, or over a limit."""
    req = validate(model, data)
    check(req, limits, max_queue)
    return req


def check(req, limits: Limits, max_queue: int) -> None:
    """Raises a 400 for the first field over its limit."""
    if isinstance(req, SamplingFields):
        prompts = count_prompts(req.prompt) if hasattr(req, "prompt") else 1
        check_choice_count(prompts, req.n, limits, max_queue)
        check_stops(req.stop, "stop", limits)
        check_format_schemas(req, limits)
    if isinstance(req, EmbeddingRequest):
        inputs = count_prompts(req.input)
        at_most("input", "inputs", inputs, limits.max_embedding_inputs, "--max-embedding-inputs")
        at_most("input", "inputs", inputs, max_queue, "--max-queue, the most requests the queue holds")
    if isinstance(req, (ChatCompletionRequest, TokenizeRequest)):
        at_most("messages", "messages", len(req.messages or ()), limits.max_messages, "--max-messages")
        check_tools(req.tools, limits, lambda tool: tool.function.parameters, "function.parameters")
    if isinstance(req, CountTokensRequest):
        at_most("messages", "messages", len(req.messages), limits.max_messages, "--max-messages")
        check_tools(req.tools, limits, lambda tool: tool.input_schema, "input_schema")
        config = req.output_config
        if config is not None and config.format is not None:
            check_schema(config.format.schema_, "output_config.format.schema", limits)
    if isinstance(req, MessagesRequest):
        check_stops(req.stop_sequences, "stop_sequences", limits)
    if isinstance(req, ResponsesRequest):
        items = 1 if isinstance(req.input, str) else len(req.input)
        at_most("input", "items", items, limits.max_messages, "--max-messages")
        check_tools(req.tools, limits, lambda tool: tool.parameters, "parameters")
        text_format = req.text.format if req.text else None
        if text_format is not None:
            check_schema(text_format.schema_, "text.format.schema", limits)


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


def check_format_schemas(req: SamplingFields, limits: Limits) -> None:
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
