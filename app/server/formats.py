"""What output format a request asks for, as one llguidance grammar.

OpenAI's response_format (json_object, json_schema), and the same constraints under the names
vLLM, SGLang and llama.cpp's server use: guided_json / structured_outputs.json / json_schema,
guided_regex / regex, guided_choice / choice, and guided_grammar / grammar (Lark, or GBNF
as llama.cpp writes it). At most one may be given; each is compiled by the engine, which
refuses one that does not compile (400 naming the field).

JSON allows at most 20 whitespace characters between tokens (as llama.cpp's JSON grammars do):
with unbounded whitespace a small model can pad an object with blank lines until max_tokens.
"""

import json

import llguidance
from llguidance.gbnf_to_lark import any_to_lark

from app.server.errors import APIError
from model.errors import one_line

JSON_WHITESPACE = r"[ \t\n\r]{0,20}"


def json_grammar(schema, param: str) -> str:
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as e:
            raise APIError(400, f"{param}: the schema is not valid JSON: {e}", param=param) from None
    if not isinstance(schema, dict):
        raise APIError(400, f"{param}: a JSON schema must be an object", param=param)
    return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults={"whitespace_pattern": JSON_WHITESPACE})


def choice_grammar(choices: list[str], param: str) -> str:
    if not choices:
        raise APIError(400, f"{param}: give at least one choice", param=param)
    return llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c, ensure_ascii=False)
                                                                        for c in choices))


def regex_grammar(pattern: str, param: str) -> str:
    return llguidance.LLMatcher.grammar_from_regex(pattern)


def lark_grammar(text: str, param: str) -> str:
    return llguidance.LLMatcher.grammar_from_lark(any_to_lark(text))


def after(top: str, grammar: str) -> str:
    """The output format, as `@answer`, after what the Lark rules top write first (a reasoning
    model's thinking)."""
    answer = json.loads(grammar)["grammars"] if grammar.lstrip().startswith("{") else [{"lark_grammar": grammar}]
    answer[0] = {**answer[0], "name": "answer"}
    return json.dumps({"grammars": [{"lark_grammar": top}, *answer]})


def requested(req) -> list[tuple[str, str]]:
    """(param, grammar) for every format the request sets."""
    found = []
    fmt = req.response_format
    if fmt is not None and fmt.type == "json_object":
        found.append(("response_format", json_grammar({"type": "object"}, "response_format")))
    elif fmt is not None and fmt.type == "json_schema":
        found.append(("response_format", json_grammar(fmt.json_schema.schema_, "response_format.json_schema.schema")))
    so = req.structured_outputs
    for param, value, build in [
        ("guided_json", req.guided_json, json_grammar), ("json_schema", req.json_schema, json_grammar),
        ("structured_outputs.json", so and so.json_, json_grammar),
        ("guided_regex", req.guided_regex, regex_grammar), ("regex", req.regex, regex_grammar),
        ("structured_outputs.regex", so and so.regex, regex_grammar),
        ("guided_choice", req.guided_choice, choice_grammar), ("choice", req.choice, choice_grammar),
        ("structured_outputs.choice", so and so.choice, choice_grammar),
        ("guided_grammar", req.guided_grammar, lark_grammar), ("grammar", req.grammar, lark_grammar),
        ("structured_outputs.grammar", so and so.grammar, lark_grammar),
    ]:
        if value is not None:
            try:
                found.append((param, build(value, param)))
            except APIError:
                raise
            except Exception as e:  # GbnfToLarkError, or a bare Exception ("No 'root' rule found"): the input's fault
                raise APIError(400, f"{param}: {one_line(e)}", param=param) from None
    return found


def grammar(req) -> tuple[str | None, str | None]:
    """(grammar, the field it came from) for the request's one output format, or (None, None)."""
    found = requested(req)
    if len(found) > 1:
        names = " and ".join(param for param, _ in found)
        raise APIError(400, f"give one output format, not {names}", param=found[1][0])
    return (found[0][1], found[0][0]) if found else (None, None)
