"""Models named by Hugging Face Hub id, as vLLM (`Org/Name`) and llama-server (`Org/Name:Q4_K_M`) take them.

huggingface_hub does the fetching, so its cache (HF_HOME, HF_HUB_CACHE), HF_ENDPOINT, HF_TOKEN
and HF_HUB_OFFLINE mean what they mean to every other Hugging Face tool, and a model one of them
fetched is not fetched again. Only what Spool reads is fetched: a safetensors repository's
top-level config, tokenizer and weights (never its .bin, .pt, .onnx or GGUF copies, nor
original/), or the one GGUF file a quant tag or gguf_file picks out of a GGUF repository.

huggingface_hub is imported on first use: naming a local model never pays for it.
"""

from __future__ import annotations

import contextlib
import re
import sys
from pathlib import Path, PurePosixPath
from typing import Iterator

from model.errors import ModelError, one_line

# What model/config.py, model/tokenizer.py and model/weights.py read, and the small files beside them.
_SAFETENSORS_FILES = [
    "config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
    "special_tokens_map.json", "chat_template.jinja", "chat_template.json",
    "*.safetensors", "model.safetensors.index.json",
]
_IN_FOLDERS = ["*/*"]  # fnmatch's * crosses "/": without this, original/*.safetensors would match
_DEFAULT_QUANT = "Q4_K_M"  # llama-server's choice when a repository holds several quants
_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*(:[\w.-]+)?")
_SPLIT = re.compile(r"-(\d{5})-of-(\d{5})\.gguf$", re.IGNORECASE)


def is_hub_id(spec: str) -> bool:
    """Whether --model's value names a Hub repository: `org/name` or `org/name:QUANT` that is not
    a local path (a missing relative `dir/name` counts as an id, as vLLM takes it)."""
    if not _ID.fullmatch(spec) or spec.lower().endswith(".gguf"):
        return False
    return not Path(spec).expanduser().exists()


def resolve_hub(
    spec: str,
    *,
    gguf_file: str | None = None,
    revision: str | None = None,
    download_dir: str | None = None,
    progress: bool = True,
) -> Path:
    """A Hub id's local copy, fetched on first use: a model directory, or a .gguf file.

    gguf_file (llama-server's --hf-file) or the id's quant tag picks a GGUF; without either, a
    repository with a config.json is a safetensors checkpoint. download_dir is vLLM's
    --download-dir, the cache to use instead of huggingface_hub's. Every failure is a ModelError.
    """
    from huggingface_hub import constants

    repo, _, quant = spec.partition(":")
    offline = constants.HF_HUB_OFFLINE
    where = {"revision": revision, "cache_dir": download_dir, "local_files_only": offline}
    try:
        with _progress_bars(progress):
            files = _cached_files(repo, where) if offline else _hub_files(repo, revision)
            verb = "Using" if offline else "Fetching"
            source = "the Hugging Face cache" if offline else constants.ENDPOINT
            if gguf_file is None and not quant and _is_checkpoint(files):
                _say(f"{verb} {repo} from {source} ...")
                return Path(_snapshot(repo, where))
            name = _pick_gguf(repo, files, quant, gguf_file, offline)
            _say(f"{verb} {name} of {repo} from {source} ...")
            from huggingface_hub import hf_hub_download

            return Path(hf_hub_download(repo, name, **where))
    except _hub_errors() as exc:
        raise ModelError(_explain(exc, spec, revision, offline, download_dir)) from None


# ---------------------------------------------------------------------------------------------


def _hub_files(repo: str, revision: str | None) -> list[str]:
    from huggingface_hub import HfApi

    info = HfApi().model_info(repo, revision=revision)  # a new HfApi: HF_ENDPOINT as read now
    return [s.rfilename for s in info.siblings or ()]


def _is_checkpoint(files: list[str]) -> bool:
    """A config.json and top-level safetensors (some GGUF repositories carry a config.json too)."""
    return "config.json" in files and any(f.endswith(".safetensors") and "/" not in f for f in files)


def _cached_files(repo: str, where: dict) -> list[str]:
    """The files of the cached snapshot (offline: what there is to choose from)."""
    folder = Path(_snapshot(repo, where))
    return sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file())


def _snapshot(repo: str, where: dict) -> str:
    from huggingface_hub import snapshot_download

    return snapshot_download(repo, allow_patterns=_SAFETENSORS_FILES, ignore_patterns=_IN_FOLDERS, **where)


def _pick_gguf(repo: str, files: list[str], quant: str, gguf_file: str | None, offline: bool) -> str:
    """The one GGUF file to fetch: gguf_file, else the file tagged `quant`, else Q4_K_M's, else the
    only one; projectors (mmproj) are never the model."""
    ggufs = [f for f in files if f.lower().endswith(".gguf") and not PurePosixPath(f).name.lower().startswith("mmproj")]
    if gguf_file is not None:
        if not gguf_file.lower().endswith(".gguf"):
            raise ModelError(f"--gguf-file {gguf_file} does not end in .gguf; name one of {repo}'s GGUF files")
        if not offline and gguf_file not in files:  # offline, huggingface_hub says it is not cached
            raise ModelError(f"{repo} has no file {gguf_file}; its GGUF files: {_listed(ggufs)}")
        pool = [gguf_file]
    elif not ggufs and _is_checkpoint(files):
        raise ModelError(f"{repo} is a safetensors checkpoint with no GGUF files to pick {quant} from;"
                         f" serve it as {repo}")
    elif not ggufs:
        raise ModelError(f"{repo} has neither safetensors weights with a config.json nor GGUF files,"
                         " which is what Spool reads")
    elif quant:
        pool = [f for f in ggufs if _tagged(f, quant)]
        if not pool:
            cached = " in the Hugging Face cache (HF_HUB_OFFLINE=1)" if offline else ""
            raise ModelError(f"{repo} has no GGUF file tagged {quant}{cached}; its GGUF files: {_listed(ggufs)}")
    else:
        pool = [f for f in ggufs if _tagged(f, _DEFAULT_QUANT)] or ggufs
    if all(_SPLIT.search(f) for f in pool):
        parts = _SPLIT.search(pool[0]).group(2)
        raise ModelError(
            f"{pool[0]} is one of {int(parts)} parts of a split GGUF, which Spool cannot read; merge them with"
            " llama-gguf-split --merge and pass the merged file, or pick a quant that is one file"
        )
    if len(pool) > 1:
        raise ModelError(f"{repo} has {len(pool)} GGUF files ({_listed(pool)}); pick one as {repo}:QUANT"
                         " (for example :Q8_0) or with --gguf-file")
    return pool[0]


def _tagged(name: str, quant: str) -> bool:
    """Whether a file name carries the quant tag as a whole word: Q4_K is not Q4_K_M's tag."""
    return re.search(rf"(?<![A-Za-z0-9_]){re.escape(quant)}(?![A-Za-z0-9_])", name, re.IGNORECASE) is not None


def _listed(names: list[str]) -> str:
    return ", ".join(names) if names else "none"


def _say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


@contextlib.contextmanager
def _progress_bars(on: bool) -> Iterator[None]:
    """huggingface_hub's tqdm bars off for the call when on is false (not every version takes tqdm_class)."""
    from huggingface_hub.utils import are_progress_bars_disabled, disable_progress_bars, enable_progress_bars

    if on or are_progress_bars_disabled():
        yield
        return
    disable_progress_bars()
    try:
        yield
    finally:
        enable_progress_bars()


def _hub_errors() -> tuple[type[BaseException], ...]:
    """What huggingface_hub raises for a problem with the repository, the network or the cache.
    requests' errors (huggingface_hub < 1.0) are OSErrors; httpx's and httpx2's are not."""
    from huggingface_hub.errors import HFValidationError

    transport = tuple(sys.modules[m].TransportError for m in ("httpx", "httpx2") if m in sys.modules)
    return (OSError, HFValidationError, *transport)


def _explain(exc: BaseException, spec: str, revision: str | None, offline: bool, download_dir: str | None) -> str:
    """One line that says what went wrong with a Hub id and what to do about it."""
    from huggingface_hub import constants
    from huggingface_hub.errors import (
        EntryNotFoundError, GatedRepoError, HfHubHTTPError, HFValidationError, LocalEntryNotFoundError,
        OfflineModeIsEnabled, RepositoryNotFoundError, RevisionNotFoundError,
    )

    repo = spec.partition(":")[0]
    endpoint = constants.ENDPOINT
    cache = download_dir or constants.HF_HUB_CACHE
    status = getattr(getattr(exc, "response", None), "status_code", None)
    if offline and isinstance(exc, (LocalEntryNotFoundError, OfflineModeIsEnabled)):
        return (f"{spec} is not in the Hugging Face cache ({cache}) and HF_HUB_OFFLINE=1 forbids downloading it;"
                " fetch it once without HF_HUB_OFFLINE")
    if isinstance(exc, GatedRepoError):
        return (f"{repo} is gated: accept its terms at {endpoint}/{repo} and set HF_TOKEN to a token of that"
                f" account (the Hub answered HTTP {status})")
    if isinstance(exc, RepositoryNotFoundError):
        return (f"no model {repo} on {endpoint} (HTTP {status}); check the id, and for a private repository"
                " set HF_TOKEN to a token that may read it")
    if isinstance(exc, RevisionNotFoundError):
        return f"{repo} has no revision {revision}; check --revision"
    if isinstance(exc, LocalEntryNotFoundError):  # huggingface_hub's wording for "the Hub did not answer"
        return (f"cannot reach {endpoint} to fetch {repo}, and it is not in the cache ({cache}); check the network"
                " and HF_ENDPOINT")
    if isinstance(exc, EntryNotFoundError):
        url = getattr(getattr(exc, "response", None), "url", "a file")
        return f"{endpoint} does not serve {url}, which its listing of {repo} names; try again later"
    if isinstance(exc, HfHubHTTPError):
        hint = "; set HF_TOKEN to a token that may read it" if status in (401, 403) else ""
        return f"{endpoint} answered HTTP {status} for {repo}{hint}"
    if isinstance(exc, HFValidationError):
        return f"{spec} is not a valid Hub id ({one_line(exc)})"
    if isinstance(exc, OSError) and not type(exc).__module__.startswith("requests"):
        return (f"cannot fetch {repo} into {cache} ({one_line(exc)}); set HF_HOME or --download-dir to a writable"
                " directory")
    return (f"cannot reach {endpoint} to fetch {repo} ({type(exc).__name__}: {one_line(exc)}); check the network"
            " and HF_ENDPOINT, or set HF_HUB_OFFLINE=1 to use the models already in the cache")
