"""Request and response bodies of OpenAI's Responses API (POST /v1/responses), as pydantic
models: what Codex and the official `openai` client's `responses.create` send and read.

Unknown fields are ignored (prompt_cache_key, client_metadata, safety_identifier, service_tier,
text.verbosity), as vLLM does; what would change the output and is not done here (images and
files in the input, background runs) is refused by name. Tools are function, custom (freeform)
and namespace tools; hosted tools, which OpenAI's servers run (web search, file search, MCP
servers ...), are parsed as HostedTool and skipped (app/server/responses/tools.py).
"""

import time
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, model_validator
from pydantic_core import PydanticCustomError

from app.server.limits import Limits
from app.server.request_limits import at_most, check_schema, check_tools


class Loose(BaseModel):
    model_config = ConfigDict(extra="ignore")


class InputText(Loose):
    type: Literal["input_text", "output_text", "text", "reasoning_text", "summary_text"]
    text: str


class InputOther(Loose):
    """An image, file or audio part: recognised, so that it can be refused by name."""

    type: Literal["input_image", "input_file", "input_audio"]

    @model_validator(mode="after")
    def _refuse(self):
        raise PydanticCustomError("unsupported", f"this model takes text only; {self.type} parts are not supported")


Parts = list[Annotated[InputText | InputOther, Field(discriminator="type")]]


def text_of(content: "str | list | None") -> str:
    return content if isinstance(content, str) else "".join(part.text for part in content or [])


class MessageItem(Loose):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | Parts


class FunctionCallItem(Loose):
    type: Literal["function_call"]
    call_id: str
    name: str
    namespace: str | None = None
    arguments: str


class CustomToolCallItem(Loose):
    type: Literal["custom_tool_call"]
    call_id: str
    name: str
    namespace: str | None = None
    input: str


class FunctionCallOutputItem(Loose):
    type: Literal["function_call_output", "custom_tool_call_output"]
    call_id: str
    output: str | Parts


class ReasoningItem(Loose):
    type: Literal["reasoning"]
    summary: Parts = Field(default_factory=list)
    content: Parts | None = None
    encrypted_content: str | None = None  # Spool's own: the thinking, encoded (encrypted_content.py)


InputItem = Annotated[MessageItem | FunctionCallItem | CustomToolCallItem | FunctionCallOutputItem | ReasoningItem,
                      Field(discriminator="type")]


class FunctionTool(Loose):
    type: Literal["function"]
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None


class CustomFormat(Loose):
    """What a custom tool's input must be: any text, or text a grammar (Lark or a regex) matches."""

    type: Literal["text", "grammar"]
    syntax: Literal["lark", "regex"] | None = None
    definition: str | None = None

    @model_validator(mode="after")
    def _grammar_given(self):
        if self.type == "grammar" and (self.syntax is None or self.definition is None):
            raise PydanticCustomError("missing", "a grammar format needs its syntax and definition")
        return self


class CustomTool(Loose):
    """A freeform tool: the model writes its input as plain text, not JSON arguments."""

    type: Literal["custom"]
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    format: CustomFormat | None = None


class NamespaceTool(Loose):
    """A group of tools the model calls by the group's name and its own (Codex's MCP servers
    and sub-agents)."""

    type: Literal["namespace"]
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str = ""
    tools: list[Annotated[FunctionTool | CustomTool, Field(discriminator="type")]] = Field(min_length=1)


class HostedTool(BaseModel):
    """A tool OpenAI's servers run (web_search, file_search, mcp ...): kept as given, to be skipped."""

    model_config = ConfigDict(extra="allow")

    type: str


def tool_kind(tool) -> str:
    kind = tool.get("type") if isinstance(tool, dict) else getattr(tool, "type", None)
    return kind if kind in ("function", "custom", "namespace") else "hosted"


Tool = Annotated[Annotated[FunctionTool, Tag("function")] | Annotated[CustomTool, Tag("custom")]
                 | Annotated[NamespaceTool, Tag("namespace")] | Annotated[HostedTool, Tag("hosted")],
                 Discriminator(tool_kind)]


class FunctionChoice(Loose):
    type: Literal["function", "custom"]
    name: str
    namespace: str | None = None


class TextFormat(Loose):
    type: Literal["text", "json_object", "json_schema"]
    name: str = "response"
    schema_: dict | None = Field(None, alias="schema")
    strict: bool | None = None


class TextConfig(Loose):
    format: TextFormat | None = None


class ReasoningConfig(Loose):
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = None
    summary: str | None = None


class ResponsesRequest(Loose):
    model: str | None = None
    input: str | list[InputItem] = Field(default_factory=list)
    instructions: str | None = None
    previous_response_id: str | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["auto", "none", "required"] | FunctionChoice | None = None
    parallel_tool_calls: bool = True
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, ge=0, le=1)
    stream: bool = False
    store: bool = True
    metadata: dict[str, str] | None = None
    user: str | None = None
    background: bool = False
    include: list[str] | None = None

    @model_validator(mode="before")
    @classmethod
    def _shape(cls, data):
        """Items without a type are messages (OpenAI's EasyInputMessage); background runs are
        refused by name."""
        if not isinstance(data, dict):
            return data
        if isinstance(data.get("input"), list):
            data = {**data, "input": [{"type": "message", **item} if isinstance(item, dict) and "type" not in item
                                      else item for item in data["input"]]}
        if data.get("background"):
            raise PydanticCustomError("unsupported", "background: background responses are not supported",
                                      {"field": "background"})
        return data

    def check_limits(self, limits: Limits, max_queue: int) -> None:
        """A 400 for the first field over its limit (app/server/request_limits.py)."""
        items = 1 if isinstance(self.input, str) else len(self.input)
        at_most("input", "items", items, limits.max_messages, "--max-messages")
        check_tools(self.callable_tools(), limits, tool_schema, "parameters")
        text_format = self.text.format if self.text else None
        if text_format is not None:
            check_schema(text_format.schema_, "text.format.schema", limits)


    def callable_tools(self) -> list:
        """The function and custom tools, a namespace's as its members."""
        return [member for tool in self.tools or () if not isinstance(tool, HostedTool)
                for member in (tool.tools if isinstance(tool, NamespaceTool) else [tool])]

    def wants_reasoning_back(self) -> bool:
        return "reasoning.encrypted_content" in (self.include or ())


def tool_schema(tool: FunctionTool | CustomTool) -> dict | str | None:
    """What a tool's size is checked by: a function's parameters, a custom tool's grammar."""
    if isinstance(tool, CustomTool):
        return tool.format.definition if tool.format else None
    return tool.parameters


# -- responses ---------------------------------------------------------------------------


class OutputText(BaseModel):
    # /openapi.json names the two OutputText models by module; these are the names it published
    # before app/server was grouped by API (tests/test_wire_bytes.py holds them)
    __module__ = "app.server.responses_schemas"

    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list = Field(default_factory=list)
    logprobs: list = Field(default_factory=list)


class OutputMessage(BaseModel):
    type: Literal["message"] = "message"
    id: str
    status: Literal["in_progress", "completed", "incomplete"]
    role: Literal["assistant"] = "assistant"
    content: list[OutputText]


class OutputFunctionCall(BaseModel):
    type: Literal["function_call"] = "function_call"
    id: str
    call_id: str
    name: str
    namespace: str | None = Field(None, exclude_if=lambda v: v is None)  # a namespace tool's
    arguments: str
    status: Literal["in_progress", "completed", "incomplete"]


class OutputCustomToolCall(BaseModel):
    type: Literal["custom_tool_call"] = "custom_tool_call"
    id: str
    call_id: str
    name: str
    namespace: str | None = Field(None, exclude_if=lambda v: v is None)
    input: str


class ReasoningText(BaseModel):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str


class OutputReasoning(BaseModel):
    type: Literal["reasoning"] = "reasoning"
    id: str
    summary: list = Field(default_factory=list)
    content: list[ReasoningText]
    encrypted_content: str | None = Field(None, exclude_if=lambda v: v is None)  # with include asking
    status: Literal["in_progress", "completed", "incomplete"]


OutputItem = Annotated[OutputMessage | OutputFunctionCall | OutputCustomToolCall | OutputReasoning,
                       Field(discriminator="type")]


class InputTokensDetails(BaseModel):
    cached_tokens: int = 0
    cache_write_tokens: int = 0  # the prefix cache keeps blocks without a charge


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class IncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens"]


class ResponseObject(BaseModel):
    id: str
    object: Literal["response"] = "response"
    created_at: int = Field(default_factory=lambda: int(time.time()))
    status: Literal["in_progress", "completed", "incomplete", "failed"]
    error: dict | None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    model: str
    output: list[OutputItem]
    parallel_tool_calls: bool
    previous_response_id: str | None = None
    reasoning: dict[str, Any]
    temperature: float
    text: dict[str, Any]
    tool_choice: Any
    tools: list[dict]
    top_p: float
    truncation: Literal["disabled"] = "disabled"
    usage: ResponseUsage | None = Field(None, exclude_if=lambda v: v is None)  # none while in progress
    user: str | None = Field(None, exclude_if=lambda v: v is None)
    metadata: dict[str, str] = Field(default_factory=dict)


class DeletedResponse(BaseModel):
    id: str
    object: Literal["response"] = "response"
    deleted: bool = True
