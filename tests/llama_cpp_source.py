"""llama.cpp's own test inputs: the vocabulary-only GGUFs and the ids llama.cpp encodes their
cases to (vendor/llama.cpp/models/ggml-vocab-NAME.gguf, .inp, .out), and real models' chat
templates (models/templates/*.jinja), from the llama-cpp-python source package, fetched once
into a cache folder ($SPOOL_LLAMA_CPP_SOURCE, else ~/.cache/spool/llama-cpp-source), and a skip
where pip or its index is not there."""

import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

import pytest

PACKAGE = "llama-cpp-python==0.3.36"
MODELS = "vendor/llama.cpp/models/"


def models_folder(wanted: str) -> Path:
    """The cached models/ folder, fetched where the file wanted (a path inside it) is missing."""
    root = Path(os.environ.get("SPOOL_LLAMA_CPP_SOURCE", Path.home() / ".cache" / "spool" / "llama-cpp-source"))
    if not (root / wanted).exists():
        fetch(root)
    return root


def template_folder() -> Path | None:
    """models/templates, fetched now where missing: tests are parametrized over its files at
    collection, before any test could fetch it. None where pip cannot fetch it."""
    try:
        return models_folder("templates") / "templates"
    except pytest.skip.Exception:
        return None


def chat_template(name: str) -> str:
    """A real model's chat template as llama.cpp's tests keep it (models/templates/NAME.jinja)."""
    return (models_folder(f"templates/{name}.jinja") / "templates" / f"{name}.jinja").read_text()


def vocab_cases(name: str) -> tuple[Path, list[tuple[str, list[int]]]]:
    """(the vocabulary GGUF of name, its cases: (text, llama.cpp's ids without special tokens))."""
    gguf = models_folder(f"ggml-vocab-{name}.gguf.out") / f"ggml-vocab-{name}.gguf"
    texts = gguf.with_suffix(".gguf.inp").read_text().split("\n__ggml_vocab_test__\n")
    ids = gguf.with_suffix(".gguf.out").read_text().split("\n")
    return gguf, [(t, [int(i) for i in line.split()]) for t, line in zip(texts, ids)]


def fetch(root: Path) -> None:
    """The source package's models/ folder, templates/ included, into root (renamed into place
    when complete, over an older copy)."""
    with tempfile.TemporaryDirectory() as tmp:
        try:
            done = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                                   "-d", tmp, PACKAGE], capture_output=True, text=True, timeout=600)
        except subprocess.TimeoutExpired:
            pytest.skip(f"pip download {PACKAGE} took over 10 minutes")
        archives = list(Path(tmp).glob("*.tar.gz"))
        if done.returncode != 0 or not archives:
            pytest.skip(f"pip could not download {PACKAGE}: {done.stderr[-400:]}")
        part = Path(tmp) / "models"
        part.mkdir()
        with tarfile.open(archives[0]) as tar:
            for member in tar.getmembers():
                at = member.name.find(MODELS)
                inside = member.name[at + len(MODELS):]
                if at >= 0 and member.isfile() and ("/" not in inside or inside.startswith("templates/")):
                    member.name = inside
                    tar.extract(member, part, filter="data")
        root.parent.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(root, ignore_errors=True)
        part.rename(root)
