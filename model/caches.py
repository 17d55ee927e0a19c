"""Where Spool keeps what it derives: the cache root, and numba's compiled kernels under it.

numba's own cache keys a kernel on its defining file alone, so an edit to a module the kernel
inlines (model/ops/llvm_ir.py, a scheme's constants in model/quant/) would leave stale machine
code running. model/__init__ therefore points NUMBA_CACHE_DIR, unless the user set it, at
<root>/numba/<key>, the key a hash of every source file of the model package: any edit (or
upgrade) starts a fresh directory. numba still keys each entry inside on its version, the CPU
name and features, and the Python version. Each start touches its own directory and removes
the other keys' directories left untouched for a week.
"""

import hashlib
import os
import shutil
import tempfile
import time
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent
UNUSED_SECONDS = 7 * 24 * 3600


def cache_root() -> Path:
    """$SPOOL_CACHE_DIR if set, else $XDG_CACHE_HOME/spool, else ~/.cache/spool."""
    env = os.environ.get("SPOOL_CACHE_DIR")
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    if xdg:
        return Path(xdg).expanduser() / "spool"
    return Path.home() / ".cache" / "spool"


def source_key(package: Path = PACKAGE) -> str:
    """A hash of the names and bytes of every .py file under package."""
    digest = hashlib.sha256()
    for path in sorted(package.rglob("*.py")):
        data = path.read_bytes()
        digest.update(f"{path.relative_to(package).as_posix()}\0{len(data)}\0".encode())
        digest.update(data)
    return digest.hexdigest()[:16]


def numba_cache_dir() -> Path:
    """This source's directory for numba's cache, created, touched and checked writable (OSError
    if it cannot be); other keys' directories unused for a week are removed."""
    parent = cache_root() / "numba"
    directory = parent / source_key()
    directory.mkdir(parents=True, exist_ok=True)
    os.utime(directory)
    tempfile.TemporaryFile(dir=directory).close()  # numba's own writability check
    cutoff = time.time() - UNUSED_SECONDS
    for entry in parent.iterdir():
        try:
            if entry != directory and entry.is_dir() and entry.stat().st_mtime < cutoff:
                shutil.rmtree(entry, ignore_errors=True)
        except OSError:  # another process removed it first
            pass
    return directory
