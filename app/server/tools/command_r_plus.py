"""Command R+'s calls: a JSON list in a code block after "Action:":

    Action:
    ```json
    [{"tool_name": "get_weather", "parameters": {"city": "Paris"}}]
    ```
"""

from app.server.tools.blocks import JsonBlock


class CommandRPlus(JsonBlock):
    name = "command_r_plus"
    opener, closer = "Action:\n```json\n", "```"
    markers = (opener, closer)
    name_key, arguments_key = "tool_name", "parameters"
