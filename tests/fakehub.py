"""A fake Hugging Face Hub on 127.0.0.1 for tests of download-weights and the HF cache.

It implements the routes huggingface_hub 0.36 calls for `HfApi.model_info`, `list_repo_tree`,
`list_repo_files`, `hf_hub_download` and `snapshot_download`:

- `GET  /api/models/{repo}[/revision/{rev}]` -> id, sha, siblings (with size, blobId, lfs)
- `GET  /api/models/{repo}/tree/{rev}[/{path}]` -> files and folders (`recursive` honoured)
- `HEAD|GET /{repo}/resolve/{rev}/{path}` -> bytes, with `X-Repo-Commit`, `ETag`, `Content-Length`
  and `Range` support (206 + `Content-Range`), so resumed downloads work.

Errors carry the `X-Error-Code` header the client maps to exception classes: `RepoNotFound`
(404), `GatedRepo` (401 without a token, 403 with a wrong one), `RevisionNotFound` and
`EntryNotFound` (404). Weight files (.bin, .safetensors, ...) are served like LFS files (the ETag
is their sha256); the others like git blobs (the ETag is their git sha1), as the real Hub does.

Tests use the `fake_hub` fixture (`from tests.fakehub import fake_hub_fixture  # noqa: F401`
registers it under the name `fake_hub` without ruff's F811 on the parameter): it points
huggingface_hub at the server (HF_ENDPOINT and the constants read at import time) and at a fresh
cache under tmp_path, and yields the `FakeHub` to add repositories to and read the request log of.
"""

from __future__ import annotations

import hashlib
import re
import socket
import threading
import time
from collections.abc import AsyncIterator, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

# Served like LFS objects: the ETag is the content's sha256, as for real weight files.
LFS_SUFFIXES = (".bin", ".safetensors", ".pt", ".pth", ".h5", ".msgpack", ".gguf", ".model")
_API_PATH = re.compile(
    r"^(?P<repo>[^/]+/[^/]+|[^/]+)"
    r"(?:/revision/(?P<rev>[^/]+)|/tree/(?P<tree_rev>[^/]+)(?:/(?P<tree_path>.+))?)?$"
)
_RESOLVE_PATH = re.compile(r"^(?P<repo>.+?)/resolve/(?P<rev>[^/]+)/(?P<file>.+)$")
_RANGE = re.compile(r"^bytes=(?P<start>\d+)-(?P<end>\d*)$")


def git_blob_sha1(data: bytes) -> str:
    """The git object id of `data`, which the Hub uses as the ETag of non-LFS files."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


@dataclass
class FakeRepo:
    """One model repository: file path -> bytes at a single commit, reachable by its branches."""

    repo_id: str
    files: dict[str, bytes]
    branches: tuple[str, ...] = ("main",)
    gated_token: str | None = None  # when set, the repo is gated: this bearer token gets access
    list_siblings: bool = True  # False: model_info has no siblings (client falls back to the tree)
    sha: str = field(init=False)

    def __post_init__(self) -> None:
        digest = hashlib.sha1(self.repo_id.encode())
        for name in sorted(self.files):
            digest.update(name.encode() + b"\0" + hashlib.sha256(self.files[name]).digest())
        self.sha = digest.hexdigest()

    def is_lfs(self, path: str) -> bool:
        """Whether the Hub would store `path` in LFS (weights), which changes its ETag."""
        return path.endswith(LFS_SUFFIXES)

    def etag(self, path: str) -> str:
        """The ETag the Hub sends for `path`: sha256 for LFS files, the git blob id otherwise."""
        data = self.files[path]
        return hashlib.sha256(data).hexdigest() if self.is_lfs(path) else git_blob_sha1(data)

    def entry(self, path: str) -> dict[str, object]:
        """The tree/sibling metadata of one file (both shapes: `rfilename` and `path`)."""
        data = self.files[path]
        item: dict[str, object] = {
            "type": "file",
            "rfilename": path,
            "path": path,
            "size": len(data),
            "blobId": git_blob_sha1(data),
            "oid": git_blob_sha1(data),
        }
        if self.is_lfs(path):
            sha256 = hashlib.sha256(data).hexdigest()
            item["lfs"] = {"size": len(data), "sha256": sha256, "oid": sha256, "pointerSize": 134}
        return item


@dataclass(frozen=True)
class LoggedRequest:
    """One request the fake hub answered (method, path, Range header, status, token sent)."""

    method: str
    path: str
    range: str | None
    status: int
    authorized: bool


class FakeHub:
    """The server: holds repositories in memory, logs requests, injects faults."""

    def __init__(self) -> None:
        self.repos: dict[str, FakeRepo] = {}
        self.log: list[LoggedRequest] = []
        self._interruptions: dict[tuple[str, str], list[int]] = {}  # (repo, file) -> [bytes, times]
        self._lock = threading.Lock()
        self.url = ""
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None
        routes = [
            Route("/api/models/{rest:path}", self._api, methods=["GET"]),
            Route("/{rest:path}", self._resolve, methods=["GET", "HEAD"]),
        ]
        self.app = Starlette(routes=routes)

    # --- test-facing API -------------------------------------------------------------------------

    def add_repo(
        self,
        repo_id: str,
        source: Path | Mapping[str, bytes],
        *,
        branches: tuple[str, ...] = ("main",),
        gated_token: str | None = None,
        list_siblings: bool = True,
    ) -> FakeRepo:
        """Serve `source` (a directory, read recursively, or path -> bytes) as `repo_id`."""
        if isinstance(source, Path):
            files = {
                p.relative_to(source).as_posix(): p.read_bytes()
                for p in sorted(source.rglob("*"))
                if p.is_file()
            }
        else:
            files = dict(source)
        repo = FakeRepo(repo_id, files, branches, gated_token, list_siblings)
        with self._lock:
            self.repos[repo_id] = repo
        return repo

    def interrupt(self, repo_id: str, path: str, after_bytes: int, times: int = 1) -> None:
        """Drop the connection after `after_bytes` body bytes on the next `times` GETs of a file."""
        with self._lock:
            self._interruptions[(repo_id, path)] = [after_bytes, times]

    def downloads(self, path: str | None = None) -> list[LoggedRequest]:
        """GET requests of file contents (not HEADs, not API calls), optionally of one file."""
        return [
            r
            for r in self.log
            if r.method == "GET"
            and "/resolve/" in r.path
            and (path is None or r.path.endswith(f"/{path}"))
        ]

    def reset(self) -> None:
        """Forget repositories, log and pending faults (between tests)."""
        with self._lock:
            self.repos.clear()
            self.log.clear()
            self._interruptions.clear()

    # --- server lifecycle -------------------------------------------------------------------------

    def start(self) -> None:
        """Serve on a free port of 127.0.0.1 from a daemon thread; return once it accepts."""
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        # log_level critical: the deliberate mid-body connection drops would log tracebacks.
        config = uvicorn.Config(self.app, log_level="critical", access_log=False, lifespan="off")
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(
            target=self._server.run, kwargs={"sockets": [sock]}, daemon=True
        )
        self._thread.start()
        deadline = time.monotonic() + 10
        while not self._server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError("the fake hub did not start within 10 s")
            time.sleep(0.01)

    def stop(self) -> None:
        """Ask uvicorn to exit and wait for its thread."""
        if self._server is not None and self._thread is not None:
            self._server.should_exit = True
            self._thread.join(timeout=5)

    # --- routes ----------------------------------------------------------------------------------

    def _record(self, request: Request, response: Response) -> Response:
        entry = LoggedRequest(
            method=request.method,
            path=request.url.path,
            range=request.headers.get("range"),
            status=response.status_code,
            authorized="authorization" in request.headers,
        )
        with self._lock:
            self.log.append(entry)
        return response

    @staticmethod
    def _error(status: int, code: str, message: str, commit: str | None = None) -> Response:
        headers = {"X-Error-Code": code, "X-Error-Message": message}
        if commit is not None:
            headers["X-Repo-Commit"] = commit
        return JSONResponse({"error": message}, status_code=status, headers=headers)

    def _access(self, request: Request, repo_id: str, rev: str) -> FakeRepo | Response:
        """The repo if it exists, the caller may read it and it has `rev`; else an error."""
        repo = self.repos.get(repo_id)
        if repo is None:
            return self._error(404, "RepoNotFound", "Repository not found")
        if repo.gated_token is not None:
            auth = request.headers.get("authorization")
            if auth != f"Bearer {repo.gated_token}":
                message = (
                    f"Access to model {repo_id} is restricted: you are not in the authorized list."
                )
                return self._error(401 if auth is None else 403, "GatedRepo", message)
        if rev not in repo.branches and rev != repo.sha:
            return self._error(404, "RevisionNotFound", f"Invalid rev id: {rev}")
        return repo

    async def _api(self, request: Request) -> Response:
        match = _API_PATH.match(request.path_params["rest"])
        if match is None:
            return self._record(request, self._error(404, "RepoNotFound", "Repository not found"))
        rev = match["rev"] or match["tree_rev"] or "main"
        repo = self._access(request, match["repo"], rev)
        if isinstance(repo, Response):
            return self._record(request, repo)
        if match["tree_rev"] is None:
            siblings = [repo.entry(p) for p in sorted(repo.files)] if repo.list_siblings else []
            body: object = {
                "id": repo.repo_id,
                "sha": repo.sha,
                "private": False,
                "siblings": siblings,
            }
            if repo.gated_token is not None:
                body = {**body, "gated": "manual"}  # type: ignore[dict-item]
        else:
            recursive = request.query_params.get("recursive", "false").lower() == "true"
            body = self._tree(repo, match["tree_path"] or "", recursive)
        return self._record(request, JSONResponse(body))

    @staticmethod
    def _tree(repo: FakeRepo, prefix: str, recursive: bool) -> list[dict[str, object]]:
        base = f"{prefix.rstrip('/')}/" if prefix else ""
        entries: list[dict[str, object]] = []
        folders: set[str] = set()
        for path in sorted(repo.files):
            if not path.startswith(base):
                continue
            rest = path[len(base) :]
            if "/" in rest:
                folder = base + rest.split("/", 1)[0]
                if folder not in folders:
                    folders.add(folder)
                    entries.append({"type": "directory", "path": folder, "oid": "0" * 40})
                if not recursive:
                    continue
            entries.append(repo.entry(path))
        return entries

    async def _resolve(self, request: Request) -> Response:
        match = _RESOLVE_PATH.match(request.path_params["rest"])
        if match is None:
            return self._record(request, self._error(404, "RepoNotFound", "Repository not found"))
        repo = self._access(request, match["repo"], match["rev"])
        if isinstance(repo, Response):
            return self._record(request, repo)
        path = match["file"]
        if path not in repo.files:
            message = f"{path} does not exist on {match['rev']}"
            return self._record(request, self._error(404, "EntryNotFound", message, repo.sha))
        return self._record(request, self._file_response(request, repo, path))

    def _file_response(self, request: Request, repo: FakeRepo, path: str) -> Response:
        data = repo.files[path]
        headers = {
            "X-Repo-Commit": repo.sha,
            "ETag": f'"{repo.etag(path)}"',
            "Accept-Ranges": "bytes",
            "Content-Type": "application/octet-stream",
        }
        status, start, end = 200, 0, len(data)
        wanted = _RANGE.match(request.headers.get("range", ""))
        if wanted is not None:
            start = int(wanted["start"])
            end = min(int(wanted["end"]) + 1, len(data)) if wanted["end"] else len(data)
            if start >= len(data):
                headers["Content-Range"] = f"bytes */{len(data)}"
                return Response(b"", status_code=416, headers=headers)
            status = 206
            headers["Content-Range"] = f"bytes {start}-{end - 1}/{len(data)}"
        body = data[start:end]
        headers["Content-Length"] = str(len(body))
        if request.method == "HEAD":
            return Response(b"", status_code=status, headers=headers)
        cut = self._take_interruption(repo.repo_id, path)
        if cut is None:
            return Response(body, status_code=status, headers=headers)

        async def truncated() -> AsyncIterator[bytes]:
            yield body[:cut]
            # Raising mid-body makes uvicorn close the socket: the client sees fewer bytes than
            # Content-Length announced, exactly like a dropped connection.
            raise ConnectionResetError("fake hub: simulated connection drop")

        return StreamingResponse(truncated(), status_code=status, headers=headers)

    def _take_interruption(self, repo_id: str, path: str) -> int | None:
        with self._lock:
            pending = self._interruptions.get((repo_id, path))
            if not pending or pending[1] <= 0:
                return None
            pending[1] -= 1
            return pending[0]


_SERVER: FakeHub | None = None
_SERVER_LOCK = threading.Lock()


def shared_fake_hub() -> FakeHub:
    """The one server of this test session, started on first use (a daemon thread)."""
    global _SERVER
    with _SERVER_LOCK:
        if _SERVER is None:
            hub = FakeHub()
            hub.start()
            _SERVER = hub
        return _SERVER


def point_hub_client_at(monkeypatch: pytest.MonkeyPatch, endpoint: str, home: Path) -> Path:
    """Make huggingface_hub use `endpoint` and a cache under `home`; return the hub cache dir.

    huggingface_hub copies several environment variables into `constants` (and one URL template
    into `file_download`) at import time, so setting the environment alone is not enough.
    """
    from huggingface_hub import constants, file_download
    from huggingface_hub.utils import reset_sessions

    cache = home / "hub"
    template = endpoint + "/{repo_id}/resolve/{revision}/{filename}"
    env = {
        "HF_ENDPOINT": endpoint,
        "HF_HOME": str(home),
        "HF_HUB_CACHE": str(cache),
        "HF_HUB_DISABLE_TELEMETRY": "1",
        "HF_HUB_DISABLE_PROGRESS_BARS": "1",
    }
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    for name in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(name, raising=False)
    patches: dict[str, object] = {
        "ENDPOINT": endpoint,
        "HUGGINGFACE_CO_URL_TEMPLATE": template,
        "HF_HOME": str(home),
        "HF_HUB_CACHE": str(cache),
        "HF_TOKEN_PATH": str(home / "token"),
        "HF_STORED_TOKENS_PATH": str(home / "stored_tokens"),
        "HF_HUB_OFFLINE": False,
        "HF_HUB_DISABLE_TELEMETRY": True,
        "HF_HUB_DISABLE_PROGRESS_BARS": True,
        "HF_HUB_ENABLE_HF_TRANSFER": False,
        "HF_HUB_ETAG_TIMEOUT": 5,
        "HF_HUB_DOWNLOAD_TIMEOUT": 5,
        # Small read chunks, so that a dropped connection leaves a partial file to resume from
        # (with the default 10 MB chunks a tiny model's partial bytes are never written).
        "DOWNLOAD_CHUNK_SIZE": 16 * 1024,
    }
    for name, value in patches.items():
        monkeypatch.setattr(constants, name, value)
    monkeypatch.setattr(file_download, "HUGGINGFACE_CO_URL_TEMPLATE", template)
    reset_sessions()  # sessions remember the offline mode they were created under
    return cache


def set_offline(monkeypatch: pytest.MonkeyPatch, offline: bool = True) -> None:
    """Turn huggingface_hub's offline mode (HF_HUB_OFFLINE) on or off for the rest of a test."""
    from huggingface_hub import constants
    from huggingface_hub.utils import reset_sessions

    monkeypatch.setenv("HF_HUB_OFFLINE", "1" if offline else "0")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", offline)
    reset_sessions()


@pytest.fixture(name="fake_hub")
def fake_hub_fixture(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeHub]:
    """The fake hub, emptied, with huggingface_hub pointed at it and at a fresh tmp cache."""
    hub = shared_fake_hub()
    hub.reset()
    point_hub_client_at(monkeypatch, hub.url, tmp_path / "hf-home")
    yield hub
    hub.reset()
    from huggingface_hub.utils import reset_sessions

    reset_sessions()


fake_hub = fake_hub_fixture  # the same fixture, for `from tests.fakehub import fake_hub`
