"""Serving the head's model store to nodes: which file a store path names, its sha256 (computed once per
version of the file), and its bytes by range. Blocking file I/O: the service runs it in a thread."""

from __future__ import annotations

import os
import threading
from pathlib import Path

from coderai.contracts import BusError, StoreChunk, StoreFetch, check_store_path
from coderai.contracts.store import CHUNK_BYTES
from coderai.runtime.files import sha256_file


def resolve_store_path(root: Path, rel: str) -> Path:
    """The file `rel` names under the store `root`; bad_request for a path that leaves the store (`..`, an
    absolute path, a symlink pointing out) or names no plain file, not_found for a missing one."""
    try:
        check_store_path(rel)
    except ValueError as exc:
        raise BusError("bad_request", str(exc), param="path") from None
    base = root.resolve()
    target = (base / rel).resolve()
    if not target.is_relative_to(base):
        raise BusError("bad_request", f"store path {rel!r} leaves the model store", param="path")
    if not target.exists():
        raise BusError("not_found", f"no file {rel!r} in the head's model store")
    if not target.is_file():
        raise BusError("bad_request", f"store path {rel!r} is not a file", param="path")
    return target


class StoreFiles:
    """The model store under `root`, read by range; hashes are kept per (path, mtime, size)."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(os.path.expanduser(str(root)))
        self._hashes: dict[tuple[str, int, int], str] = {}
        self._lock = threading.Lock()  # one hash at a time: two nodes asking at once must not hash twice

    def sha256(self, path: Path, st: os.stat_result) -> str:
        key = (str(path), st.st_mtime_ns, st.st_size)
        with self._lock:
            if key not in self._hashes:
                self._hashes = {k: v for k, v in self._hashes.items() if k[0] != key[0]}  # forget older versions
                self._hashes[key] = sha256_file(path)
            return self._hashes[key]

    def read(self, req: StoreFetch) -> StoreChunk:
        """The bytes `req` asks for (at most CHUNK_BYTES), with the whole file's size and sha256."""
        if req.offset < 0 or req.length < 0:
            raise BusError("bad_request", "offset and length may not be negative")
        path = resolve_store_path(self.root, req.path)
        st = path.stat()
        digest = self.sha256(path, st)
        length = min(req.length, CHUNK_BYTES, max(0, st.st_size - req.offset))
        data = b""
        if length:
            with open(path, "rb") as fh:
                fh.seek(req.offset)
                data = fh.read(length)
        return StoreChunk(data=data, size=st.st_size, sha256=digest)
