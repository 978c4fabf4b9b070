"""A Hugging Face Hub on loopback: the endpoints huggingface_hub's snapshot_download asks (a revision's commit, its
file tree, each file's HEAD and GET, with Range for a resumed download), serving one repository from a folder.
`cut`: file name → bytes: every GET of that file sends that many bytes and hangs up (a connection that keeps dropping),
until the entry is removed; `claimed`: file name → the size its HEAD claims (X-Linked-Size, as the Hub says an LFS
file's size), whatever it holds; `requests` records each GET's path and Range."""

from __future__ import annotations

import hashlib
import json
import threading
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

COMMIT = "0123456789abcdef0123456789abcdef01234567"


class Hub(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, repo: str, folder: Path) -> None:
        super().__init__(("127.0.0.1", 0), HubHandler)
        self.repo, self.folder = repo, folder
        self.cut: dict[str, int] = {}  # file name → bytes sent before hanging up, every time
        self.claimed: dict[str, int] = {}  # file name → the size its HEAD claims
        self.requests: list[tuple[str, str | None]] = []

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_port}"


class HubHandler(BaseHTTPRequestHandler):
    server: Hub
    protocol_version = "HTTP/1.1"

    def log_message(self, *args) -> None:
        pass

    def do_HEAD(self) -> None:
        self._file(body=False)

    def do_GET(self) -> None:
        self.server.requests.append((self.path, self.headers.get("Range")))
        api = f"/api/models/{self.server.repo}"
        if self.path.startswith(f"{api}/tree/"):
            files = sorted(self.server.folder.iterdir())
            self._json([{"type": "file", "path": p.name, "size": p.stat().st_size, "oid": _sha(p)[:40]} for p in files])
        elif self.path.startswith(f"{api}/revision/") or self.path.split("?")[0] == api:
            siblings = [{"rfilename": p.name} for p in sorted(self.server.folder.iterdir())]
            self._json({"id": self.server.repo, "sha": COMMIT, "siblings": siblings})
        elif self.path.startswith("/api/models/"):  # another repository: the Hub's answer for one that is absent
            self._json({"error": "Repository Not Found"}, 404, {"X-Error-Code": "RepoNotFound"})
        else:
            self._file(body=True)

    def _json(self, value: object, status: int = 200, headers: dict | None = None) -> None:
        data = json.dumps(value).encode()
        self.send_response(status)
        for name, header in (headers or {}).items():
            self.send_header(name, header)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _file(self, body: bool) -> None:
        prefix = f"/{self.server.repo}/resolve/"
        name = self.path.split("?")[0].removeprefix(prefix).partition("/")[2] if self.path.startswith(prefix) else ""
        path = self.server.folder / name
        if not name or "/" in name or not path.is_file():
            self.send_response(404)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        data = path.read_bytes()
        start = int(self.headers.get("Range", "bytes=0-").removeprefix("bytes=").split("-")[0] or 0)
        self.send_response(206 if start else 200)
        self.send_header("Content-Length", str(len(data) - start))
        if start:
            self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
        self.send_header("ETag", f'"{_sha(path)}"')
        self.send_header("Accept-Ranges", "bytes")
        self.send_header("X-Repo-Commit", COMMIT)
        if name in self.server.claimed:
            self.send_header("X-Linked-Size", str(self.server.claimed[name]))
        self.end_headers()
        if not body:
            return
        if name in self.server.cut:
            self.wfile.write(data[start : start + self.server.cut[name]])
            self.wfile.flush()
            self.close_connection = True
            self.connection.shutdown(2)
            return
        self.wfile.write(data[start:])


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@contextmanager
def local_hub(repo: str, folder: Path):
    hub = Hub(repo, folder)
    thread = threading.Thread(target=hub.serve_forever, daemon=True)
    thread.start()
    try:
        yield hub
    finally:
        hub.shutdown()
        hub.server_close()
