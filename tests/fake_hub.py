"""A stand-in for the Hugging Face Hub on 127.0.0.1, for tests that point HF_ENDPOINT at it.

It answers what huggingface_hub (2.x; file_download.py, hf_api.py, _snapshot_download.py) asks
to list and fetch a model repository, with the Hub's headers:

    GET  /api/models/{repo}[/revision/{rev}]   id, sha, siblings           (model_info, repo_info)
    GET  /api/models/{repo}/tree/{rev}         files, with LFS sha256      (snapshot_download)
    HEAD /{repo}/resolve/{rev}/{path}          X-Repo-Commit and ETag; a weights (LFS) file is a
    GET                                        302 to a second, "CDN" server, with X-Linked-Etag and
                                               X-Linked-Size, as the Hub sends its CDN's address
    GET  /blobs/{sha256}                       on the CDN: the bytes

Errors carry the Hub's X-Error-Code: RepoNotFound (401, as to an anonymous client),
RevisionNotFound and EntryNotFound (404), GatedRepo (401 without the repository's token). No
Xet headers are sent, so huggingface_hub downloads over plain HTTP.
"""

from __future__ import annotations

import hashlib
import json
import threading
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import PurePosixPath
from urllib.parse import unquote, urlsplit

LFS_SUFFIXES = {".safetensors", ".gguf", ".bin", ".pt", ".onnx"}


@dataclass
class Repo:
    files: dict[str, bytes]
    sha: str
    token: str | None  # gated: the one HF_TOKEN that may fetch its files


class FakeHub:
    """Two threaded HTTP servers (the Hub and its CDN) over one set of repositories; records every
    request as (method, path) in `requests`."""

    def __init__(self) -> None:
        self.repos: dict[str, Repo] = {}
        self.requests: list[tuple[str, str]] = []
        self.blobs: dict[str, bytes] = {}
        self._servers = [ThreadingHTTPServer(("127.0.0.1", 0), _handler(self)) for _ in range(2)]
        self.url, self.cdn_url = (f"http://127.0.0.1:{s.server_address[1]}" for s in self._servers)
        for s in self._servers:
            threading.Thread(target=s.serve_forever, daemon=True).start()

    def add(self, repo_id: str, files: dict[str, bytes], *, token: str | None = None) -> None:
        listing = json.dumps([repo_id, sorted((name, git_blob_id(data)) for name, data in files.items())])
        sha = hashlib.sha1(listing.encode()).hexdigest()
        self.repos[repo_id] = Repo(files, sha, token)
        self.blobs.update((hashlib.sha256(data).hexdigest(), data) for data in files.values())

    def resolved(self, repo_id: str) -> set[str]:
        """The files of repo_id that clients asked the resolve endpoint about (HEAD or GET)."""
        prefix = f"/{repo_id}/resolve/"
        return {path[len(prefix):].split("/", 1)[1] for _, path in self.requests if path.startswith(prefix)}

    def stop(self) -> None:
        for s in self._servers:
            s.shutdown()
            s.server_close()

    def __enter__(self) -> FakeHub:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def git_blob_id(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def _handler(hub: FakeHub) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args) -> None:
            pass

        def do_HEAD(self) -> None:
            self._route(body=False)

        def do_GET(self) -> None:
            self._route(body=True)

        def _route(self, body: bool) -> None:
            path = unquote(urlsplit(self.path).path)
            hub.requests.append((self.command, path))
            parts = path.strip("/").split("/")
            if parts[0] == "blobs" and len(parts) == 2 and parts[1] in hub.blobs:
                return self._send(200, hub.blobs[parts[1]], body)
            if parts[:2] == ["api", "models"] and len(parts) >= 4:
                return self._api("/".join(parts[2:4]), parts[4:], body)
            if len(parts) >= 5 and parts[2] == "resolve":
                return self._resolve("/".join(parts[:2]), parts[3], "/".join(parts[4:]), body)
            self._send(404, b"Not Found", body)

        def _api(self, repo_id: str, rest: list[str], body: bool) -> None:
            repo = hub.repos.get(repo_id)
            if repo is None:
                return self._error(401, "RepoNotFound", "Repository not found", body)
            rev = rest[1] if len(rest) == 2 and rest[0] in ("revision", "tree") else "main"
            if rev not in ("main", repo.sha):
                return self._error(404, "RevisionNotFound", "Invalid rev id", body, repo)
            if rest[:1] == ["tree"]:
                return self._json(_tree(repo), body)
            siblings = [{"rfilename": name} for name in repo.files]
            self._json({"_id": repo.sha[:24], "id": repo_id, "modelId": repo_id, "sha": repo.sha, "private": False,
                        "gated": "manual" if repo.token else False, "siblings": siblings}, body)

        def _resolve(self, repo_id: str, rev: str, name: str, body: bool) -> None:
            repo = hub.repos.get(repo_id)
            if repo is None:
                return self._error(401, "RepoNotFound", "Repository not found", body)
            if rev not in ("main", repo.sha):
                return self._error(404, "RevisionNotFound", "Invalid rev id", body, repo)
            if repo.token and self.headers.get("Authorization") != f"Bearer {repo.token}":
                return self._error(401, "GatedRepo", f"Access to model {repo_id} is restricted. You must have"
                                   " access to it and be authenticated to access it. Please log in.", body, repo)
            if name not in repo.files:
                return self._error(404, "EntryNotFound", f"{name} does not exist on \"{rev}\"", body, repo)
            data = repo.files[name]
            headers = {"X-Repo-Commit": repo.sha, "ETag": f'"{git_blob_id(data)}"'}
            if PurePosixPath(name).suffix not in LFS_SUFFIXES:
                return self._send(200, data, body, headers)
            sha256 = hashlib.sha256(data).hexdigest()
            headers |= {"X-Linked-Etag": f'"{sha256}"', "X-Linked-Size": str(len(data)),
                        "Location": f"{hub.cdn_url}/blobs/{sha256}"}
            self._send(302, b"", body, headers)

        def _error(self, status: int, code: str, message: str, body: bool, repo: Repo | None = None) -> None:
            headers = {"X-Error-Code": code, "X-Error-Message": message}
            if repo is not None:
                headers["X-Repo-Commit"] = repo.sha
            self._send(status, json.dumps({"error": message}).encode(), body, headers)

        def _json(self, value, body: bool) -> None:
            self._send(200, json.dumps(value).encode(), body, {"Content-Type": "application/json"})

        def _send(self, status: int, data: bytes, body: bool, headers: dict[str, str] | None = None) -> None:
            self.send_response(status)
            for key, value in (headers or {}).items():
                self.send_header(key, value)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            if body:
                self.wfile.write(data)

    return Handler


def _tree(repo: Repo) -> list[dict]:
    """The recursive tree listing: folders, then files with their git blob id and LFS pointer."""
    folders = sorted({str(p) for name in repo.files for p in PurePosixPath(name).parents if str(p) != "."})
    entries = [{"type": "directory", "oid": hashlib.sha1(f.encode()).hexdigest(), "size": 0, "path": f}
               for f in folders]
    for name, data in repo.files.items():
        entry = {"type": "file", "oid": git_blob_id(data), "size": len(data), "path": name}
        if PurePosixPath(name).suffix in LFS_SUFFIXES:
            entry["lfs"] = {"oid": hashlib.sha256(data).hexdigest(), "size": len(data), "pointerSize": 134}
        entries.append(entry)
    return entries
