"""/v1/responses: a generation as OpenAI's Response object, or as its stream of typed events
(response.created, response.in_progress, per output item output_item.added, its content part,
deltas and .done events, then response.completed or response.incomplete), each numbered by
sequence_number.

Output items are the output's parts (app/server/output_parts.py): thinking → a reasoning item
(with its encrypted_content when include asks: encrypted_content.py), text → an assistant
message with one output_text part, each tool call → a function_call item, or a custom_tool_call
for a custom tool, whose input streams whole once the call is written (tools.py). Item ids
follow from the response's id (random: app/server/responses/store.py) and the item's place, so a
reply and its stream name them alike; the stream's last event carries the same Response object
that the store keeps.
"""

from collections.abc import Callable
from contextlib import aclosing

from app.server.chat_text import ChatText, Reading
from app.server.generation import Choice, Generation, Outcome, Piece
from app.server.output_parts import OutputParts, Part
from app.server.responses.encrypted_content import seal
from app.server.responses.schemas import FunctionTool, ResponseObject, ResponsesRequest
from app.server.responses.tools import Toolbox
from app.server.sse import named_event

PREFIX = {"thinking": "rs", "text": "msg", "call": "fc", "custom": "ctc"}


class ResponsesResponder:
    """One Responses request's reply, or its stream: gen.run()'s items as the API's events."""

    def __init__(self, gen: Generation, reading: Reading, req: ResponsesRequest, toolbox: Toolbox, model_name: str,
                 response_id: str, keep: Callable[[dict, list[dict]], None]):
        """keep(response, output items): called with the finished response, for the store."""
        self.gen, self.reading, self.req, self.toolbox, self.model_name, self.id, self.keep = \
            gen, reading, req, toolbox, model_name, response_id, keep
        (self.choice,) = gen.ordered()
        self.split, self.parts = ChatText(reading), OutputParts()  # what a stream has read so far

    def kind(self, part: Part) -> str:
        return "custom" if part.kind == "call" and self.toolbox.is_custom(part.name) else part.kind

    def item_id(self, parts: OutputParts, index: int) -> str:
        return f"{PREFIX[self.kind(parts.parts[index])]}_{self.id.removeprefix('resp_')}_{index}"

    def item(self, parts: OutputParts, index: int, status: str, part: Part | None = None) -> dict:
        """Output item index as the API shows it: part as written so far (default: all of it)."""
        part = part or parts.parts[index]
        item = {"id": self.item_id(parts, index), "status": status}
        if part.kind == "thinking":
            if status == "in_progress":
                return {"type": "reasoning", **item, "summary": [], "content": []}
            content = [{"type": "reasoning_text", "text": part.text}]
            sealed = {"encrypted_content": seal(part.text)} if self.req.wants_reasoning_back() else {}
            return {"type": "reasoning", **item, "summary": [], "content": content, **sealed}
        if part.kind == "text":
            content = [text_part(part.text)] if status != "in_progress" else []
            return {"type": "message", **item, "role": "assistant", "content": content}
        call = self.toolbox.call_item(part.name, part.text)
        kind = call.pop("type")
        if kind == "custom_tool_call":  # OpenAI's custom call items carry no status
            return {"type": kind, "id": item["id"], "call_id": part.call_id, **call}
        return {"type": kind, **item, "call_id": part.call_id, **call}

    def response(self, status: str, output: list[dict], choice: Choice | None = None) -> dict:
        req = self.req
        usage = None
        if choice is not None:
            usage = {"input_tokens": choice.prompt_tokens, "input_tokens_details": {"cached_tokens": choice.cached_tokens,
                                                                                "cache_write_tokens": 0},
                     "output_tokens": choice.completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
                     "total_tokens": choice.prompt_tokens + choice.completion_tokens}
        text_format = req.text.format.model_dump(by_alias=True, exclude_none=True) if req.text and req.text.format \
            else {"type": "text"}
        tool_choice = req.tool_choice or "auto"
        return ResponseObject(
            id=self.id, status=status, model=self.model_name, output=output,
            incomplete_details={"reason": "max_output_tokens"} if status == "incomplete" else None,
            instructions=req.instructions, max_output_tokens=req.max_output_tokens,
            parallel_tool_calls=req.parallel_tool_calls, previous_response_id=req.previous_response_id,
            reasoning={"effort": req.reasoning.effort if req.reasoning else None, "summary": None},
            temperature=1.0 if req.temperature is None else req.temperature,
            text={"format": text_format}, tool_choice=tool_choice if isinstance(tool_choice, str) else
            tool_choice.model_dump(exclude_none=True), tools=[echoed(t) for t in req.tools or []],
            top_p=1.0 if req.top_p is None else req.top_p, usage=usage, user=req.user, metadata=req.metadata or {},
        ).model_dump(mode="json")

    def finished(self, choice: Choice, parts: OutputParts) -> dict:
        status = "incomplete" if choice.finish_reason == "length" else "completed"
        output = [self.item(parts, i, status) for i in range(len(parts.parts))]
        response = self.response(status, output, choice)
        self.keep(response, output)
        return response

    def reply(self) -> dict:
        split, parts = ChatText(self.reading), OutputParts()
        parts.feed(*split.feed(self.choice.text, final=True), final=True)
        return self.finished(self.choice, parts)

    async def events(self):
        """The whole event stream, each event numbered; an error after the 200 is an error event."""
        sequence = iter(range(1 << 62))
        async with aclosing(self.gen.run()) as items:
            async for item in items:
                for kind, payload in self.run_events(item):
                    yield named_event(kind, numbered(kind, payload, next(sequence)))

    def run_events(self, item: list[Piece] | Outcome) -> list[tuple[str, dict]]:
        """The events one of run()'s items makes: the response created and in progress for the
        first, empty batch, the output items' events for a batch, and for the outcome an error
        or the finished response."""
        if isinstance(item, Outcome):
            if item.error:
                body = item.error.body()["error"]
                return [("error", {"code": body["code"], "message": body["message"], "param": body["param"]})]
            response = self.finished(self.choice, self.parts)
            return [(f"response.{response['status']}", {"response": response})]
        if not item:
            opening = self.response("in_progress", [])
            return [("response.created", {"response": opening}), ("response.in_progress", {"response": opening})]
        out = []
        for piece in item:
            final = piece.final is not None
            for part_event in self.parts.feed(*self.split.feed(piece.text, final=final), final=final):
                out += self.part_events(part_event)
        return out

    def part_events(self, out: tuple) -> list[tuple[str, dict]]:
        """The Responses events for one of the stream's parts' events."""
        parts, choice = self.parts, self.choice
        kind, index, *piece = out
        part = parts.parts[index]
        at = {"item_id": self.item_id(parts, index), "output_index": index}
        if kind == "start":
            added = [("response.output_item.added", {"output_index": index, "item": self.item(
                parts, index, "in_progress", Part(part.kind, call_id=part.call_id, name=part.name))})]
            if part.kind == "text":
                added.append(("response.content_part.added", {**at, "content_index": 0, "part": text_part("")}))
            return added
        if kind == "delta":
            if self.kind(part) == "custom":  # its input is JSON until the call is whole
                return []
            if part.kind == "call":
                return [("response.function_call_arguments.delta", {**at, "delta": piece[0]})]
            name = "response.output_text.delta" if part.kind == "text" else "response.reasoning_text.delta"
            extra = {"logprobs": []} if part.kind == "text" else {}
            return [(name, {**at, "content_index": 0, "delta": piece[0], **extra})]
        status = "incomplete" if choice.finish_reason == "length" else "completed"
        item = self.item(parts, index, status)
        done = [("response.output_item.done", {"output_index": index, "item": item})]
        if self.kind(part) == "custom":
            delta = [("response.custom_tool_call_input.delta", {**at, "delta": item["input"]})] if item["input"] else []
            return delta + [("response.custom_tool_call_input.done", {**at, "input": item["input"]})] + done
        if part.kind == "call":
            arguments = {**at, "name": item["name"], "arguments": part.text}  # the tool's own name
            return [("response.function_call_arguments.done", arguments)] + done
        if part.kind == "text":
            return [("response.output_text.done", {**at, "content_index": 0, "text": part.text, "logprobs": []}),
                    ("response.content_part.done", {**at, "content_index": 0, "part": text_part(part.text)})] + done
        return [("response.reasoning_text.done", {**at, "content_index": 0, "text": part.text})] + done


def echoed(tool) -> dict:
    """A tool as the response shows it: a function tool with all its fields, the others as given."""
    return tool.model_dump() if isinstance(tool, FunctionTool) else tool.model_dump(exclude_none=True)


def text_part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def numbered(kind: str, payload: dict, number: int) -> dict:
    """An event's body: its type, its sequence number, then its fields (an error's number last)."""
    if kind == "error":
        return {"type": kind, **payload, "sequence_number": number}
    return {"type": kind, "sequence_number": number, **payload}
