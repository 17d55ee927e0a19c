"""Nemotron Nano 2's calls: a JSON list in <TOOLCALL> tags:

    <TOOLCALL>[{"name": "get_weather", "arguments": {"city": "Paris"}}]</TOOLCALL>
"""

from app.server.tools.blocks import JsonBlock


class NemotronJson(JsonBlock):
    name = "nemotron_json"
    opener, closer = "<TOOLCALL>", "</TOOLCALL>"
    markers = (opener, closer)
