"""`/api/pull` on the catalogue: a name (a catalogue name, `<owner>/<repo>[:<file>]`, or a model pulled before) is
planned (the Hub's file list and sizes: an unknown one is Ollama's "file does not exist" before anything starts),
pulled as a catalogue job (`/admin/models/pull` lists it), its progress streamed as Ollama's lines, and served
when it is whole.

The job and the step that serves the model run apart from the request: a client that goes away stops reading the
progress, not the pull."""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import msgspec

from coderai.catalog.entries import BUILTIN, resolve
from coderai.catalog.errors import CatalogError, NotFound, Unreachable
from coderai.catalog.jobs import Job, PullJobs
from coderai.catalog.place import model_entry
from coderai.catalog.pull import SHA1, SHA256, plan
from coderai.contracts import ModelConfig
from coderai.contracts.admin import AddModelRequest
from coderai.contracts.subjects import CMD_SCHEDULER_ADD
from coderai.gateway.admin.models import change_model, checked_name
from coderai.gateway.errors import ApiError
from coderai.gateway.state import Gateway

NOT_FOUND = "pull model manifest: file does not exist"  # Ollama's words for a name its registry lacks
POLL_S = 0.1  # the job runs in a thread and reports through its file: how often it is read


@dataclass(frozen=True)
class Layer:
    """One file of a pull as Ollama calls it: a layer, by digest, with its size and where its bytes start among the
    pull's (the job counts bytes over all its files, in this order)."""

    file: str
    digest: str
    size: int
    start: int


def spec_for(name: str, jobs: PullJobs) -> tuple[str, str]:
    """(spec, name) to pull for what the client named: a model pulled before is pulled again from where it came
    (Open WebUI's "Update All" pulls every listed model by its name); anything else is a spec as it is."""
    name = name.strip().removesuffix(":latest")
    if name in BUILTIN:
        return name, ""
    try:
        rec = jobs.store.get(name)
    except (NotFound, msgspec.DecodeError):
        return name, ""
    return (f"{rec.repo}:{rec.main}" if rec.main else rec.repo), rec.name


async def layers_of(spec: str, name: str) -> list[Layer]:
    """The files a pull of `spec` takes (asks the Hub; nothing is downloaded), as layers; an ApiError in Ollama's
    words when the name is unknown (404), the Hub out of reach (502) or the spec unusable (400)."""
    try:
        entry = resolve(spec, name)
        metas = await asyncio.to_thread(
            plan, entry, os.environ.get("HF_ENDPOINT") or None, os.environ.get("HF_TOKEN") or None
        )
    except NotFound:
        raise ApiError(404, NOT_FOUND, code="model_not_found") from None
    except Unreachable as exc:
        raise ApiError(502, f"pull model manifest: {exc}", type="service_unavailable", code="hub_unreachable") from None
    except CatalogError as exc:
        if not ("/" in spec or spec in BUILTIN):  # neither a catalogue name nor a repo: unknown, as Ollama says
            raise ApiError(404, NOT_FOUND, code="model_not_found") from None
        raise ApiError(400, f"pull model manifest: {exc}", code="invalid_spec") from None
    out, start = [], 0
    for f, (_url, meta) in metas.items():
        etag, size = (meta.etag or "").lower(), meta.size or 0
        digest = f"sha256:{etag}" if SHA256.match(etag) else f"sha1:{etag}" if SHA1.match(etag) else f"file:{f}"
        out.append(Layer(file=f, digest=digest, size=size, start=start))
        start += size
    return out


async def _wait(jobs: PullJobs, job_id: str) -> Job:
    while (job := jobs.get(job_id)).state == "running":
        await asyncio.sleep(POLL_S)
    return job


async def _serve(gw: Gateway, jobs: PullJobs, job_id: str) -> ModelConfig:
    """Wait for the job, then serve what it pulled (as `coderai models pull --place` would); a model of that name
    served already stays as it is (a pull again updates its files, not its entry)."""
    job = await _wait(jobs, job_id)
    if job.state != "done":
        raise ApiError(502, f"pull model: {job.error or job.state}", type="service_unavailable", code="pull_failed")
    try:
        cfg = msgspec.convert(model_entry(jobs.store.get(job.name), jobs.store), ModelConfig)
    except (CatalogError, msgspec.ValidationError) as exc:
        raise ApiError(502, f"pull model: {exc}", type="service_unavailable", code="pull_failed") from None
    try:
        await change_model(gw, CMD_SCHEDULER_ADD, AddModelRequest(model=cfg, replace=False), checked_name(cfg.name))
    except ApiError as exc:
        if exc.status != 409:
            raise
    return cfg


_SERVING: dict[str, asyncio.Task[ModelConfig]] = {}  # job id -> the task that serves its model: one per job


def serve_when_done(gw: Gateway, jobs: PullJobs, job_id: str) -> asyncio.Task[ModelConfig]:
    """The task that serves the job's model once pulled, started once per job (two pulls of one name share the
    job and this task); it runs on whether or not anyone reads its progress."""
    task = _SERVING.get(job_id)
    if task is None:
        task = _SERVING[job_id] = asyncio.ensure_future(_serve(gw, jobs, job_id))
        task.add_done_callback(lambda t: (_SERVING.pop(job_id, None), t.cancelled() or t.exception()))
    return task


def _layer_line(layer: Layer, completed: int) -> dict[str, Any]:
    return {
        "status": f"pulling {layer.digest.partition(':')[2][:12]}",
        "digest": layer.digest,
        "total": layer.size,
        "completed": completed,
    }


async def progress(
    jobs: PullJobs, job_id: str, layers: list[Layer], serving: asyncio.Task[ModelConfig]
) -> AsyncIterator[dict[str, Any]]:
    """Ollama's pull lines: `pulling manifest`, each layer's bytes as they arrive, `verifying sha256 digest`,
    `writing manifest`, `success`; a failure is a last `{"error": ...}`."""
    yield {"status": "pulling manifest"}
    files = {layer.file: i for i, layer in enumerate(layers)}
    sent: dict[int, int] = {}
    while True:
        job = jobs.get(job_id)
        p = job.progress
        if p is not None and p.state in ("downloading", "verifying", "done") and layers:
            current = len(layers) if job.state == "done" else files.get(p.file, 0)
            for i, layer in enumerate(layers[: current + 1]):
                done = layer.size if i < current else min(max(p.bytes_done - layer.start, 0), layer.size)
                if sent.get(i) != done:
                    sent[i] = done
                    yield _layer_line(layer, done)
        if job.state != "running":
            break
        await asyncio.sleep(POLL_S)
    try:
        await asyncio.shield(serving)
    except ApiError as exc:
        yield {"error": exc.message}
        return
    yield {"status": "verifying sha256 digest"}
    yield {"status": "writing manifest"}
    yield {"status": "success"}
