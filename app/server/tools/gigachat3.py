"""GigaChat 3's calls: one JSON object after a <|function_call|> token (3.1), or as a message
of the "function call" role (3):

    <|function_call|>{"name": "get_weather", "arguments": {"city": "Paris"}}
"""

from app.server.tools.blocks import JsonBlock

TOKEN, ROLE = "<|function_call|>", "function call<|role_sep|>\n"


class GigaChat3(JsonBlock):
    name = "gigachat3"
    listed = False

    def __init__(self, tokenizer=None):
        super().__init__(tokenizer)
        template = getattr(tokenizer, "chat_template_source", "")
        self.opener = ROLE if "function call" in template and TOKEN not in template else TOKEN
        self.markers = (self.opener,)
