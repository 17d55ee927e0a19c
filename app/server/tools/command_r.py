"""Command R7B's (and Command A's) calls: a JSON list between action tokens, each call numbered:

    <|START_ACTION|>[{"tool_call_id": "0", "tool_name": "get_weather", "parameters": {"city": "Paris"}}]<|END_ACTION|>
"""

from app.server.tools.blocks import JsonBlock


class CommandR(JsonBlock):
    name = "command_r"
    opener, closer = "<|START_ACTION|>", "<|END_ACTION|>"
    markers = (opener, closer)
    name_key, arguments_key = "tool_name", "parameters"

    def call_object(self, index, name, arguments):
        return {"tool_call_id": str(index), "tool_name": name, "parameters": arguments}

    def object_schema(self, function):
        schema = super().object_schema(function)
        return {**schema, "required": ["tool_call_id", *schema["required"]],
                "properties": {"tool_call_id": {"type": "string"}, **schema["properties"]}}
