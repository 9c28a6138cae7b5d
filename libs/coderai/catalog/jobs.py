"""Background pull jobs whose state lives in files (`<data>/models/.jobs/<id>.json`), so any process sharing the
data dir (every gateway worker, the CLI) can read a job's progress and ask it to stop.

A job runs `pull` in a thread of the process that started it; it rewrites its file on every progress report
(at most ~10 a second) and keeps a short event log of state changes. Cancel drops a `<id>.cancel` marker the
running pull notices at its next chunk.
"""

from __future__ import annotations

import os
import secrets
import threading
import time
from pathlib import Path
from typing import Any

import msgspec

from coderai.catalog.errors import CatalogError, NotFound
from coderai.catalog.pull import Progress, pull
from coderai.catalog.store import ModelStore


class Job(msgspec.Struct, kw_only=True):
    """A pull job as `GET /admin/models/pull/{id}` shows it. `state`: running, done, failed, cancelled."""

    id: str
    spec: str
    name: str = ""
    state: str = "running"
    progress: Progress | None = None
    events: list[dict[str, Any]] = []
    error: str = ""
    model: dict[str, Any] | None = None
    pid: int = 0
    created: float = 0.0
    updated: float = 0.0


class PullJobs:
    """Start, read and cancel pull jobs for one model store."""

    def __init__(self, store: ModelStore, endpoint: str | None = None) -> None:
        self.store = store
        self.endpoint = endpoint
        self.dir = store.root / ".jobs"

    def _path(self, job_id: str, suffix: str = ".json") -> Path:
        if not job_id.isalnum():
            raise NotFound(f"no pull job {job_id!r}")
        return self.dir / f"{job_id}{suffix}"

    def _save(self, job: Job) -> None:
        job.updated = time.time()
        tmp = self._path(job.id, f".{threading.get_ident()}.tmp")
        tmp.write_bytes(msgspec.json.encode(job))
        os.replace(tmp, self._path(job.id))

    def get(self, job_id: str) -> Job:
        """The job's last saved state; NotFound when there is none."""
        try:
            job = msgspec.json.decode(self._path(job_id).read_bytes(), type=Job)
        except FileNotFoundError:
            raise NotFound(f"no pull job {job_id!r}") from None
        if job.state == "running" and not _alive(job.pid):  # its process died: pull again to resume
            job.state, job.error = "interrupted", f"the process running it (pid {job.pid}) is gone"
        return job

    def list(self) -> list[Job]:
        """Every job this store remembers, newest first."""
        jobs = []
        for p in self.dir.glob("*.json") if self.dir.is_dir() else []:
            try:
                jobs.append(self.get(p.stem))
            except (NotFound, msgspec.DecodeError):
                continue
        return sorted(jobs, key=lambda j: j.created, reverse=True)

    def start(self, spec: str, name: str = "") -> Job:
        """Start pulling `spec` in a background thread; a job already running for the same spec is returned
        instead of a second download of the same files."""
        from coderai.catalog.entries import resolve

        entry = resolve(spec, name)  # a malformed spec fails here, before any job exists
        for j in self.list():
            if j.state == "running" and j.spec == spec and j.name == entry.name and _alive(j.pid):
                return j
        self.dir.mkdir(parents=True, exist_ok=True)
        now = time.time()
        job = Job(
            id=secrets.token_hex(8),
            spec=spec,
            name=entry.name,
            pid=os.getpid(),
            created=now,
            events=[{"ts": now, "state": "queued"}],
            progress=Progress(name=entry.name),
        )
        self._save(job)
        threading.Thread(target=self._run, args=(job,), name=f"pull-{job.id}", daemon=True).start()
        return job

    def cancel(self, job_id: str) -> Job:
        """Ask a running job to stop (it keeps what it downloaded, for a resume)."""
        job = self.get(job_id)
        if job.state == "running":
            self._path(job_id, ".cancel").touch()
        return job

    def _run(self, job: Job) -> None:
        cancel = threading.Event()
        marker = self._path(job.id, ".cancel")
        last_state = ""

        def report(p: Progress) -> None:
            nonlocal last_state
            if marker.exists():
                cancel.set()
            job.progress = p
            if p.state != last_state:
                last_state = p.state
                job.events.append({"ts": time.time(), "state": p.state, "file": p.file, "bytes_done": p.bytes_done})
            self._save(job)

        try:
            rec = pull(job.spec, self.store, report, name=job.name, endpoint=self.endpoint, cancel=cancel)
            job.model = {
                "name": rec.name,
                "repo": rec.repo,
                "engine": rec.engine,
                "kind": rec.kind,
                "path": str(self.store.model_path(rec)),
                "size": rec.size,
            }
            job.state = "done"
        except CatalogError as exc:
            job.state = "cancelled" if cancel.is_set() else "failed"
            job.error = str(exc)
        except Exception as exc:  # a background thread: the job file is the only place to tell
            job.state, job.error = "failed", f"{type(exc).__name__}: {exc}"
        job.events.append({"ts": time.time(), "state": job.state})
        self._save(job)
        marker.unlink(missing_ok=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except OSError:
        return False
    return True
