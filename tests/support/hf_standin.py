"""A local stand-in for the Hugging Face hub's file routes, so the real huggingface_hub client can be tested offline.

It serves `HEAD`/`GET /{owner}/{repo}/resolve/{revision}/{filename}` the way hf_hub_download needs them: the
commit in `X-Repo-Commit`, the file's sha256 as `ETag` (and `X-Linked-Etag`), `Content-Length`, and `Range:
bytes=N-` answered with 206 (how a dropped download resumes). A missing repo or file is a 404 with `X-Error-Code:
RepoNotFound` / `EntryNotFound`. `Range: bytes=N-M` is answered with those bytes (how a header is read
without the file), and the body bytes sent per file are counted in `sent`. `GET /api/models/{owner}/{repo}/tree/
{revision}` lists a repo's files as the hub's tree API does (what `-hf REPO:QUANT` picks from). Faults are scripted per file: `cut(...)` sends part of the body and drops the
connection, `fail(...)` answers with an HTTP error status. Every request is recorded in `requests`.

Point `HF_ENDPOINT` at `hub.url` (huggingface_hub reads it at import; llamaspec's registry passes it per call).
"""
from __future__ import annotations

import hashlib
import json
import re
import socket
import threading
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

COMMIT = "0123456789abcdef0123456789abcdef01234567"
_ROUTE = re.compile(r"^/(?P<repo>[^/]+/[^/]+)/resolve/(?P<revision>[^/]+)/(?P<filename>.+)$")
_RANGE = re.compile(r"^bytes=(\d+)-(\d*)$")
_TREE = re.compile(r"^/api/models/(?P<repo>[^/]+/[^/]+)/tree/(?P<revision>[^/?]+)(\?.*)?$")


def isolate_hub(tmp_path, monkeypatch) -> None:
    """A fresh user config dir and Hugging Face cache under tmp_path; any request not aimed at a stand-in hub goes
    to a closed port, and no token or offline switch of the caller's environment applies."""
    monkeypatch.setenv("LLAMASPEC_CONFIG_DIR", str(tmp_path / "config"))
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")
    for var in ("HF_HUB_CACHE", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_TOKEN"):
        monkeypatch.delenv(var, raising=False)


@dataclass(frozen=True)
class Request:
    method: str
    path: str
    range: str | None


class HubStandin:
    """`with HubStandin({"owner/repo": {"file.gguf": b"..."}}) as hub: ...` serves those files on 127.0.0.1."""

    def __init__(self, repos: dict[str, dict[str, bytes]]):
        self.repos = repos
        self.requests: list[Request] = []
        self.sent: dict[str, int] = {}   # file name -> body bytes sent
        self._cuts: dict[tuple[str, str], list[int]] = {}
        self._failures: dict[tuple[str, str], list[int]] = {}
        self._lock = threading.Lock()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _handler_for(self))
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def cut(self, repo: str, filename: str, after_bytes: int, times: int = 1) -> None:
        """The next `times` GETs of this file send `after_bytes` of the body, then drop the connection."""
        self._cuts.setdefault((repo, filename), []).extend([after_bytes] * times)

    def fail(self, repo: str, filename: str, status: int = 503, times: int = 1) -> None:
        """The next `times` GETs of this file are answered with `status`."""
        self._failures.setdefault((repo, filename), []).extend([status] * times)

    def gets(self, filename: str) -> list[Request]:
        return [r for r in self.requests if r.method == "GET" and r.path.endswith("/" + filename)]

    def __enter__(self) -> HubStandin:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._server.shutdown()
        self._server.server_close()

    def _next(self, table: dict, key: tuple[str, str]) -> int | None:
        with self._lock:
            queue = table.get(key)
            return queue.pop(0) if queue else None


def _handler_for(hub: HubStandin):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args) -> None:  # keep pytest output clean
            pass

        def do_HEAD(self) -> None:
            self._serve(send_body=False)

        def do_GET(self) -> None:
            self._serve(send_body=True)

        def _serve(self, send_body: bool) -> None:
            hub.requests.append(Request(self.command, self.path, self.headers.get("Range")))
            tree = _TREE.match(self.path)
            if tree is not None:
                return self._tree(tree["repo"])
            match = _ROUTE.match(self.path)
            if match is None or match["repo"] not in hub.repos:
                return self._error(404, "RepoNotFound", "Repository not found")
            content = hub.repos[match["repo"]].get(match["filename"])
            if content is None:
                return self._error(404, "EntryNotFound", "Entry not found")
            key = (match["repo"], match["filename"])
            status = hub._next(hub._failures, key) if send_body else None
            if status is not None:
                return self._error(status, None, "Injected failure")
            start, last = self._range(len(content))
            if start is not None and start >= len(content):
                return self._error(416, None, "Range not satisfiable")
            body = content[start or 0:last + 1]
            self.send_response(206 if start is not None else 200)
            etag = f'"{hashlib.sha256(content).hexdigest()}"'
            self.send_header("X-Repo-Commit", COMMIT)
            self.send_header("ETag", etag)
            self.send_header("X-Linked-Etag", etag)
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Accept-Ranges", "bytes")
            if start is not None:
                self.send_header("Content-Range", f"bytes {start}-{start + len(body) - 1}/{len(content)}")
            self.end_headers()
            if send_body:
                name = match["filename"]
                with hub._lock:
                    hub.sent[name] = hub.sent.get(name, 0) + len(body)
                self._send_body(body, hub._next(hub._cuts, key))

        def _send_body(self, body: bytes, cut_after: int | None) -> None:
            if cut_after is None:
                self.wfile.write(body)
                return
            self.wfile.write(body[:cut_after])
            self.wfile.flush()
            self.close_connection = True
            self.connection.shutdown(socket.SHUT_RDWR)

        def _range(self, size: int) -> tuple[int | None, int]:
            """(first byte or None without a Range header, last byte) asked for."""
            match = _RANGE.match(self.headers.get("Range", ""))
            if match is None:
                return None, size - 1
            return int(match[1]), min(int(match[2]), size - 1) if match[2] else size - 1

        def _tree(self, repo: str) -> None:
            if repo not in hub.repos:
                return self._error(404, "RepoNotFound", "Repository not found")
            entries = [{"type": "file", "oid": hashlib.sha1(data).hexdigest(), "size": len(data), "path": name}
                       for name, data in hub.repos[repo].items()]
            body = json.dumps(entries).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def _error(self, status: int, code: str | None, message: str) -> None:
            body = f'{{"error": "{message}"}}'.encode()
            self.send_response(status)
            if code:
                self.send_header("X-Error-Code", code)
            self.send_header("X-Error-Message", message)
            if code == "EntryNotFound":
                self.send_header("X-Repo-Commit", COMMIT)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(body)

    return Handler
