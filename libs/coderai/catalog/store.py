"""The model store under the data dir: `<data>/models/<repo>/<file>`, and an index of what was pulled.

The index (`<data>/models/catalog.json`) maps a model name to its repo, files (with the etag each was checked
against), engine, kind, params and memory estimate; it is rewritten atomically under a lock file, so a CLI pull
and a gateway pull job may run side by side.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec

from coderai.catalog.errors import NotFound

MB = 1 << 20
INDEX = "catalog.json"


class FileRecord(msgspec.Struct, frozen=True, kw_only=True):
    size: int
    etag: str  # the Hub's: sha256 for LFS files, the git blob sha1 otherwise


class Pulled(msgspec.Struct, frozen=True, kw_only=True):
    """One pulled model, as the index keeps it."""

    name: str
    repo: str
    revision: str
    commit: str = ""
    files: dict[str, FileRecord] = {}
    main: str = ""  # the file `path` points at; "" = the repo folder
    engine: str = ""
    kind: str = ""
    params: dict[str, Any] = {}
    memory_mb: int = 0
    pulled_at: float = 0.0

    @property
    def size(self) -> int:
        return sum(f.size for f in self.files.values())


class ModelStore:
    """Pulled models under `<data_dir>/models`, or under `root` (a pod's network volume, shared by its pods)."""

    def __init__(self, data_dir: str | os.PathLike[str], root: str | os.PathLike[str] = "") -> None:
        self.data = Path(os.path.expanduser(str(data_dir))).resolve()
        self.root = Path(os.path.expanduser(str(root))).resolve() if root else self.data / "models"

    def repo_dir(self, repo: str) -> Path:
        return self.root / repo

    def file_path(self, repo: str, file: str) -> Path:
        return self.root / repo / file

    def partial_path(self, repo: str, file: str, etag: str) -> Path:
        """Where a download grows; named by etag so a new upstream version never resumes an old one."""
        p = self.file_path(repo, file)
        return p.with_name(f".{p.name}.{etag[:16]}.incomplete")

    def model_path(self, rec: Pulled) -> Path:
        """What a ModelConfig's `path` should be: the main file, or the repo folder."""
        return self.file_path(rec.repo, rec.main) if rec.main else self.repo_dir(rec.repo)

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        self.root.mkdir(parents=True, exist_ok=True)
        with open(self.root / f"{INDEX}.lock", "a") as fh:
            fcntl.flock(fh, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(fh, fcntl.LOCK_UN)

    def _read(self) -> dict[str, Pulled]:
        try:
            raw = (self.root / INDEX).read_bytes()
        except FileNotFoundError:
            return {}
        return msgspec.json.decode(raw, type=dict[str, Pulled])

    def _write(self, index: dict[str, Pulled]) -> None:
        tmp = self.root / f".{INDEX}.{os.getpid()}.tmp"
        tmp.write_bytes(msgspec.json.format(msgspec.json.encode(index)))
        os.replace(tmp, self.root / INDEX)

    def list(self) -> list[Pulled]:
        """Every pulled model, by name."""
        with self._locked():
            return sorted(self._read().values(), key=lambda r: r.name)

    def get(self, name: str) -> Pulled:
        """The model called `name` (or pulled from the repo, or `repo:file`, `name` says); NotFound otherwise."""
        index = self.list()
        for rec in index:
            if name in (rec.name, rec.repo, f"{rec.repo}:{rec.main}"):
                return rec
        raise NotFound(f"no pulled model {name!r} in {self.root} (have: {', '.join(r.name for r in index) or 'none'})")

    def add(self, rec: Pulled) -> Pulled:
        """Record a finished pull (replacing one of the same name)."""
        rec = msgspec.structs.replace(rec, pulled_at=rec.pulled_at or time.time())
        with self._locked():
            index = self._read()
            index[rec.name] = rec
            self._write(index)
        return rec

    def remove(self, name: str) -> Pulled:
        """Forget `name` and delete its files (files another pulled model shares stay)."""
        rec = self.get(name)
        with self._locked():
            index = self._read()
            index.pop(rec.name, None)
            self._write(index)
        shared = {(r.repo, f) for r in index.values() for f in r.files}
        for f in rec.files:
            if (rec.repo, f) not in shared:
                self.file_path(rec.repo, f).unlink(missing_ok=True)
        repo_dir = self.repo_dir(rec.repo)
        if repo_dir.is_dir() and not any(r.repo == rec.repo for r in index.values()):
            shutil.rmtree(repo_dir, ignore_errors=True)
        for parent in (repo_dir.parent,):  # an owner folder left empty
            with contextlib.suppress(OSError):
                parent.rmdir()
        return rec


def estimate_bytes(rec: Pulled) -> int:
    """What one loaded copy needs: the catalogue's figure, else the scheduler's rule (size x 1.2 + 256 MB)."""
    from coderai.contracts import ModelConfig
    from coderai.sizing import estimate_bytes as placement_estimate

    cfg = ModelConfig(name=rec.name, engine="echo", path="", memory_mb=rec.memory_mb)
    return placement_estimate(cfg, rec.size)


def fits(model_bytes: int, nodes: list[Any]) -> list[dict[str, Any]]:
    """For each node (a Heartbeat, a NodeInfo, or their JSON as `GET /admin/nodes` gives it): its id, what it
    offers (the scheduler's `capacity`), what is free now, and whether `model_bytes` fits in each."""
    from coderai.contracts import Heartbeat
    from coderai.sizing import UNKNOWN_CAPACITY, capacity

    out = []
    for n in nodes:
        hb = getattr(n, "heartbeat", n)
        if isinstance(hb, dict):
            hb = msgspec.convert(hb.get("heartbeat", hb), Heartbeat)
        cap = capacity(hb)
        free = hb.vram_free if hb.vram_total else hb.mem_free
        known = cap != UNKNOWN_CAPACITY
        out.append(
            {
                "node": hb.node_id,
                "capacity_mb": cap // MB if known else None,
                "free_mb": free // MB if known else None,
                "fits": cap >= model_bytes,
                "fits_now": (free >= model_bytes) if known else True,
            }
        )
    return out
