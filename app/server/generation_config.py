"""vLLM's --generation-config: the sampling a model's creator recommends, in its
generation_config.json (Qwen's temperature 0.7, top_p 0.8, top_k 20), is what a request that
leaves those fields out gets. "auto" reads the model's file, "vllm" (vLLM's name for its own
defaults) reads none and leaves OpenAI's, and a folder reads its generation_config.json;
--override-generation-config's JSON object goes over whichever it is."""

import json
from pathlib import Path

# what vLLM takes from the file: the sampling fields, and max_new_tokens as max_tokens' default
FIELDS = {"temperature": float, "top_p": float, "top_k": int, "min_p": float, "repetition_penalty": float,
          "max_new_tokens": int}


def sampling_defaults(source: str, model_dir: Path, override: str | None) -> dict:
    """The defaults (FIELDS' names), or a ValueError of one line."""
    given = {}
    if source != "vllm":
        folder = Path(model_dir) if source == "auto" else Path(source).expanduser()
        path = folder / "generation_config.json"
        if path.is_file():
            given = _object(path.read_text(), f"{path}")
        elif source != "auto":
            raise ValueError(f"--generation-config {source!r} is not a folder with a generation_config.json")
    if override:
        given = {**given, **_object(override, "--override-generation-config")}
    defaults = {}
    for name, kind in FIELDS.items():
        value = given.get(name)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or kind is int and value != int(value):
            raise ValueError(f"{name} in the generation config must be a number{' (whole)' if kind is int else ''},"
                             f" not {value!r}")
        defaults[name] = kind(value)
    return defaults


def _object(text: str, where: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{where} is not JSON: {e}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{where} must be a JSON object")
    return value
