"""The families Spool runs, one module each in this package: found by listing the package, so
that a new family is one new module (its FAMILY) and nothing else. model/config.py,
model/weights.py and model/gguf/ look a family up here, by config.json's model_type or by a
GGUF's general.architecture."""

import importlib
import pkgutil

from model.errors import ModelError
from model.families.family import Family

__all__ = ["FAMILIES", "Family", "discover", "gguf_family"]


def discover() -> dict[str, Family]:
    """Every module's FAMILY in this package (its __path__), by model_type."""
    found = {}
    for module in sorted(m.name for m in pkgutil.iter_modules(__path__)):
        if module != "family":
            family = importlib.import_module(f"{__name__}.{module}").FAMILY
            found[family.model_type] = family
    return found


FAMILIES = discover()


def gguf_family(arch, experts: bool, path) -> Family:
    """The family of a GGUF of general.architecture arch (a Llama-architecture GGUF with experts is
    Mixtral's); ModelError for an architecture, or a mixture of experts, Spool does not run."""
    found = [f for f in FAMILIES.values() if f.gguf_arch == arch]
    if not found:
        supported = sorted({f.gguf_arch for f in FAMILIES.values() if f.gguf_arch})
        raise ModelError(
            f"GGUF architecture {arch!r} in {path.name} is not supported"
            f" (supported: {', '.join(supported)}); use a Hugging Face model directory instead"
        )
    if experts and not any(f.moe for f in found):
        supported = sorted(f.gguf_arch for f in FAMILIES.values() if f.gguf_arch and f.moe)
        raise ModelError(f"{path.name} is a mixture of experts of architecture {arch}, which Spool does not run;"
                         f" it runs those of {', '.join(supported)}")
    return next((f for f in found if f.moe == experts), found[0])
