"""What a non-editable install carries: the kernels' sources, where model/ops/kernels.py looks,
the chat page's files, the peers' flag lists, and every package of app/ and model/ (pyproject.toml lists them one by
one)."""

import os
import subprocess
import sys
import tomllib
from pathlib import Path

from model.ops.kernels import CUDA_DIR, KERNELS, sources


def test_an_installed_copy_carries_every_kernel_source(tmp_path):
    """A non-editable install (what setuptools' build_py lays out for a wheel) holds cuda/ as
    model/cuda, and kernels.py finds the files there; never as a top-level `cuda` (the trap)."""
    root = Path(__file__).resolve().parent.parent
    lib = tmp_path / "lib"
    done = subprocess.run([sys.executable, "-c", "from setuptools import setup; setup()", "-q", "build_py",
                           "--build-lib", str(lib)], cwd=root, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert not (lib / "cuda").exists()
    installed = lib / "model" / "cuda"
    for file in KERNELS:
        for source in sources(file):
            assert (installed / source.relative_to(CUDA_DIR)).is_file(), source
    assert (installed / "shim" / "spool_shim.h").is_file()
    from app.server.chat_page import FILES

    assert all((lib / "app" / "server" / "ui" / name).is_file() for name in FILES)
    from app.peer_flags import LISTS

    assert all((lib / "app" / "peer_flags" / name).is_file() for name in LISTS.values())
    found = subprocess.run([sys.executable, "-c", "from model.ops.kernels import CUDA_DIR; print(CUDA_DIR)"],
                           cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(lib)}, capture_output=True, text=True)
    assert found.stdout.strip() == str(installed), found.stderr


def test_pyproject_lists_every_package():
    """A package left out of the list installs only as data (setuptools warns, and a later one
    drops it), so the list must name every folder with an __init__.py."""
    root = Path(__file__).resolve().parent.parent
    listed = set(tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {".".join(p.parent.relative_to(root).parts)
             for top in ("app", "model") for p in (root / top).rglob("__init__.py")}
    assert found <= listed, sorted(found - listed)
