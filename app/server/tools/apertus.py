"""Apertus's calls: a JSON list between tokens of their own, each call an object with one key,
the function's name, whose value is the arguments:

    <|tools_prefix|>[{"get_weather": {"city": "Paris"}}]<|tools_suffix|>
"""

from app.server.tools.base import parameters
from app.server.tools.blocks import JsonBlock, arguments_of, json_value


class Apertus(JsonBlock):
    name = "apertus"
    opener, closer = "<|tools_prefix|>", "<|tools_suffix|>"
    markers = (opener, closer)

    def call_object(self, index, name, arguments):
        return {name: arguments}

    def object_schema(self, function):
        return {"type": "object", "additionalProperties": False, "required": [function["name"]],
                "properties": {function["name"]: parameters(function)}}

    def read(self, body, properties):
        calls = json_value(body)
        if not isinstance(calls, list) or not calls or any(not isinstance(c, dict) or len(c) != 1 for c in calls):
            return None
        read = [(name, arguments_of(arguments)) for c in calls for name, arguments in c.items()]
        return None if any(a is None for _, a in read) else read
