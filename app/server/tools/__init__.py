"""Tool calling: the tools into the prompt, the calls out of the model's text, and the grammar
that keeps a call valid, in the format the served model writes (one module per format).

The format is chosen once at start-up: named by --tool-call-parser (vLLM's names), else read
from the chat template's source (the markers its calls are written with), else Hermes's.

A chat template that knows tools (its source mentions them) gets them as transformers passes
them: `tools=[...]`, and assistant tool_calls with their arguments as objects. For one that does
not, such as the default model's, the format describes the tools in a system message and writes
earlier calls as the model would; tool results become user messages.

tool_choice, as vLLM reads it: "none" leaves the tools out of the prompt; "required" and a named
function hold the output to calls (several when parallel_tool_calls, else one); "auto" lets the
model write text, and once it opens its calls a grammar holds them to the functions' schemas,
so every call made parses and validates. The finish reason is "tool_calls" when calls were
made, except for a named function, which ends "stop" as OpenAI's does.
"""

import json
from dataclasses import dataclass, field

from app.server.errors import APIError
from app.server.tools.base import ToolFormat, call_id, partial_tag
from app.server.tools.apertus import Apertus
from app.server.tools.apriel import Apriel
from app.server.tools.command_r import CommandR
from app.server.tools.command_r_plus import CommandRPlus
from app.server.tools.deepseek_v3 import DeepSeekV3
from app.server.tools.deepseek_v31 import DeepSeekV31
from app.server.tools.deepseek_v32 import DSML, DeepSeekV4, DeepSeekV32
from app.server.tools.firefunction_v2 import FirefunctionV2
from app.server.tools.functionary_v31 import FunctionaryV31
from app.server.tools.functionary_v32 import FunctionaryV32
from app.server.tools.gemma4 import Gemma4
from app.server.tools.gigachat3 import GigaChat3
from app.server.tools.glimmer import Glimmer
from app.server.tools.glm45 import Glm45, Glm47
from app.server.tools.granite import Granite
from app.server.tools.hermes import Hermes, ToolCallParser
from app.server.tools.hy3 import Hy3
from app.server.tools.kimi_k2 import KimiK2
from app.server.tools.kimi_k3 import KimiK3
from app.server.tools.llama3_json import Llama3Json
from app.server.tools.minicpm import MiniCpm
from app.server.tools.minimax import MiniMax
from app.server.tools.minimax_m2 import MiniMaxM2
from app.server.tools.minimax_m3 import MiniMaxM3
from app.server.tools.mistral import Mistral
from app.server.tools.nemotron_json import NemotronJson
from app.server.tools.openai import OpenAI
from app.server.tools.pythonic import Pythonic
from app.server.tools.qwen3_coder import Qwen3Coder
from app.server.tools.seed_oss import SeedOss
from app.server.tools.solar_open import SolarOpen

FORMATS = {f.name: f for f in (
    Hermes, Llama3Json, Mistral, Qwen3Coder, DeepSeekV3, DeepSeekV31, DeepSeekV32, DeepSeekV4, Glm45, Glm47, Granite,
    KimiK2, KimiK3, OpenAI, Pythonic, SeedOss, MiniMax, MiniMaxM2, MiniMaxM3, Gemma4, Hy3, Apriel, NemotronJson, FirefunctionV2,
    CommandR, CommandRPlus, Apertus, GigaChat3, FunctionaryV31, FunctionaryV32, SolarOpen, Glimmer, MiniCpm)}

# What each format is known by in a chat template's source (every marker of one entry), the
# first entry that matches naming it: the more particular before those they contain (Seed-OSS's
# before Qwen3-Coder's, Hunyuan's before GLM's), the plainest (Hermes's <tool_call>) last.
SIGNS = [
    (Hy3, ":opensource", "<tool_sep"), (Glm45, "<arg_key>"), (KimiK2, "tool_calls_section_begin"),
    (KimiK3, "<|open|>", "<|close|>", "<|end_of_msg|>"), (Granite, "<|tool_call|>"), (OpenAI, "<|channel|>"),
    (Pythonic, "<|tool_call_start|>"), (Pythonic, "<|tool_list_start|>"), (Pythonic, "List of tools: ["),
    (SeedOss, "<seed:tool_call>"), (MiniMaxM2, "<minimax:tool_call>"), (MiniMaxM3, "]<]minimax[>[", "<invoke name="),
    (Gemma4, "<|tool_call>"), (DeepSeekV32, DSML, "function_calls"), (DeepSeekV4, DSML),
    (Glimmer, "<atem:function_calls>"), (SolarOpen, "<|tool_call:begin|>"), (Apertus, "<|tools_prefix|>"),
    (CommandR, "<|START_ACTION|>"), (NemotronJson, "<TOOLCALL>"), (FirefunctionV2, "functools["),
    (GigaChat3, "<|function_call|>"), (GigaChat3, "'function call'", "<|role_sep|>"),
    (MiniCpm, '<function name="', '<param name="'), (Qwen3Coder, "<function=", "<parameter="),
    (DeepSeekV3, "tool▁calls▁begin", "```json"), (DeepSeekV31, "tool▁calls▁begin"), (Mistral, "[TOOL_CALLS]"),
    (MiniMax, "<tool_calls>\\n"), (Apriel, "<tool_calls>["), (FunctionaryV31, "<function="), (FunctionaryV32, ">>>"),
    (CommandRPlus, "Action:"), (Llama3Json, "<|python_tag|>"), (Llama3Json, "ipython"), (Hermes, "<tool_call>"),
]
HERMES = Hermes()

__all__ = ["FORMATS", "HERMES", "ToolCallParser", "ToolFormat", "ToolUse", "call_id", "detect", "partial_tag",
           "prompt_messages"]


def detect(template: str) -> str | None:
    """The format a chat template writes calls in, by the markers in its source."""
    return next((fmt.name for fmt, *signs in SIGNS if all(sign in template for sign in signs)), None)


@dataclass
class ToolUse:
    """What a chat request asks of tools: the functions, and how the model may call them."""

    functions: list[dict]  # OpenAI's function objects: name, description, parameters
    choice: str  # "auto", "required" or "named"
    named: str | None = None
    parallel: bool = True
    format: ToolFormat = field(default=HERMES, repr=False)

    @classmethod
    def of(cls, req, tool_format: ToolFormat = HERMES) -> "ToolUse | None":
        """None when the request offers no tools or says tool_choice "none"; a 400 for a
        tool_choice that cannot be met."""
        choice = req.tool_choice
        if not req.tools:
            if choice not in (None, "none", "auto"):
                raise APIError(400, "tool_choice needs tools", param="tool_choice")
            return None
        if choice == "none":
            return None
        functions = [tool.function.model_dump(exclude_none=True) for tool in req.tools]
        names = [f["name"] for f in functions]
        if len(set(names)) < len(names):
            raise APIError(400, "two tools have the same name", param="tools")
        if choice in (None, "auto", "required"):
            return cls(functions, choice or "auto", parallel=req.parallel_tool_calls, format=tool_format)
        if choice.function.name not in names:
            raise APIError(400, f"tool_choice names {choice.function.name!r}, which is not among the tools",
                           param="tool_choice")
        return cls(functions, "named", named=choice.function.name, parallel=False, format=tool_format)

    def offered(self) -> list[dict]:
        """The functions the model may call: all, or the named one."""
        return [f for f in self.functions if self.choice != "named" or f["name"] == self.named]

    def finish_reason(self, reason: str, called: bool) -> str:
        if called and reason == "stop" and self.choice != "named":
            return "tool_calls"
        return reason

    def grammar(self) -> str:
        """llguidance Lark: the format's calls, their arguments held to the functions' schemas."""
        return self.format.grammar(self)

    def parser(self):
        """A parser for one choice's streamed text."""
        return self.format.parser(self)


def prompt_messages(messages: list[dict], tools: ToolUse | None, template_takes_tools: bool,
                    tool_format: ToolFormat | None = None, object_arguments: bool = True,
                    template_writes_calls: bool | None = None) -> tuple[list, dict]:
    """The messages and extra template variables for a chat with tools, or with earlier calls
    and tool results in its history (written in the tools' format, else tool_format's).

    What the template does not do itself, this does: a template that takes no tools gets them
    in a system block; one that writes no calls (its source never reads tool_calls) gets
    them in the assistant's text; one that knows neither gets tool results as user messages.
    object_arguments: a call's arguments go to the template as an object (else as JSON text,
    for the few templates that write them as a string)."""
    writes_calls = template_takes_tools if template_writes_calls is None else template_writes_calls
    fmt = tools.format if tools else tool_format or HERMES
    with_arguments = _with_object_arguments if object_arguments else _with_json_arguments
    out = []
    for m in messages:
        if m.get("tool_call_id"):
            m = {**m, "tool_call_id": fmt.template_id(m["tool_call_id"])}
        if m.get("tool_calls") and writes_calls:
            out.append({**m, "tool_calls": [with_arguments({**c, "id": fmt.template_id(c["id"])} if c.get("id") else c)
                                            for c in m["tool_calls"]]})
        elif m.get("tool_calls"):
            calls = fmt.write_calls([(c.get("function", {}).get("name", ""), _arguments(c)) for c in m["tool_calls"]])
            out.append({**_without_calls(m), "content": "\n".join(filter(None, [m.get("content"), calls]))})
        elif m["role"] == "tool" and not (template_takes_tools or writes_calls):
            out.append({"role": "user", "content": fmt.write_result(m.get("content") or "")})
        else:
            out.append(m)
    if tools and template_takes_tools:
        return out, {"tools": [{"type": "function", "function": f} for f in tools.functions]}
    if tools:
        block = fmt.instructions(tools.functions)
        if out and out[0]["role"] in ("system", "developer"):
            out[0] = {**out[0], "content": f'{out[0]["content"]}\n\n{block}'}
        else:
            out.insert(0, {"role": "system", "content": block})
    return out, {}


def _without_calls(message: dict) -> dict:
    return {k: v for k, v in message.items() if k != "tool_calls"}


def _arguments(call: dict):
    args = call.get("function", {}).get("arguments", "{}")
    if isinstance(args, str):
        try:
            return json.loads(args)
        except ValueError:
            raise APIError(400, "an assistant tool call's arguments are not valid JSON", param="messages") from None
    return args


def _with_object_arguments(call: dict) -> dict:
    return {**call, "function": {**call.get("function", {}), "arguments": _arguments(call)}}


def _with_json_arguments(call: dict) -> dict:
    arguments = json.dumps(_arguments(call), ensure_ascii=False)
    return {**call, "function": {**call.get("function", {}), "arguments": arguments}}
