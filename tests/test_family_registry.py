"""The families' structure (model/families/): one module per family, its names nowhere else in
model/, and a new family served end to end from one new module and nothing else."""

import ast
import importlib
import json
import pkgutil
import re
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest

import model.families as families
from model.config import ModelConfig
from model.errors import ModelError
from model.families import FAMILIES
from model.gguf.convert import convert_gguf
from model.runner import ModelRunner

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))

import test_families  # noqa: E402
from family_gguf import write_family_gguf  # noqa: E402
from family_models import FAMILIES as CHECKPOINTS, make_family  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
# Where a family's name is something else's name: tokenizer.ggml.pre names pre-tokenizers after
# the models that brought them (qwen2's: single digits, NFC; GPT-2's, GPT-4o's), whatever a file's architecture;
# tokenizer.ggml.model calls SentencePiece "llama".
# pre-tokenizers (tokenizer.ggml.pre's names), not model families; tokenizer.ggml.model's kinds
NOT_FAMILIES = {"model/gguf/pretok.py": {"qwen2", "_QWEN2", "qwen35", "_QWEN35", "gemma4", "_GPT2", "_GPT4O"},
                "model/gguf/vocab.py": {"llama", "gemma4"}, "model/gguf/tokenizer.py": {"gemma4"}}
# words that start with a family's stem but name something else: GPTQ, a quantization method (gpt-oss's "gpt")
NOT_FAMILY_WORDS = {"gptq"}


def test_every_family_is_one_module():
    """Each module holds one family, defined there, and the registry holds exactly those."""
    modules = [m.name for m in pkgutil.iter_modules(families.__path__) if m.name != "family"]
    for name in modules:
        module = importlib.import_module(f"model.families.{name}")
        assert type(module.FAMILY).__module__ == module.__name__, name
        assert FAMILIES[module.FAMILY.model_type] is module.FAMILY
    assert len(FAMILIES) == len(modules) >= 11
    assert len({f.architecture for f in FAMILIES.values()}) == len(FAMILIES)


def family_names() -> tuple[set[str], set[str]]:
    """(every string a family is known by: model_type, architectures entry, GGUF architecture,
    the vision-language wrapper's model_type; the stems of its names, for identifiers). Llama's
    stem is left out of the identifiers: the forward pass (model/llama.py) is named for it."""
    strings = {s for f in FAMILIES.values() for s in (f.model_type, f.architecture, f.gguf_arch, f.wrapper_type) if s}
    names = {s for f in FAMILIES.values() for s in (f.model_type, f.gguf_arch) if s}
    return strings, {re.match(r"[a-z]+", s).group() for s in names} - {"llama"}


def named_families(path: Path, strings: set[str], stems: set[str]) -> list[tuple[int, str]]:
    """The family names in a module's code, with their lines: string constants (not docstrings
    or comments) equal to one, identifiers with a word that starts with a stem."""
    tree = ast.parse(path.read_text())
    docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                  if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef)) and node.body
                  and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            found += [(node.lineno, node.value)] if node.value in strings else []
        name = node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else \
            node.name if isinstance(node, (ast.FunctionDef, ast.ClassDef)) else node.arg if isinstance(node, ast.arg) \
            else None
        if name and any(word.startswith(stem) and word not in NOT_FAMILY_WORDS for word in name.lower().split("_")
                        for stem in stems):
            found.append((node.lineno, name))
    return found


def test_no_module_outside_families_names_a_family():
    """model/ (but model/families/) and app/ branch on switches and fields, never on a family's
    name; app/ reads families, if at all, through the registry."""
    strings, stems = family_names()
    checked = 0
    for path in sorted([*(ROOT / "model").rglob("*.py"), *(ROOT / "app").rglob("*.py")]):
        rel = path.relative_to(ROOT).as_posix()
        if rel.startswith("model/families/"):
            continue
        checked += 1
        if rel.startswith("app/"):
            # tool formats are named as vLLM names its parsers (mistral, deepseek_v3)
            imports = [n.module for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.ImportFrom)]
            assert not [m for m in imports if m and m.startswith("model.families.")], rel
            continue
        found = [(line, name) for line, name in named_families(path, strings, stems)
                 if name not in NOT_FAMILIES.get(rel, ())]
        assert not found, (rel, found)
    assert checked > 100


def test_config_weights_and_gguf_read_the_registry():
    """They import it, and no other table of architectures is left in them."""
    for rel in ("model/config.py", "model/gguf/names.py", "model/gguf/metadata.py"):
        tree = ast.parse((ROOT / rel).read_text())
        assert "model.families" in {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}, rel
    assert "config.family" in (ROOT / "model/weights.py").read_text()


# A new family, as the next one will be added: this module in model/families/, nothing else. It
# is hypothetical (Qwen3's shape, its q/k/v and gate/up stored fused as Phi-3 stores them, the
# MLP's norm under another name), so that the fixture of an existing family checks it: the
# same weights, renamed, must give transformers' logits for Qwen3.
NEW_FAMILY = '''"""A hypothetical family: Qwen3's shape with fused q/k/v and gate/up."""

from model.families.family import Family


class FusedQk(Family):
    model_type, architecture, gguf_arch = "fusedqk", "FusedQkForCausalLM", "fusedqk"
    qk_norm = True
    qkv, gate_up = "self_attn.qkv_proj.weight", "mlp.gate_up_proj.weight"
    mlp_norm = "pre_feedforward_layernorm.weight"


FAMILY = FusedQk()
'''
SHAPE = "qwen3-yarn"  # the existing family's fixture it is checked against


@pytest.fixture
def new_family(tmp_path, monkeypatch, request):
    """The module dropped into the package's path and the registry rebuilt by discover(), as at
    import; undone afterwards."""
    package = tmp_path / "families"
    package.mkdir()
    (package / "fusedqk.py").write_text(NEW_FAMILY)
    monkeypatch.setattr(families, "__path__", [*families.__path__, str(package)])
    request.addfinalizer(lambda: sys.modules.pop("model.families.fusedqk", None))
    found = families.discover()
    assert set(found) - set(FAMILIES) == {"fusedqk"}
    for model_type, family in found.items():
        monkeypatch.setitem(FAMILIES, model_type, family)
    return found["fusedqk"]


def fused(tensors: dict, parts: list[str], into: str) -> dict:
    """Each layer's parts (name fragments: its first one's siblings) stacked into one tensor,
    named with into in place of the first."""
    out = {k: v for k, v in tensors.items() if not any(p in k for p in parts)}
    for name in [k for k in tensors if parts[0] in k]:
        out[name.replace(parts[0], into)] = np.concatenate([tensors[name.replace(parts[0], p)] for p in parts])
    return out


def new_family_checkpoint(path: Path) -> Path:
    from safetensors.numpy import load_file, save_file

    source, _ = make_family(SHAPE, path.parent / "source")
    tensors = load_file(source / "model.safetensors")
    tensors = fused(tensors, ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"], "self_attn.qkv_proj")
    tensors = fused(tensors, ["mlp.gate_proj", "mlp.up_proj"], "mlp.gate_up_proj")
    tensors = {k.replace("post_attention_layernorm", "pre_feedforward_layernorm"): v for k, v in tensors.items()}
    path.mkdir()
    save_file(tensors, str(path / "model.safetensors"))
    config = {**CHECKPOINTS[SHAPE][0], "model_type": "fusedqk", "architectures": ["FusedQkForCausalLM"]}
    (path / "config.json").write_text(json.dumps({k: v for k, v in config.items() if v is not None}))
    return path


def new_family_gguf(path: Path) -> Path:
    """The existing family's GGUF (as llama.cpp writes it) rewritten as the new family's: its
    architecture's keys, q/k/v fused into attn_qkv and gate/up into ffn_up (llama.cpp's names)."""
    source = gguf.GGUFReader(write_family_gguf(SHAPE, path.parent / "source.gguf"))
    old = source.get_field("general.architecture").contents()
    w = gguf.GGUFWriter(str(path), "fusedqk")
    for field in source.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        name = "fusedqk" + field.name[len(old):] if field.name.startswith(old + ".") else field.name
        w.add_key_value(name, field.contents(), field.types[0], field.types[-1] if len(field.types) > 1 else None)
    tensors = {t.name: np.array(t.data) for t in source.tensors}
    tensors = fused(tensors, ["attn_q.", "attn_k.", "attn_v."], "attn_qkv.")
    for name, array in fused(tensors, ["ffn_gate.", "ffn_up."], "ffn_up.").items():
        w.add_tensor(name, array)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_a_new_family_is_one_module(new_family, tmp_path):
    """Refused before its module is found; then, with nothing else changed, its checkpoint and its
    GGUF both load and give transformers' logits for the same weights."""
    checkpoint = new_family_checkpoint(tmp_path / "checkpoint")
    fixture = dict(np.load(test_families.FIXTURES / f"{SHAPE}.npz"))
    assert ModelConfig.load(checkpoint).family is new_family
    del FAMILIES["fusedqk"]
    with pytest.raises(ModelError, match="unsupported architecture 'fusedqk'"):
        ModelConfig.load(checkpoint)
    FAMILIES["fusedqk"] = new_family
    served = convert_gguf(new_family_gguf(tmp_path / "fusedqk.gguf"), tmp_path / "served")
    assert json.loads((served / "config.json").read_text())["architectures"] == ["FusedQkForCausalLM"]
    for path in (checkpoint, served):
        runner = ModelRunner.from_dir(path, num_blocks=16, block_size=4, max_model_len=CHECKPOINTS[SHAPE][1])
        assert runner.model.w.layers[0].q_norm is not None
        test_families.assert_matches(runner, fixture)
