"""Files of the head's model store, fetched by nodes over the bus (`coderai.cmd.store.fetch`; a folder's files are
listed first with `coderai.cmd.store.list`), and the one rule for what a store path may look like. No I/O here."""

from __future__ import annotations

from coderai.contracts.base import Message

CHUNK_BYTES = 512 * 1024  # base64 in JSON makes this ~700 KB: under NATS' default 1 MB max payload


class StoreFetch(Message, frozen=True, kw_only=True):
    """Read `length` bytes at `offset` of the file at `path` (relative to the head's model store). `length=0`
    asks only for the file's size and sha256."""

    path: str
    offset: int = 0
    length: int = CHUNK_BYTES


class StoreChunk(Message, frozen=True, kw_only=True, tag="store.chunk", tag_field="t"):
    """Bytes of a store file; `size` and `sha256` are the whole file's, sent with every chunk, so a reader sees at
    once when the file changed under it."""

    data: bytes = b""
    size: int
    sha256: str


class StoreList(Message, frozen=True, kw_only=True):
    """List the files of the folder at `path` (relative to the head's model store), at any depth: what a node
    fetches, file by file with `StoreFetch`, for a model that is a folder."""

    path: str


class StoreEntry(Message, frozen=True, kw_only=True):
    """One file of a listed folder: `path` relative to that folder, its size and sha256."""

    path: str
    size: int
    sha256: str


class StoreListing(Message, frozen=True, kw_only=True, tag="store.listing", tag_field="t"):
    """The regular files of a store folder (no hidden files, nothing whose real path leaves the store), sorted."""

    files: list[StoreEntry] = []


MAX_LIST_FILES = 4096  # more is no model folder; ~150 bytes an entry, so a listing fits NATS' 1 MB max payload
MAX_LIST_BYTES = 900 * 1024  # and a listing of very long names that would not is refused, not lost on the wire


def check_store_path(path: str) -> str:
    """`path` if it is a plain relative path inside a store (no absolute path, no `..`, no empty or hidden parts,
    no backslashes); ValueError otherwise."""
    if not path or path.startswith("/") or "\\" in path or "\x00" in path:
        raise ValueError(f"store path {path!r} must be relative")
    for part in path.split("/"):
        if not part or part in (".", "..") or part.startswith("."):
            raise ValueError(f"store path {path!r} may not hold empty, '.', '..' or hidden parts")
    return path
