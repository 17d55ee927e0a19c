"""OpenAI's Responses API as a chat request (the store that previous_response_id reads is
app/server/responses/store.py).

A response's conversation is its input items after those of the response it continues, then its
own output items (each output item is also a valid input item); the chat request is made from
that conversation, with this request's instructions as the system message (instructions are not
carried over, as OpenAI's are not). The mapping, as vLLM makes it:
- message items → chat messages (developer stays developer); function_call and custom_tool_call
  items → the assistant's tool_calls (under their qualified names: tools.py), joined to the
  assistant message just before them; function_call_output and custom_tool_call_output → tool
  messages; a reasoning item's text (or the thinking its encrypted_content carries back) → the
  next assistant message's reasoning_content.
- tools → chat functions (tools.py: namespaces qualified, custom tools as one string, hosted
  tools skipped); tool_choice (a namespace's tool by its qualified name, or by namespace and
  name), parallel_tool_calls → the same on chat; text.format → response_format;
  reasoning.effort → reasoning_effort (minimal as low, xhigh and max as high); max_output_tokens →
  max_tokens, held to what the context leaves.
"""

from app.server.errors import APIError, validate
from app.server.responses.encrypted_content import unseal
from app.server.responses.schemas import (
    CustomToolCallItem,
    FunctionCallItem,
    FunctionCallOutputItem,
    MessageItem,
    ReasoningItem,
    ResponsesRequest,
    text_of,
)
from app.server.responses.tools import Toolbox, chat_call, qualified
from app.server.schemas import ChatCompletionRequest

EFFORT = {"minimal": "low", "low": "low", "medium": "medium", "high": "high", "xhigh": "high", "max": "high"}


def input_items(req: ResponsesRequest) -> list[dict]:
    """This request's input as items (a string is one user message)."""
    if isinstance(req.input, str):
        return [{"type": "message", "role": "user", "content": req.input}]
    return [item.model_dump(by_alias=True, exclude_none=True) for item in req.input]


def chat_request(req: ResponsesRequest, conversation: list[dict], toolbox: Toolbox) -> ChatCompletionRequest:
    """The chat completion request that answers a conversation as this request asks, with the
    request's tools as the toolbox makes them."""
    items = validate(ResponsesRequest, {"input": conversation}).input
    instructions = [{"role": "system", "content": req.instructions}] if req.instructions else []
    messages = instructions + chat_messages(items)
    if not messages:
        raise APIError(400, "input is empty", param="input")
    body: dict = {"messages": messages, "parallel_tool_calls": req.parallel_tool_calls, "stream": req.stream,
                  "max_tokens": req.max_output_tokens, "temperature": req.temperature, "top_p": req.top_p}
    if toolbox.functions:
        body["tools"] = [{"type": "function", "function": function} for function in toolbox.functions]
    if req.tool_choice is not None:
        choice = req.tool_choice
        body["tool_choice"] = choice if isinstance(choice, str) else {
            "type": "function", "function": {"name": qualified(choice.name, choice.namespace)}}
    text_format = req.text.format if req.text else None
    if text_format is not None and text_format.type != "text":
        body["response_format"] = {"type": text_format.type}
        if text_format.type == "json_schema":
            if text_format.schema_ is None:
                raise APIError(400, "text.format of type json_schema needs a schema", param="text.format")
            body["response_format"]["json_schema"] = {"name": text_format.name, "schema": text_format.schema_,
                                                      "strict": text_format.strict}
    effort = req.reasoning.effort if req.reasoning else None
    if effort in EFFORT:
        body["reasoning_effort"] = EFFORT[effort]
    try:
        return validate(ChatCompletionRequest, body)
    except APIError as e:
        raise APIError(400, e.message.replace("tool_choice.function.name", "tool_choice.name"), param=e.param) from None


def chat_messages(items) -> list[dict]:
    out: list[dict] = []
    reasoning = ""
    for item in items:
        if isinstance(item, MessageItem):
            message = {"role": item.role, "content": text_of(item.content)}
            if item.role == "assistant" and reasoning:
                message["reasoning_content"], reasoning = reasoning, ""
            out.append(message)
        elif isinstance(item, FunctionCallItem | CustomToolCallItem):
            call = chat_call(item)
            if not (out and out[-1]["role"] == "assistant"):
                out.append({"role": "assistant", "content": ""})
                if reasoning:
                    out[-1]["reasoning_content"], reasoning = reasoning, ""
            out[-1].setdefault("tool_calls", []).append(call)
        elif isinstance(item, FunctionCallOutputItem):
            out.append({"role": "tool", "tool_call_id": item.call_id, "content": text_of(item.output)})
        elif isinstance(item, ReasoningItem):
            reasoning += text_of(item.content) or text_of(item.summary) or unseal(item.encrypted_content)
    return out
