"""A Responses request's tools as a chat request's functions, and the model's calls back as the
API's output items.

- function tools: as they are.
- namespace tools (a group of function and custom tools: Codex's MCP servers and sub-agents):
  each member under its qualified name, `namespace__name` (the name MCP clients give such a
  tool, so models know the shape), its calls returned under the namespace and the member's own
  name, as OpenAI returns them: Codex finds the tool to run by that pair, and a flattened name
  is an "unsupported call" to it.
- custom (freeform) tools: a function of one string, `input`, held while the model writes it
  to the tool's grammar (a Lark grammar as one regex: lark_regex.py; a regex as it is; text:
  any string); their calls return as custom_tool_call items carrying that input.
- hosted tools (web_search, file_search, image_generation, code_interpreter, mcp ...): OpenAI's
  servers run them, and no client would run a call to one; they, and every other type (such as
  tool_search, whose calls are items of their own), are left out of the prompt and named for
  the response's Spool-Skipped-Tools header and its log line, rather than failing a whole
  agent's request.
"""

import json
import logging
from dataclasses import dataclass

from app.server.errors import APIError
from app.server.responses.lark_regex import NotRegular, lark_regex
from app.server.responses.schemas import CustomTool, HostedTool, NamespaceTool

log = logging.getLogger("spool.server")

SKIPPED_HEADER = "Spool-Skipped-Tools"


def qualified(name: str, namespace: str | None) -> str:
    """The name the model sees, and calls, for a tool of a namespace (or none)."""
    return f"{namespace}__{name}" if namespace else name


@dataclass(frozen=True)
class Callee:
    """The tool a chat function stands for."""

    name: str  # the tool's own name
    namespace: str | None = None
    custom: bool = False


class Toolbox:
    """One request's tools: the chat functions they become, what each stands for, and the
    hosted tools left out."""

    def __init__(self, tools: list | None):
        self.functions: list[dict] = []  # OpenAI chat function objects: name, description, parameters
        self.callees: dict[str, Callee] = {}
        self.skipped: list[str] = []  # hosted tools' types, each once
        for tool in tools or ():
            if isinstance(tool, HostedTool):
                if tool.type not in self.skipped:
                    self.skipped.append(tool.type)
            elif isinstance(tool, NamespaceTool):
                for member in tool.tools:
                    self.add(member, tool.name, tool.description)
            else:
                self.add(tool)

    def add(self, tool, namespace: str | None = None, about: str = "") -> None:
        name = qualified(tool.name, namespace)
        if len(name) > 64:  # what a chat function's name may be
            raise APIError(400, f"tools: the namespace {namespace!r} and its tool {tool.name!r} make the name {name!r},"
                                " over 64 characters", param="tools")
        self.callees[name] = Callee(tool.name, namespace, isinstance(tool, CustomTool))
        description = "\n\n".join(filter(None, [tool.description, about and f"({namespace}: {about})"])) or None
        if isinstance(tool, CustomTool):
            parameters = {"type": "object", "additionalProperties": False, "required": ["input"],
                          "properties": {"input": input_schema(tool)}}
            function = {"name": name, "description": description, "parameters": parameters}
        else:
            function = {**tool.model_dump(exclude={"type"}, exclude_none=True), "name": name,
                        "description": description}
        self.functions.append({k: v for k, v in function.items() if v is not None})

    def call_item(self, chat_name: str, arguments: str) -> dict:
        """A call's output item fields but its id and status: a function_call (with the
        namespace of a namespace's tool) or a custom_tool_call with its input."""
        callee = self.callees.get(chat_name, Callee(chat_name))
        where = {"name": callee.name} | ({"namespace": callee.namespace} if callee.namespace else {})
        if callee.custom:
            return {"type": "custom_tool_call", **where, "input": custom_input(arguments)}
        return {"type": "function_call", **where, "arguments": arguments}

    def is_custom(self, chat_name: str) -> bool:
        return chat_name in self.callees and self.callees[chat_name].custom

    def log_skipped(self, response_id: str) -> None:
        if self.skipped:
            log.info(f"{response_id}: skipped the tools {', '.join(self.skipped)} (Spool serves function, custom"
                     " and namespace tools)")

    def headers(self) -> dict[str, str]:
        return {SKIPPED_HEADER: ", ".join(self.skipped)} if self.skipped else {}


def input_schema(tool: CustomTool) -> dict:
    """A custom tool's input as a JSON string schema, held to its grammar where one regex can
    say it (llguidance reads a pattern as unanchored, as JSON Schema does, so it is anchored)."""
    fmt = tool.format
    if fmt is None or fmt.type == "text":
        return {"type": "string"}
    pattern = fmt.definition
    if fmt.syntax == "lark":
        try:
            pattern = lark_regex(fmt.definition)
        except NotRegular as e:
            log.info(f"custom tool {tool.name}: its grammar is not one regex ({e}); its input goes unconstrained")
            return {"type": "string"}
    return {"type": "string", "pattern": f"^(?:{pattern})$"}


def custom_input(arguments: str) -> str:
    """The input a custom tool's call wrote (as far as it got, for a call cut short)."""
    try:
        value = json.loads(arguments)
    except ValueError:
        return ""
    return value.get("input", "") if isinstance(value, dict) and isinstance(value.get("input"), str) else ""


def chat_call(item) -> dict:
    """An earlier call item (function_call or custom_tool_call) as a chat tool call."""
    if item.type == "custom_tool_call":
        arguments = json.dumps({"input": item.input}, ensure_ascii=False)
    else:
        arguments = item.arguments
    return {"id": item.call_id, "type": "function",
            "function": {"name": qualified(item.name, item.namespace), "arguments": arguments}}
