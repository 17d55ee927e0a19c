"""numba's cache directory is keyed by the model package's source (model/caches.py): an edit to
any module a kernel inlines starts a fresh cache, an unchanged source reuses it."""

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from model import caches

ROOT = Path(__file__).resolve().parent.parent
KERNEL_STATS = """
import json, os
import model.quant.gemv as gemv  # first: model/__init__ sets numba's cache before numba loads
from numba.core.registry import CPUDispatcher
# the kernels numba caches (a helper they call, gemv._strip_rows, is compiled into each)
kernels = [v for v in vars(gemv).values() if isinstance(v, CPUDispatcher) and v.stats.cache_path]
print(json.dumps({"dir": os.environ["NUMBA_CACHE_DIR"],
                  "paths": sorted({k.stats.cache_path for k in kernels}),
                  "hits": sum(sum(k.stats.cache_hits.values()) for k in kernels),
                  "misses": sum(sum(k.stats.cache_misses.values()) for k in kernels)}))
"""


def python(code: str, cache_root: Path) -> subprocess.CompletedProcess:
    """code in a fresh interpreter on this checkout, with Spool's cache root at cache_root and
    numba's cache left for model/__init__ to choose."""
    env = {name: value for name, value in os.environ.items() if name != "NUMBA_CACHE_DIR"}
    env |= {"PYTHONPATH": str(ROOT), "SPOOL_CACHE_DIR": str(cache_root)}
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)


def test_key_changes_with_any_source_byte(tmp_path):
    copy = tmp_path / "model"
    shutil.copytree(caches.PACKAGE, copy, ignore=shutil.ignore_patterns("__pycache__"))
    key = caches.source_key(caches.PACKAGE)
    assert caches.source_key(copy) == key  # names are taken relative to the package
    helper = copy / "ops" / "llvm_ir.py"
    original = helper.read_bytes()
    helper.write_bytes(original[:-1] + bytes([original[-1] ^ 1]))
    assert caches.source_key(copy) != key
    helper.write_bytes(original)
    assert caches.source_key(copy) == key
    (copy / "quant" / "extra.py").write_text("")
    assert caches.source_key(copy) != key


def test_old_keys_are_pruned_and_others_kept(tmp_path, monkeypatch):
    monkeypatch.setenv("SPOOL_CACHE_DIR", str(tmp_path))
    old, recent = tmp_path / "numba" / "old", tmp_path / "numba" / "recent"
    for directory in (old, recent):
        (directory / "ops_x").mkdir(parents=True)
    week_ago = time.time() - caches.UNUSED_SECONDS - 60
    os.utime(old, (week_ago, week_ago))
    directory = caches.numba_cache_dir()
    assert directory == tmp_path / "numba" / caches.source_key()
    assert sorted(p.name for p in directory.parent.iterdir()) == sorted([directory.name, "recent"])


def test_kernels_compile_into_the_keyed_cache_and_reuse_it(tmp_path):
    keyed = tmp_path / "numba" / caches.source_key()
    runs = []
    for _ in range(2):
        done = python(KERNEL_STATS, tmp_path)
        assert done.returncode == 0, done.stderr
        runs.append(json.loads(done.stdout.splitlines()[-1]))
    first, second = runs
    assert first["dir"] == second["dir"] == str(keyed)
    assert first["paths"] and all(Path(p).parent == keyed for p in first["paths"] + second["paths"])
    assert first["misses"] > 0 and first["hits"] == 0
    assert second["misses"] == 0 and second["hits"] == first["misses"]
    assert list(keyed.rglob("*.nbi"))


def test_unwritable_cache_root_leaves_numba_its_own_places(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    done = python("import os, model; print(os.environ.get('NUMBA_CACHE_DIR'))", blocker / "cache")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "None"
    warning = done.stderr.strip().splitlines()
    assert len(warning) == 1 and "SPOOL_CACHE_DIR" in warning[0]
