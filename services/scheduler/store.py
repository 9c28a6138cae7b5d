"""Serving the head's model store to nodes: which file a store path names, its sha256 (computed once per
version of the file), its bytes by range, and the files of a folder (a model of several files). Blocking file I/O:
the service runs it in a thread."""

from __future__ import annotations

import os
import threading
from pathlib import Path

from coderai.contracts import (
    BusError,
    StoreChunk,
    StoreEntry,
    StoreFetch,
    StoreList,
    StoreListing,
    check_store_path,
    encode,
)
from coderai.contracts.store import CHUNK_BYTES, MAX_LIST_BYTES, MAX_LIST_FILES
from coderai.runtime.files import sha256_file


def _resolve(root: Path, rel: str, folder: bool) -> Path:
    """What `rel` names under the store `root`: bad_request for a path that leaves the store (`..`, an absolute
    path, a symlink pointing out) or names the wrong kind of thing, not_found for a missing one."""
    try:
        check_store_path(rel)
    except ValueError as exc:
        raise BusError("bad_request", str(exc), param="path") from None
    base = root.resolve()
    target = (base / rel).resolve()
    what = "folder" if folder else "file"
    if not target.is_relative_to(base):
        raise BusError("bad_request", f"store path {rel!r} leaves the model store", param="path")
    if not target.exists():
        raise BusError("not_found", f"no {what} {rel!r} in the head's model store")
    if target.is_dir() != folder or not (folder or target.is_file()):
        hint = " (a folder: end its store_path with '/')" if not folder and target.is_dir() else ""
        raise BusError("bad_request", f"store path {rel!r} is not a {what}{hint}", param="path")
    return target


def resolve_store_path(root: Path, rel: str) -> Path:
    """The plain file `rel` names under the store `root` (see `_resolve` for the refusals)."""
    return _resolve(root, rel, folder=False)


def resolve_store_folder(root: Path, rel: str) -> Path:
    """The folder `rel` names under the store `root` (see `_resolve` for the refusals)."""
    return _resolve(root, rel, folder=True)


def folder_files(root: Path, folder: Path) -> list[tuple[str, Path]]:
    """(path relative to `folder`, real path) of every file a node may fetch from `folder`, sorted: regular files
    at any depth, none hidden or under a hidden folder, none whose real path leaves the store (a symlink to a file
    inside it counts as that file); linked folders are not entered (no loops, nothing outside by the back door)."""
    base = root.resolve()
    out: list[tuple[str, Path]] = []
    for dirpath, dirs, names in os.walk(folder):  # followlinks=False
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        for name in sorted(names):
            p = Path(dirpath) / name
            rel = p.relative_to(folder).as_posix()
            try:
                check_store_path(rel)  # hidden names, backslashes: a node could not ask for them anyway
            except ValueError:
                continue
            real = p.resolve()
            if real.is_relative_to(base) and real.is_file():
                out.append((rel, real))
    return sorted(out)


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

    def listing(self, req: StoreList) -> StoreListing:
        """The files of the folder `req` names, each with its size and sha256 (hashed once per version)."""
        folder = resolve_store_folder(self.root, req.path)
        found = folder_files(self.root, folder)
        if len(found) > MAX_LIST_FILES:
            raise BusError(
                "bad_request",
                f"store folder {req.path!r} holds {len(found)} files, more than the {MAX_LIST_FILES} a node fetches",
                param="path",
            )
        entries = []
        for rel, real in found:
            st = real.stat()
            entries.append(StoreEntry(path=rel, size=st.st_size, sha256=self.sha256(real, st)))
        listing = StoreListing(files=entries)
        if len(encode(listing)) > MAX_LIST_BYTES:
            raise BusError(
                "bad_request", f"the listing of store folder {req.path!r} is too big for one message", param="path"
            )
        return listing
