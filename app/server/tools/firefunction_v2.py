"""Firefunction v2's calls: a JSON list after the word functools, to the end of the list:

    functools[{"name": "get_weather", "arguments": {"city": "Paris"}}]
"""

from app.server.tools.blocks import JsonBlock


class FirefunctionV2(JsonBlock):
    name = "firefunction_v2"
    opener = "functools"
    markers = (opener,)
