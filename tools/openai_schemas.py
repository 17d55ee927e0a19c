"""tests/data/openai_response_schemas.json from OpenAI's published OpenAPI spec (the
openai/openai-openapi repository's openapi.json or openapi.yaml): the schemas of the bodies Spool
serves (ROOTS) and every schema they reference, transitively, which tests/test_openai_schemas.py
validates Spool's replies against with jsonschema.

Each schema is cut down to what validates: documentation keys (description, title, example,
examples, x-*) go, and OpenAPI 3.0's "nullable: true", which the 3.1 spec still uses in places,
becomes JSON Schema's anyOf with {"type": "null"}. The output names the spec's commit, date and API
version in its "source" key. From a clone (or mirror) of the spec's repository, at the root of
this one:

    git -C openai-openapi show <commit>:openapi.json > /tmp/openapi.json
    python tools/openai_schemas.py /tmp/openapi.json --commit <commit> --date <YYYY-MM-DD>
"""

import argparse
import json
from pathlib import Path

import yaml

OUT = Path(__file__).resolve().parent.parent / "tests" / "data" / "openai_response_schemas.json"

ROOTS = [
    "CreateChatCompletionResponse",  # POST /v1/chat/completions
    "CreateChatCompletionStreamResponse",  # its chunks
    "CreateCompletionResponse",  # POST /v1/completions, and (nearly) its chunks
    "ErrorResponse",  # every error body
    "ListModelsResponse",  # GET /v1/models
    "Model",  # GET /v1/models/{id}
    "Response",  # POST /v1/responses
    "ResponseStreamEvent",  # its server-sent events
]

DOC_KEYS = {"description", "title", "example", "examples"}
PREFIX = "#/components/schemas/"

# keywords whose value is a schema, a list of schemas, or a map of names to schemas; every other
# keyword's value (enum, const, default, required, discriminator...) is data, left as it is
ONE = {"additionalProperties", "items", "not", "if", "then", "else", "contains", "propertyNames",
       "unevaluatedProperties", "unevaluatedItems", "additionalItems", "contentSchema"}
MANY = {"allOf", "anyOf", "oneOf", "prefixItems"}
NAMED = {"properties", "patternProperties", "dependentSchemas", "$defs", "definitions"}


def clean(schema):
    """A schema without its documentation, its nullable spelled as JSON Schema spells it."""
    if not isinstance(schema, dict):  # true/false
        return schema
    out = {}
    for key, value in schema.items():
        if key in DOC_KEYS or key.startswith("x-") or key == "nullable":
            continue
        if key in ONE:
            value = [clean(s) for s in value] if isinstance(value, list) else clean(value)
        elif key in MANY:
            value = [clean(s) for s in value]
        elif key in NAMED:
            value = {name: clean(s) for name, s in value.items()}
        out[key] = value
    if schema.get("nullable") is True:
        if list(out) == ["anyOf"]:  # already a union: null joins it
            if {"type": "null"} not in out["anyOf"]:
                out = {"anyOf": out["anyOf"] + [{"type": "null"}]}
        else:
            out = {"anyOf": [out, {"type": "null"}]}
    return out


def refs(value, found: set[str]) -> set[str]:
    """The names of the component schemas a (raw) value refers to."""
    if isinstance(value, dict):
        for key, v in value.items():
            if key == "$ref" and isinstance(v, str):
                if not v.startswith(PREFIX):
                    raise SystemExit(f"a reference outside components/schemas: {v}")
                found.add(v[len(PREFIX):])
            else:
                refs(v, found)
    elif isinstance(value, list):
        for v in value:
            refs(v, found)
    return found


def closure(schemas: dict, roots: list[str]) -> list[str]:
    """The roots and every schema they reach through $ref, sorted by name."""
    missing = [name for name in roots if name not in schemas]
    if missing:
        raise SystemExit(f"the spec has no schema named {', '.join(missing)}")
    seen, todo = set(), list(roots)
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        if name not in schemas:
            raise SystemExit(f"a dangling reference to {name}")
        seen.add(name)
        todo.extend(refs(clean(schemas[name]), set()) - seen)  # refs of what is kept, not of docs
    return sorted(seen)


def load(path: Path) -> dict:
    text = path.read_text()
    return json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)


def build(spec: dict, commit: str, date: str, spec_name: str, roots: list[str] = ROOTS) -> dict:
    schemas = spec["components"]["schemas"]
    source = (f"github.com/openai/openai-openapi {spec_name}, commit {commit} ({date}), API version "
              f"{spec['info']['version']}: the response schemas Spool serves and every schema they "
              "reference, with documentation keys (description, title, example, examples, x-*) "
              "removed; "
              "OpenAPI 3.0's \"nullable: true\", which the file still uses, rewritten as JSON "
              "Schema's anyOf with null")
    return {"source": source,
            "components": {"schemas": {name: clean(schemas[name]) for name in closure(schemas, roots)}}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("spec", type=Path, help="openapi.json or openapi.yaml, as read from the commit")
    parser.add_argument("--commit", required=True, help="the spec repository's commit, 40 hex digits")
    parser.add_argument("--date", required=True, help="that commit's date, YYYY-MM-DD")
    parser.add_argument("--spec-name", help="the spec's file name in its repository (default: "
                        "openapi.json or openapi.yaml, by the given file's suffix)")
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    name = args.spec_name or ("openapi.json" if args.spec.suffix == ".json" else "openapi.yaml")
    data = build(load(args.spec), args.commit, args.date, name)
    args.out.write_text(json.dumps(data, indent=1) + "\n")
    print(f"{args.out}: {len(data['components']['schemas'])} schemas, {args.out.stat().st_size} bytes")


if __name__ == "__main__":
    main()
