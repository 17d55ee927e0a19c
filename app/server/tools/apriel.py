"""Apriel's calls: a JSON list in <tool_calls> tags (arguments as an object, or as JSON text):

    <tool_calls>[{"name": "get_weather", "arguments": {"city": "Paris"}}]</tool_calls>
"""

from app.server.tools.blocks import JsonBlock


class Apriel(JsonBlock):
    name = "apriel"
    opener, closer = "<tool_calls>", "</tool_calls>"
    markers = (opener, closer)
