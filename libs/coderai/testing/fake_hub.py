"""A local fake of the Hugging Face Hub, speaking what huggingface_hub's client asks for (read from its source):
`GET /api/models/<repo>/revision/<rev>?blobs=True` (model_info with files_metadata) and `HEAD`/`GET
/<repo>/resolve/<rev>/<file>` with X-Repo-Commit, ETag, X-Linked-Etag (sha256 of LFS files), X-Linked-Size,
Content-Length and Range. Errors carry X-Error-Code as the Hub's do (RepoNotFound, EntryNotFound).

Catalogue pulls, a pod's worker fetching a model by its `source`, and the burst bench all talk to it through
`HF_ENDPOINT` (`hub_env`)."""

from __future__ import annotations

import hashlib
import json
import re
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote, urlsplit

COMMIT = "0123456789abcdef0123456789abcdef01234567"
CHUNK = 16 * 1024


def git_sha1(data: bytes) -> str:
    """The git blob sha1 of `data`: the Hub's etag of a file not kept in LFS."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


class FakeHub:
    """The server, on a random loopback port (`url`), serving the repos `add` gave it; it records every request
    and can cut a download (`drop_at`), serve a file's bytes wrong under the right headers (`corrupt`) or slow."""

    def __init__(self) -> None:
        self.repos: dict[str, dict[str, bytes]] = {}
        self.plain: set[tuple[str, str]] = set()  # files served as non-LFS (git sha1 etag)
        self.requests: list[tuple[str, str, str]] = []  # (method, path, Range header)
        self.tokens: set[str] = set()  # the bearer tokens requests came with (HF_TOKEN)
        self.drop_at: dict[str, int] = {}  # file -> byte offset where the connection is cut, once
        self.corrupt: set[str] = set()  # files whose bytes are served wrong (headers right)
        self.delay_s = 0.0  # per chunk, to make progress visible
        self._digests: dict[tuple[str, str], tuple[bytes, str, str]] = {}  # file -> (its bytes, git sha1, sha256)
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def add(self, repo: str, files: dict[str, bytes], plain: tuple[str, ...] = ()) -> None:
        self.repos[repo] = dict(files)
        self.plain |= {(repo, f) for f in plain}

    def digests(self, repo: str, file: str) -> tuple[str, str]:
        """The file's git blob sha1 and sha256, computed once per content: the real Hub has them ready, and
        hashing a gigabyte on every request would be timed (by the burst bench) as the Hub's latency."""
        data = self.repos[repo][file]
        known = self._digests.get((repo, file))
        if known is None or known[0] is not data:
            known = self._digests[(repo, file)] = (data, git_sha1(data), hashlib.sha256(data).hexdigest())
        return known[1], known[2]

    def etag(self, repo: str, file: str) -> str:
        sha1, sha256 = self.digests(repo, file)
        return sha1 if (repo, file) in self.plain else sha256

    def ranges(self, file: str) -> list[str]:
        """The Range header of each GET of `file`, in order ("" for a whole download)."""
        return [r for m, p, r in self.requests if m == "GET" and p.endswith("/" + file)]

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def _handler(hub: FakeHub):
    class H(BaseHTTPRequestHandler):
        def log_message(self, *_a) -> None:
            pass

        def _error(self, status: int, code: str) -> None:
            self.send_response(status)
            self.send_header("X-Error-Code", code)
            self.send_header("X-Repo-Commit", COMMIT)
            self.send_header("Content-Type", "application/json")
            body = json.dumps({"error": code}).encode()
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(body)

        def do_GET(self) -> None:
            self._serve()

        def do_HEAD(self) -> None:
            self._serve()

        def _serve(self) -> None:
            path = unquote(urlsplit(self.path).path)
            hub.requests.append((self.command, path, self.headers.get("Range", "")))
            auth = self.headers.get("Authorization", "")
            if auth.startswith("Bearer "):
                hub.tokens.add(auth.removeprefix("Bearer "))
            m = re.fullmatch(r"/api/models/([^/]+/[^/]+)(?:/revision/([^/]+))?", path)
            if m:
                return self._info(m.group(1))
            m = re.fullmatch(r"/([^/]+/[^/]+)/resolve/([^/]+)/(.+)", path)
            if not m:
                return self._error(404, "NotFound")
            repo, _rev, file = m.groups()
            if repo not in hub.repos:
                return self._error(404, "RepoNotFound")
            if file not in hub.repos[repo]:
                return self._error(404, "EntryNotFound")
            self._file(repo, file)

        def _info(self, repo: str) -> None:
            if repo not in hub.repos:
                return self._error(404, "RepoNotFound")
            sibs = []
            for f, data in hub.repos[repo].items():
                sha1, sha256 = hub.digests(repo, f)
                s = {"rfilename": f, "size": len(data), "blobId": sha1}
                if (repo, f) not in hub.plain:
                    s["lfs"] = {"sha256": sha256, "size": len(data), "pointerSize": 134}
                sibs.append(s)
            body = json.dumps({"id": repo, "modelId": repo, "sha": COMMIT, "private": False, "siblings": sibs}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def _file(self, repo: str, file: str) -> None:
            data = hub.repos[repo][file]
            etag = hub.etag(repo, file)
            start = 0
            rng = re.fullmatch(r"bytes=(\d+)-", self.headers.get("Range", ""))
            if rng and self.command == "GET":
                start = int(rng.group(1))
            self.send_response(206 if start else 200)
            self.send_header("X-Repo-Commit", COMMIT)
            self.send_header("ETag", f'"{etag}"')
            if (repo, file) not in hub.plain:
                self.send_header("X-Linked-Etag", f'"{etag}"')
                self.send_header("X-Linked-Size", str(len(data)))
            self.send_header("Accept-Ranges", "bytes")
            self.send_header("Content-Length", str(len(data) - start))
            if start:
                self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
            self.end_headers()
            if self.command == "HEAD":
                return
            body: bytes | bytearray | memoryview = memoryview(data)  # no copy of a gigabyte per download
            if file in hub.corrupt:
                body = bytearray(data)
                body[len(body) // 2] ^= 0xFF
            pos = start
            cut = hub.drop_at.get(file)
            while pos < len(body):
                end = min(pos + CHUNK, len(body))
                if cut is not None and pos < cut <= end:
                    self.wfile.write(bytes(body[pos:cut]))
                    self.wfile.flush()
                    del hub.drop_at[file]
                    self.connection.shutdown(socket.SHUT_RDWR)
                    self.close_connection = True
                    return
                self.wfile.write(bytes(body[pos:end]))
                pos = end
                if hub.delay_s:
                    self.wfile.flush()
                    threading.Event().wait(hub.delay_s)

    return H


def hub_env(hub: FakeHub, hf_home: str) -> dict[str, str]:
    """The environment that points huggingface_hub (in this process or a child) at `hub`, online (the engines'
    tests set HF_HUB_OFFLINE), with no telemetry, no Xet transfers and no progress bars; HF_HOME under `hf_home`."""
    return {
        "HF_ENDPOINT": hub.url,
        "HF_HUB_OFFLINE": "0",
        "HF_HUB_DISABLE_TELEMETRY": "1",
        "HF_HUB_DISABLE_XET": "1",
        "HF_HUB_DISABLE_PROGRESS_BARS": "1",
        "HF_HOME": hf_home,
    }


def blob(n: int, seed: int = 1) -> bytes:
    """n deterministic pseudo-random bytes."""
    out = bytearray()
    h = hashlib.sha256(str(seed).encode()).digest()
    while len(out) < n:
        h = hashlib.sha256(h).digest()
        out += h
    return bytes(out[:n])
