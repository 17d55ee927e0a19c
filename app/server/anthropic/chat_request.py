"""Anthropic's Messages API as a chat request: a /v1/messages body becomes the
ChatCompletionRequest that /v1/chat/completions would run, so the chat template, tools, their
grammars and thinking all work the same way under both APIs.

The mapping, as vLLM's and llama.cpp's Messages endpoints make it:
- system → a system message, and a system message in `messages` stays one where it is (the
  chat template places it: app/server/prompts.py); a user's tool_result blocks → tool
  messages, in order, before the rest of that user message; an assistant's tool_use blocks →
  its tool_calls (arguments as JSON), its thinking → reasoning_content (a reasoning model's
  template may replay it).
- tools (name, description, input_schema) → functions; tool_choice auto/any/tool/none →
  auto/required/the named function/none; disable_parallel_tool_use → parallel_tool_calls false.
- thinking enabled with budget_tokens → max_thinking_tokens; disabled → the template's
  enable_thinking false (Qwen3's switch); adaptive → the model thinks as its template has it.
- context_management's clear_thinking edit → the thinking of earlier assistant turns left out
  of the prompt; its other edits are not applied, and unapplied_edits names them.
- output_config's format → response_format json_schema; its effort → reasoning_effort (xhigh
  and max as high).
- stop_sequences → stop; max_tokens is held to what the context leaves (fit_context), as
  llama.cpp does, since an Anthropic client must always send one.
"""

import json

from app.server.errors import APIError, validate
from app.server.anthropic.schemas import ContextManagement, CountTokensRequest, ToolResultBlock, ToolUseBlock
from app.server.schemas import ChatCompletionRequest

TOOL_CHOICE = {"auto": "auto", "any": "required", "none": "none"}
EFFORT = {"low": "low", "medium": "medium", "high": "high", "xhigh": "high", "max": "high"}


def chat_request(req: CountTokensRequest) -> ChatCompletionRequest:
    """The chat completion request a Messages (or count_tokens) request stands for."""
    messages = [m for message in req.messages for m in chat_messages(message)]
    body: dict = {"messages": system_messages(req.system) + clear_thinking(messages, req.context_management)}
    if req.tools:
        body["tools"] = [{"type": "function", "function": {"name": t.name, "description": t.description,
                                                           "parameters": t.input_schema}} for t in req.tools]
    if req.tool_choice is not None:
        choice = req.tool_choice
        body["tool_choice"] = TOOL_CHOICE.get(choice.type) or {"type": "function", "function": {"name": choice.name}}
        body["parallel_tool_calls"] = not choice.disable_parallel_tool_use
    if req.thinking is not None:
        if req.thinking.type == "disabled":
            body["chat_template_kwargs"] = {"enable_thinking": False}
        elif req.thinking.budget_tokens is not None:
            body["max_thinking_tokens"] = req.thinking.budget_tokens
    config = req.output_config
    if config is not None and config.format is not None:
        body["response_format"] = {"type": "json_schema", "json_schema": {"schema": config.format.schema_}}
    if config is not None and config.effort is not None:
        body["reasoning_effort"] = EFFORT[config.effort]
    if hasattr(req, "max_tokens"):
        body.update(max_tokens=req.max_tokens, stop=req.stop_sequences, stream=req.stream,
                    temperature=req.temperature, top_p=req.top_p, top_k=req.top_k)
    try:
        return validate(ChatCompletionRequest, body)
    except APIError as e:  # a field the Messages body shares (a tool's schema, the tool choice)
        raise APIError(400, e.message.replace("tool_choice.function.name", "tool_choice.name"), param=e.param) from None


THINKING_EDIT = "clear_thinking_"  # clear_thinking_20251015, and its later versions


def clear_thinking(messages: list[dict], management: ContextManagement | None) -> list[dict]:
    """The messages with the thinking of all but the last assistant turns that thought left out,
    as a clear_thinking edit asks (keep "all", or that many turns; one by default)."""
    edit = next((e for e in management.edits if e.type.startswith(THINKING_EDIT)), None) if management else None
    if edit is None or edit.keep == "all":
        return messages
    keep = 1 if edit.keep is None else edit.keep.value
    thought = [i for i, m in enumerate(messages) if "reasoning_content" in m]
    cleared = set(thought[:max(0, len(thought) - keep)])
    return [{k: v for k, v in m.items() if k != "reasoning_content"} if i in cleared else m
            for i, m in enumerate(messages)]


def unapplied_edits(management: ContextManagement | None) -> list[str]:
    """The context_management edits taken but not applied (clear_tool_uses_*): Spool keeps every
    tool result, so the prompt is longer than Anthropic's would be."""
    return [e.type for e in management.edits if not e.type.startswith(THINKING_EDIT)] if management else []


def system_messages(system) -> list[dict]:
    if not system:
        return []
    text = system if isinstance(system, str) else "\n\n".join(block.text for block in system)
    return [{"role": "system", "content": text}]


def chat_messages(message) -> list[dict]:
    """One Messages turn as chat messages: a user's tool results become tool messages."""
    blocks = message.content
    if isinstance(blocks, str):
        return [{"role": message.role, "content": blocks}]
    text = "".join(b.text for b in blocks if b.type == "text")
    if message.role == "system":
        return [{"role": "system", "content": text}]
    if message.role == "assistant":
        out = {"role": "assistant", "content": text}
        calls = [b for b in blocks if isinstance(b, ToolUseBlock)]
        if calls:
            out["tool_calls"] = [{"id": c.id, "type": "function",
                                  "function": {"name": c.name, "arguments": json.dumps(c.input, ensure_ascii=False)}}
                                 for c in calls]
        thinking = "".join(b.thinking for b in blocks if b.type == "thinking")
        if thinking:
            out["reasoning_content"] = thinking
        return [out]
    results = [{"role": "tool", "tool_call_id": b.tool_use_id, "content": b.text()}
               for b in blocks if isinstance(b, ToolResultBlock)]
    return results + ([{"role": "user", "content": text}] if text or not results else [])
