"""Tiny random-weight models whose chat templates write tool calls in each format Spool reads:
ChatML around the turns, the format's own markers (added tokens, as the real models have them)
around the calls and the tool results, the tools listed in the system turn."""

from pathlib import Path

from tiny_model import make_tiny_model

NL = "'\\n'"  # a newline, in a Jinja expression


def template(calls: str, result: str) -> str:
    """ChatML with tools: calls renders one assistant's calls (the loop variable c, arguments
    an object); result renders one tool message m."""
    return (
        "{% if tools %}{{ '<|im_start|>system' + " + NL + " }}{% for t in tools %}{{ t | tojson }}{{ " + NL
        + " }}{% endfor %}{{ '<|im_end|>' + " + NL + " }}{% endif %}"
        "{% for m in messages %}"
        "{% if m.role == 'tool' %}" + result +
        "{% elif m.tool_calls %}{{ '<|im_start|>assistant' + " + NL + " }}"
        "{% for c in m.tool_calls %}" + calls + "{% endfor %}{{ '<|im_end|>' + " + NL + " }}"
        "{% else %}{{ '<|im_start|>' + m.role + " + NL + " + m.content + '<|im_end|>' + " + NL + " }}{% endif %}"
        "{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant' + " + NL + " }}{% endif %}")


def user_turn(text: str) -> str:
    return "{{ '<|im_start|>user' + " + NL + " + " + text + " + '<|im_end|>' + " + NL + " }}"


NAME, ARGS = "c.function.name", "(c.function.arguments | tojson)"
MODELS = {
    "hermes": (["<tool_call>", "</tool_call>"], template(
        "{{ '<tool_call>' + " + NL + " + '{\"name\": \"' + " + NAME + " + '\", \"arguments\": ' + " + ARGS
        + " + '}' + " + NL + " + '</tool_call>' }}",
        user_turn("'<tool_response>' + " + NL + " + m.content + " + NL + " + '</tool_response>'"))),
    "llama3_json": (["<|python_tag|>"], template(
        "{{ '<|python_tag|>{\"name\": \"' + " + NAME + " + '\", \"parameters\": ' + " + ARGS + " + '}' }}",
        "{{ '<|im_start|>ipython' + " + NL + " + m.content + '<|im_end|>' + " + NL + " }}")),
    "mistral": (["[TOOL_CALLS]", "[TOOL_RESULTS]", "[/TOOL_RESULTS]"], template(
        "{{ '[TOOL_CALLS][{\"name\": \"' + " + NAME + " + '\", \"arguments\": ' + " + ARGS + " + '}]' }}",
        user_turn("'[TOOL_RESULTS]' + m.content + '[/TOOL_RESULTS]'"))),
    "qwen3_coder": (["<tool_call>", "</tool_call>"], template(
        "{{ '<tool_call>' + " + NL + " + '<function=' + " + NAME + " + '>' + " + NL + " }}"
        "{% for k, v in c.function.arguments | items %}{{ '<parameter=' + k + '>' + " + NL
        + " + (v if v is string else v | tojson) + " + NL + " + '</parameter>' + " + NL + " }}{% endfor %}"
        "{{ '</function>' + " + NL + " + '</tool_call>' }}",
        user_turn("'<tool_response>' + " + NL + " + m.content + " + NL + " + '</tool_response>'"))),
    "deepseek_v3": (["<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>",
                     "<｜tool▁sep｜>", "<｜tool▁output▁begin｜>", "<｜tool▁output▁end｜>"], template(
        "{{ '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>' + " + NAME + " + " + NL
        + " + '```json' + " + NL + " + " + ARGS + " + " + NL + " + '```<｜tool▁call▁end｜><｜tool▁calls▁end｜>' }}",
        user_turn("'<｜tool▁output▁begin｜>' + m.content + '<｜tool▁output▁end｜>'"))),
    "minimax_m3": (["]<]minimax[>["], template(
        "{{ ']<]minimax[>[<tool_call>' + " + NL + " + ']<]minimax[>[<invoke name=\"' + " + NAME + " + '\">' }}"
        "{% for k, v in c.function.arguments | items %}{{ ']<]minimax[>[<' + k + '>' + (v if v is string else v | tojson)"
        " + ']<]minimax[>[</' + k + '>' }}{% endfor %}"
        "{{ ']<]minimax[>[</invoke>' + " + NL + " + ']<]minimax[>[</tool_call>' }}",
        user_turn("'<response>' + m.content + '</response>'"))),
    "kimi_k3": (["<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>"], template(
        "{{ '<|open|>tools<|sep|><|open|>call tool=\"' + " + NAME + " + '\" index=\"1\"<|sep|>' }}"
        "{% for k, v in c.function.arguments | items %}{{ '<|open|>argument key=\"' + k + '\" type=\"'"
        " + ('string' if v is string else 'number') + '\"<|sep|>' + (v if v is string else v | tojson)"
        " + '<|close|>argument<|sep|>' }}{% endfor %}{{ '<|close|>call<|sep|><|close|>tools<|sep|>' }}",
        user_turn("'<|open|>message role=\"tool\"<|sep|>' + m.content + '<|close|>message<|sep|><|end_of_msg|>'"))),
}


def make_format_model(name: str, path: Path) -> Path:
    tokens, chat_template = MODELS[name]
    return make_tiny_model(path, tokens=tuple(tokens), chat_template=chat_template)
