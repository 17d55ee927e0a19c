"""The OpenAI request bodies every generation runs as, as pydantic models: chat and
completions (the Messages and Responses APIs become a chat request), tokenize and detokenize;
and what replies share: usage and model cards. Each API's own replies are in its folder.

Requests accept OpenAI's fields plus the vLLM extensions users rely on (top_k, min_p,
repetition_penalty, min_tokens, ignore_eos, stop_token_ids). Unknown fields are ignored, as
vLLM and llama.cpp's server do, except the ones in UNSUPPORTED: those would change the output,
so a request that sets them is refused (400 naming the field) rather than silently answered as
if it had not. Fields that change nothing here (user, store, metadata, service_tier) pass.
Chat requests take tools (app/server/tools/); completions refuse them.
"""

import time
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic_core import PydanticCustomError

from app.server.limits import Limits
from app.server.request_limits import at_most, check_choice_count, check_format_schemas, check_stops, check_tools, \
    count_prompts

# the door's ranges, as model.sampling's last check holds them (written out here: the schemas
# load with the flags, before --threads is read, and must not import NumPy)
INT32_MAX, INT64_MIN, INT64_MAX = 2**31 - 1, -2**63, 2**63 - 1  # top_k; seed, as vLLM takes it
MAX_LOGIT_BIAS = 300  # entries, as OpenAI allows

# Fields that would change the output, and what Spool does not do yet; a value that asks for
# nothing (None, [], {}, false, "none", or "auto" but for tool_choice) passes.
UNSUPPORTED = {
    "tools": "tools are for /v1/chat/completions",
    "tool_choice": "tools are for /v1/chat/completions",
    "functions": "the legacy functions field is not supported; use tools",
    "function_call": "the legacy function_call field is not supported; use tool_choice",
    "suffix": "suffix (insertion) is not supported",
    "best_of": "best_of above n is not supported",
    "audio": "audio output is not supported",
    "modalities": "this model outputs text only",
    "web_search_options": "web search is not supported",
}

# vLLM's and llama-server's samplers and sampling switches that Spool does not implement yet,
# each with the values that leave it off (a request that sends those passes)
UNSUPPORTED_SAMPLERS = {
    "use_beam_search": (), "length_penalty": (1,), "truncate_prompt_tokens": (), "logits_processors": (),
    "n_probs": (0,), "min_keep": (0,), "repeat_penalty": (1,),
}
SAMPLER_WHY = "this sampler is not implemented yet; leave it out or off (docs/apis.md)"


def asks_for_nothing(field: str, value: Any) -> bool:
    if value == "auto":  # the default, except that tool_choice auto lets the model call tools
        return field != "tool_choice"
    return value in (None, [], {}, False, "none") or (field == "modalities" and value == ["text"])


class SamplingFields(BaseModel):
    model_config = ConfigDict(extra="ignore")
    unsupported: ClassVar[dict[str, str]] = UNSUPPORTED

    model: str | None = None
    stream: bool = False
    stream_options: "StreamOptions | None" = None
    n: int = Field(1, ge=1, le=16)
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = Field(None, ge=-1, le=INT32_MAX)  # -1 or 0: off; past the vocabulary: off
    min_p: float | None = None
    top_n_sigma: float | None = None  # llama-server's top-nσ; -1 or 0: off
    typical_p: float | None = None  # locally typical sampling (vLLM's and llama-server's); 1: off
    dynatemp_range: float | None = None  # llama-server's dynamic temperature; 0: off
    dynatemp_exponent: float | None = None
    xtc_probability: float | None = None  # llama-server's XTC; 0: off
    xtc_threshold: float | None = None  # above 0.5: off
    allowed_token_ids: list[int] | None = None  # vLLM's
    samplers: list[str] | str | None = None  # llama-server's chain: stage names in order, or their letters
    lora: list | None = None  # llama-server's [{"id": ID, "scale": SCALE}]: the LoRA adapter (app/server/adapters.py)
    bad_words: list[str] | None = None  # vLLM's
    penalty_last_n: int | None = None  # llama-server's penalty window (-1: all, 0: off), or its older name
    repeat_last_n: int | None = None
    dry_multiplier: float | None = None  # llama-server's DRY; 0: off
    dry_base: float | None = None
    dry_allowed_length: int | None = None
    dry_penalty_last_n: int | None = None
    dry_sequence_breakers: list[str] | None = None
    mirostat: int | None = None  # llama-server's: 2 is mirostat 2; 0 off; 1 is refused
    mirostat_tau: float | None = None
    mirostat_eta: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = Field(None, max_length=MAX_LOGIT_BIAS)
    seed: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX)  # vLLM's range
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    max_tokens: int | None = None
    min_tokens: int = Field(0, ge=0)
    ignore_eos: bool = False
    prompt_logprobs: int | None = Field(None, ge=0, le=20)  # vLLM's: each prompt token's logprob, and the top n
    user: str | None = None
    response_format: "ResponseFormat | None" = None
    # the same constraint under vLLM's, SGLang's and llama.cpp's names (app/server/formats.py)
    guided_json: dict | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structured_outputs: "StructuredOutputs | None" = None
    json_schema: dict | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _refuse_unsupported(cls, data):
        if isinstance(data, dict):
            for field, why in cls.unsupported.items():
                if field in data and not asks_for_nothing(field, data[field]):
                    if field == "best_of" and data[field] == data.get("n", 1):
                        continue
                    raise PydanticCustomError("unsupported", f"{field}: {why}", {"field": field})
            for field, off in UNSUPPORTED_SAMPLERS.items():
                value = data.get(field)
                if off is not None and not asks_for_nothing(field, value) and value not in off:
                    raise PydanticCustomError("unsupported", f"{field}: {SAMPLER_WHY}", {"field": field})
        return data

    def shows_prompt(self) -> bool:
        """The reply carries the prompt itself (its logprobs): then max_tokens 0 asks for something."""
        return self.prompt_logprobs is not None

    def prompt_count(self) -> int:
        return 1

    def check_limits(self, limits: Limits, max_queue: int) -> None:
        """A 400 for the first field over its limit (app/server/request_limits.py)."""
        check_choice_count(self.prompt_count(), self.n, limits, max_queue)
        check_stops(self.stop, "stop", limits)
        check_format_schemas(self, limits)

    @model_validator(mode="after")
    def _prompt_fields(self):
        if self.stream and self.prompt_logprobs is not None:  # as vLLM refuses them
            raise PydanticCustomError("unsupported", "prompt_logprobs are not available when stream is true",
                                      {"field": "prompt_logprobs"})
        if 0 in (self.max_tokens, getattr(self, "max_completion_tokens", None)) and not self.shows_prompt():
            raise PydanticCustomError("unsupported", "max_tokens 0 generates nothing; it is for scoring a prompt"
                                      " (echo with logprobs, or prompt_logprobs)", {"field": "max_tokens"})
        return self


class JsonSchemaFormat(BaseModel):
    name: str = "response"
    schema_: dict = Field(alias="schema")
    strict: bool | None = None
    description: str | None = None


class ResponseFormat(BaseModel):
    """OpenAI's response_format: free text, any JSON object, or JSON that follows a schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self):
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("type json_schema needs a json_schema object with a schema")
        return self


class StructuredOutputs(BaseModel):
    """vLLM's structured_outputs object: one of these."""

    json_: dict | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None


class StreamOptions(BaseModel):
    include_usage: bool = False


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class OtherPart(BaseModel):
    """An image, audio or file part: recognised, so that it can be refused by name."""

    model_config = ConfigDict(extra="allow")

    type: Literal["image_url", "input_audio", "file", "video_url", "audio_url", "image"]

    @model_validator(mode="after")
    def _refuse(self):
        raise PydanticCustomError("unsupported", f"this model takes text only; {self.type} parts are not supported")


class FunctionCall(BaseModel):
    name: str
    arguments: str


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[TextPart | OtherPart] | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # which call a tool message answers

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class FunctionDefinition(BaseModel):
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None


class Tool(BaseModel):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    type: Literal["function"]
    function: FunctionName


# What Spool passes the chat template itself; chat_template_kwargs may not set them.
TEMPLATE_OWN_VARIABLES = ("messages", "tools", "add_generation_prompt")


class ChatTemplateFields(BaseModel):
    """Extra variables for the chat template, as vLLM takes them: chat_template_kwargs (a Qwen3
    user's {"enable_thinking": false}), and OpenAI's reasoning_effort under that name."""

    chat_template_kwargs: dict[str, Any] | None = None
    reasoning_effort: Literal["low", "medium", "high"] | None = None

    @field_validator("chat_template_kwargs")
    @classmethod
    def _not_spools_own(cls, value):
        clash = [k for k in TEMPLATE_OWN_VARIABLES if k in (value or {})]
        if clash:
            raise PydanticCustomError("reserved", f"{clash[0]} is set by Spool itself; give it as a request field")
        return value

    def template_variables(self) -> dict[str, Any]:
        effort = {} if self.reasoning_effort is None else {"reasoning_effort": self.reasoning_effort}
        return {**effort, **(self.chat_template_kwargs or {})}


class ChatCompletionRequest(SamplingFields, ChatTemplateFields):
    unsupported: ClassVar[dict[str, str]] = {k: v for k, v in UNSUPPORTED.items()
                                             if k not in ("tools", "tool_choice")}

    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    add_generation_prompt: bool = True
    max_thinking_tokens: int | None = Field(None, ge=0)  # a reasoning model's thinking budget

    def check_limits(self, limits: Limits, max_queue: int) -> None:
        super().check_limits(limits, max_queue)
        at_most("messages", "messages", len(self.messages), limits.max_messages, "--max-messages")
        check_tools(self.tools, limits, lambda tool: tool.function.parameters, "function.parameters")


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False  # the prompt before the completion (and its tokens' logprobs, with logprobs)

    def shows_prompt(self) -> bool:
        return self.echo or super().shows_prompt()

    def prompt_count(self) -> int:
        return count_prompts(self.prompt)


class TokenizeRequest(ChatTemplateFields):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    add_special_tokens: bool = True
    add_generation_prompt: bool = True

    def check_limits(self, limits: Limits, max_queue: int) -> None:
        at_most("messages", "messages", len(self.messages or ()), limits.max_messages, "--max-messages")
        check_tools(self.tools, limits, lambda tool: tool.function.parameters, "function.parameters")


class DetokenizeRequest(BaseModel):
    model: str | None = None
    tokens: list[int]


# -- what replies share ------------------------------------------------------------------


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails = Field(default_factory=PromptTokensDetails)

class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "spool"
    max_model_len: int
    root: str | None = None  # a LoRA adapter's path, as vLLM lists it
    parent: str | None = None  # a LoRA adapter's base model


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


SamplingFields.model_rebuild()
