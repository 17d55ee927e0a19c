"""The replies of OpenAI's chat completions and completions, as pydantic models: the JSON
reply, the streamed chunk, their choices and logprobs (with vLLM's extra fields: stop_reason,
reasoning_content, prompt_logprobs)."""

import time
from typing import Literal

from pydantic import BaseModel, Field, create_model

from app.server.schemas import ToolCall, UsageInfo


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChoiceLogprobs(BaseModel):
    content: list[TokenLogprob] | None = None
    refusal: list[TokenLogprob] | None = None  # OpenAI's shape; Spool never refuses


class ResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = ""
    refusal: str | None = None
    tool_calls: list[ToolCall] | None = Field(None, exclude_if=lambda v: v is None)  # OpenAI's schema has no null
    reasoning_content: str | None = Field(None, exclude_if=lambda v: v is None)  # vLLM's field


class FunctionCallChunk(BaseModel):
    name: str | None = Field(None, exclude_if=lambda v: v is None)
    arguments: str


class ToolCallChunk(BaseModel):
    """A piece of a streamed call: the first has id, type and name; later ones more arguments."""

    index: int
    id: str | None = Field(None, exclude_if=lambda v: v is None)
    type: Literal["function"] | None = Field(None, exclude_if=lambda v: v is None)
    function: FunctionCallChunk


class PromptLogprob(BaseModel):
    """vLLM's prompt_logprobs entry for one token at one prompt position."""

    logprob: float
    rank: int  # 1: the most likely token there
    decoded_token: str


# vLLM's prompt_logprobs: per prompt token, null for the first, then {token id: entry} for the
# token itself and the most likely ones there
PromptLogprobs = list[dict[str, PromptLogprob] | None]


def choice_model(name: str, field: str, content: type, logprobs: type, **extra) -> type[BaseModel]:
    """A choice in OpenAI's order: its index, its content under the shape's name for it
    (message, delta or text), its logprobs, and how it ended (None while it runs); then any
    extra fields."""
    return create_model(name, __module__=__name__, index=(int, ...), **{field: (content, ...)},
                        logprobs=(logprobs | None, None), finish_reason=(str | None, None),
                        stop_reason=(str | int | None, None), **extra)


class Envelope(BaseModel):
    """The fields every reply and chunk of a generation starts with, in OpenAI's order; each
    shape names its object type."""

    id: str
    object: str
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = Field(None, exclude_if=lambda v: v is None)  # the first delta only
    content: str | None = None
    tool_calls: list[ToolCallChunk] | None = Field(None, exclude_if=lambda v: v is None)
    reasoning_content: str | None = Field(None, exclude_if=lambda v: v is None)


ChatChoice = choice_model("ChatChoice", "message", ResponseMessage, ChoiceLogprobs)
ChatChunkChoice = choice_model("ChatChunkChoice", "delta", DeltaMessage, ChoiceLogprobs)


class ChatCompletionResponse(Envelope):
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatChoice]
    usage: UsageInfo
    prompt_logprobs: PromptLogprobs | None = Field(None, exclude_if=lambda v: v is None)  # vLLM's, when asked


class ChatCompletionChunk(Envelope):
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: list[ChatChunkChoice]
    usage: UsageInfo | None = None


class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)  # None: an echoed prompt's first token
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


CompletionChoice = choice_model("CompletionChoice", "text", str, CompletionLogprobs, prompt_logprobs=(
    PromptLogprobs | None, Field(None, exclude_if=lambda v: v is None)))  # vLLM's, when asked


class CompletionResponse(Envelope):
    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]
    usage: UsageInfo | None = Field(None, exclude_if=lambda v: v is None)  # OpenAI's schema has no null here

