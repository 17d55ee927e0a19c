"""Request and response bodies of Anthropic's Messages API (POST /v1/messages), as pydantic
models: what Claude Code and the official `anthropic` client send and expect back.

Unknown fields are ignored (metadata, service_tier, cache_control on blocks), as vLLM's and
llama.cpp's Messages endpoints do, so Claude Code's requests pass whole; what would change the
output and is not done here (images, documents, server tools) is refused by name.
"""

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic_core import PydanticCustomError

from app.server.errors import APIError
from app.server.limits import Limits
from app.server.request_limits import at_most, check_schema, check_stops, check_tools
from app.server.schemas import INT32_MAX


class Loose(BaseModel):
    model_config = ConfigDict(extra="ignore")


class TextBlock(Loose):
    type: Literal["text"]
    text: str


class OtherBlock(Loose):
    """An image, document or search result: recognised, so that it can be refused by name."""

    type: Literal["image", "document", "search_result", "container_upload"]

    @model_validator(mode="after")
    def _refuse(self):
        raise PydanticCustomError("unsupported", f"this model takes text only; {self.type} blocks are not supported")


class ToolUseBlock(Loose):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict


class ToolResultBlock(Loose):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[Annotated[TextBlock | OtherBlock, Field(discriminator="type")]] | None = None
    is_error: bool = False

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class ThinkingBlock(Loose):
    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


class RedactedThinkingBlock(Loose):
    type: Literal["redacted_thinking"]
    data: str


ContentBlock = Annotated[TextBlock | OtherBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock
                         | RedactedThinkingBlock, Field(discriminator="type")]


class InputMessage(Loose):
    """A turn; a system message among them (Claude Code's, under the mid-conversation-system
    beta) holds text only, and is placed where the chat template allows."""

    role: Literal["user", "assistant", "system"]
    content: str | list[ContentBlock]

    @model_validator(mode="after")
    def _system_text(self):
        if self.role == "system" and not isinstance(self.content, str) \
                and any(block.type != "text" for block in self.content):
            raise ValueError("a system message holds text blocks only")
        return self


class AnthropicTool(Loose):
    """A client tool; Anthropic's server tools (web search, code execution ...) carry a
    versioned type and run on Anthropic's side, so they are refused."""

    type: str | None = None
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    input_schema: dict | None = None

    @model_validator(mode="after")
    def _client_tool(self):
        if self.type not in (None, "custom"):
            raise PydanticCustomError("unsupported", f"{self.type}: server tools are not supported; give client tools"
                                      " (name, description, input_schema)", {"field": "tools"})
        if self.input_schema is None:
            raise ValueError("a tool needs an input_schema")
        return self


class ToolChoice(Loose):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool = False

    @model_validator(mode="after")
    def _named(self):
        if self.type == "tool" and not self.name:
            raise ValueError("tool_choice of type tool needs a name")
        return self


class ThinkingConfig(Loose):
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = Field(None, ge=1)


class OutputFormat(Loose):
    type: Literal["json_schema"]
    schema_: dict = Field(alias="schema")


class OutputConfig(Loose):
    """Structured output (format) and effort, which reaches the template as reasoning_effort."""

    format: OutputFormat | None = None
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None


class KeepCount(Loose):
    type: Literal["thinking_turns", "tool_uses"]
    value: int = Field(ge=0, le=INT32_MAX)


class ContextEdit(Loose):
    """One of context_management's edits: clear_thinking_* drops the thinking of all but the
    last `keep` assistant turns that thought (one by default, as Anthropic's); any other edit
    (clear_tool_uses_*) is taken and not applied, and the reply names it in a header."""

    type: str = Field(max_length=64)
    keep: Literal["all"] | KeepCount | None = None


class ContextManagement(Loose):
    edits: list[ContextEdit] = Field(default_factory=list, max_length=16)


class CountTokensRequest(Loose):
    model: str | None = None
    messages: list[InputMessage] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    tools: list[AnthropicTool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: ThinkingConfig | None = None
    output_config: OutputConfig | None = None
    context_management: ContextManagement | None = None

    def check_limits(self, limits: Limits, max_queue: int) -> None:
        """A 400 for the first field over its limit (app/server/request_limits.py)."""
        at_most("messages", "messages", len(self.messages), limits.max_messages, "--max-messages")
        check_tools(self.tools, limits, lambda tool: tool.input_schema, "input_schema")
        config = self.output_config
        if config is not None and config.format is not None:
            check_schema(config.format.schema_, "output_config.format.schema", limits)


class MessagesRequest(CountTokensRequest):
    max_tokens: int = Field(ge=1)
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = None
    top_k: int | None = Field(None, ge=-1, le=INT32_MAX)

    def check_limits(self, limits: Limits, max_queue: int) -> None:
        super().check_limits(limits, max_queue)
        check_stops(self.stop_sequences, "stop_sequences", limits)


# -- responses ---------------------------------------------------------------------------


class OutputText(BaseModel):
    # /openapi.json names the two OutputText models by module; these are the names it published
    # before app/server was grouped by API (tests/test_wire_bytes.py holds them)
    __module__ = "app.server.messages_schemas"

    type: Literal["text"] = "text"
    text: str


class OutputThinking(BaseModel):
    type: Literal["thinking"] = "thinking"
    thinking: str
    signature: str = ""  # Spool signs nothing; clients send it back, and it is ignored


class OutputToolUse(BaseModel):
    type: Literal["tool_use"] = "tool_use"
    id: str
    name: str
    input: dict


OutputBlock = Annotated[OutputText | OutputThinking | OutputToolUse, Field(discriminator="type")]


class MessageUsage(BaseModel):
    """input_tokens counts the prompt tokens computed; those the prefix cache held are
    cache_read_input_tokens, as Anthropic splits them."""

    input_tokens: int
    output_tokens: int
    cache_creation_input_tokens: int = 0
    cache_read_input_tokens: int = 0


class MessageResponse(BaseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    model: str
    content: list[OutputBlock]
    stop_reason: Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"] | None
    stop_sequence: str | None = None
    usage: MessageUsage


class CountTokensResponse(BaseModel):
    input_tokens: int


ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    415: "invalid_request_error",
    429: "rate_limit_error",
    503: "overloaded_error",
}


class AnthropicErrorInfo(BaseModel):
    type: str
    message: str


class AnthropicErrorResponse(BaseModel):
    type: Literal["error"] = "error"
    error: AnthropicErrorInfo


def error_body(error: APIError) -> dict:
    """An error in Anthropic's shape, {"type": "error", "error": {type, message}}: the field a
    400 is about is named in the message."""
    message = error.message if error.param is None or error.param in error.message \
        else f"{error.param}: {error.message}"
    info = AnthropicErrorInfo(type=ERROR_TYPES.get(error.status, "api_error"), message=message)
    return AnthropicErrorResponse(error=info).model_dump()
