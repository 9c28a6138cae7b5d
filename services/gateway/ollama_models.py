"""Ollama's model routes (`/api/tags`, `/api/ps`, `/api/show`, `/api/pull`, `/api/copy`, `/api/delete`, `/api/push`),
as routes `OllamaController` inherits: what is served, described from the GGUF where a model is one, and the
admin's ways to change it: a catalogue pull, a copy, a delete. Making a model from uploaded GGUF blobs or a
Modelfile (`/api/blobs/:digest`, `/api/create`) is `ollama_create`'s."""

from __future__ import annotations

import asyncio
import datetime
import hashlib
import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import msgspec
from litestar import Request, Response, delete, get, post
from litestar.response import Stream

from coderai.catalog.store import ModelStore
from coderai.contracts import GGUF_FAMILIES, ModelConfig
from coderai.contracts.admin import AddModelRequest, RemoveModelRequest
from coderai.contracts.ops import kind_of
from coderai.contracts.subjects import CMD_SCHEDULER_ADD, CMD_SCHEDULER_REMOVE
from coderai.gateway.admin.catalog import Pulls
from coderai.gateway.admin.models import change_model, checked_name
from coderai.gateway.copies import Copy
from coderai.gateway.errors import ApiError
from coderai.gateway.http import json_response, read_json
from coderai.gateway.ollama_create import OllamaCreateRoutes
from coderai.gateway.ollama_gguf import Digests, GgufFacts, facts
from coderai.gateway.ollama_pull import layers_of, progress, serve_when_done, spec_for
from coderai.gateway.ollama_types import NDJSON, line, now

FOREVER = datetime.timedelta(
    microseconds=(2**63 - 1) // 1000
)  # Ollama's "never" (its longest duration): `ollama ps` says Forever


class NameRequest(msgspec.Struct, kw_only=True):  # /api/delete, /api/push
    model: str = ""
    name: str = ""  # older clients


class CopyRequest(msgspec.Struct, kw_only=True):
    source: str
    destination: str


class ShowRequest(msgspec.Struct, kw_only=True):
    model: str = ""
    name: str = ""  # older clients
    verbose: bool = False


class PullRequest(msgspec.Struct, kw_only=True):
    model: str = ""
    name: str = ""  # older clients
    stream: bool = True
    insecure: bool = False  # a registry's TLS: the Hub's is always checked


def model_json(m: ModelConfig, gguf: GgufFacts | None = None, digest: str = "") -> dict[str, Any]:
    """One model in `/api/tags` and `/api/ps`: read from its GGUF where it is one on this machine, else coderai's
    name and engine, which is all that is known."""
    if gguf is None:
        return {
            "name": m.name,
            "model": m.name,
            "modified_at": now(),
            "size": 0,
            "digest": hashlib.sha256(m.name.encode()).hexdigest(),
            "details": {
                "format": "gguf" if m.engine in GGUF_FAMILIES else m.engine,
                "family": m.engine,
                "families": [m.engine],
                "parameter_size": "",
                "quantization_level": "",
            },
        }
    modified = datetime.datetime.fromtimestamp(gguf.mtime, datetime.timezone.utc)
    return {
        "name": m.name,
        "model": m.name,
        "modified_at": modified.isoformat().replace("+00:00", "Z"),
        "size": gguf.size,
        "digest": digest or hashlib.sha256(m.name.encode()).hexdigest(),
        "details": {
            "parent_model": "",
            "format": "gguf",
            "family": gguf.architecture,
            "families": [gguf.architecture],
            "parameter_size": gguf.parameter_size,
            "quantization_level": gguf.quantization_level,
        },
    }


def running_json(
    m: ModelConfig, ready: list[Copy], now_: datetime.datetime, described: dict[str, Any] | None = None
) -> dict[str, Any]:
    """One model in `/api/ps`: the memory one copy was placed for (`size`; `size_vram` when it is on a GPU) and when
    the last of its copies may be unloaded, from its keep-alive and how long it has been idle."""

    def expires(c: Copy) -> datetime.datetime:
        keep = m.keep_alive(c.status.keep_alive_s)
        return now_ + (FOREVER if keep is None else datetime.timedelta(seconds=max(0.0, keep - c.status.idle_s)))

    until = max(expires(c) for c in ready)
    return {
        **(described or model_json(m)),
        "size": max(c.status.memory for c in ready),
        "size_vram": max((c.status.memory for c in ready if c.on_gpu), default=0),
        "expires_at": until.isoformat().replace("+00:00", "Z"),
    }


def capabilities(m: ModelConfig, gguf: GgufFacts | None) -> list[str]:
    """What Ollama's clients gate features on: completion, embedding, tools (the chat template handles them),
    vision (a projector is configured), thinking (the template has a thinking switch or block)."""
    caps = {"completion" if kind_of(op) in ("chat", "completion") else kind_of(op) for op in m.serves()}
    template = m.params.get("chat_template")
    if not isinstance(template, str) or not template:
        template = gguf.template if gguf else ""
    if "completion" in caps and "tools" in template:
        caps.add("tools")
    if "completion" in caps and ("enable_thinking" in template or "<think>" in template):
        caps.add("thinking")
    if m.params.get("mmproj"):
        caps.add("vision")
    return sorted(caps)


class OllamaModelRoutes(OllamaCreateRoutes):
    """The model routes of `OllamaController` (which sets the path and Ollama's error shape); those that make a
    model it inherits from `OllamaCreateRoutes`."""

    pulls: Pulls
    _digests = Digests()

    def _gguf(self, m: ModelConfig, store: ModelStore) -> tuple[Path | None, GgufFacts | None]:
        """The model's GGUF on this machine (its `path`, else its file in the model store) and what it says."""
        if m.engine not in GGUF_FAMILIES:
            return None, None
        base = m.param_str("base")  # a fine-tuned model's path is its adapter, served over this GGUF
        where = [base or m.path]
        if m.store_path and not base:
            where.append(
                str(store.root / m.store_path / m.store_file)
                if m.store_path.endswith("/")
                else str(store.root / m.store_path)
            )
        for p in where:
            if p and os.path.isfile(p):
                return Path(p), facts(p)
        return None, None

    async def _described(self, models: list[ModelConfig]) -> dict[str, dict[str, Any]]:
        store = self._store()
        try:
            etags = {str(store.model_path(r)): r.files[r.main].etag for r in store.list() if r.main in r.files}
        except (OSError, msgspec.DecodeError):
            etags = {}

        async def one(m: ModelConfig) -> dict[str, Any]:
            path, gguf = self._gguf(m, store)
            digest = await self._digests.get(path, etags.get(str(path), "")) if path and gguf else ""
            return model_json(m, gguf, digest)

        described = await asyncio.gather(*(one(m) for m in models))  # the hashes still running, together
        return {m.name: d for m, d in zip(models, described)}

    @get("/tags")
    async def list_tags(self, request: Request) -> Response:  # not `tags`: that is a litestar Controller setting
        models = await self.gw.visible_models(self.caller(request))
        described = await self._described(models)
        return json_response({"models": [described[m.name] for m in models]})

    @get("/ps")
    async def ps(self, request: Request) -> Response:
        """Only the models loaded now (a ready copy on a live node), as Ollama lists its running models."""
        copies, now_ = self.gw.copies.by_model(), datetime.datetime.now(datetime.timezone.utc)
        loaded = [
            (m, ready)
            for m in await self.gw.visible_models(self.caller(request))
            if (ready := [c for c in copies.get(m.name, []) if c.status.state == "ready"])
        ]
        described = await self._described([m for m, _ in loaded])
        return json_response({"models": [running_json(m, ready, now_, described[m.name]) for m, ready in loaded]})

    @post("/show", status_code=200)
    async def show(self, request: Request) -> Response:
        req = await read_json(request, ShowRequest, any_type=True)
        cfg = await self.gw.visible_model(self.caller(request), req.model or req.name)
        path, gguf = self._gguf(cfg, self._store())
        info = (await self._described([cfg]))[cfg.name]
        parameters = [f'stop "{s}"' for s in cfg.stop]
        if isinstance(cfg.params.get("n_ctx"), int):
            parameters.append(f"num_ctx {cfg.params['n_ctx']}")
        template = cfg.params.get("chat_template") if isinstance(cfg.params.get("chat_template"), str) else ""
        model_info = dict(gguf.info) if gguf else {"general.architecture": cfg.engine}
        return json_response(
            {
                "modelfile": f"# the models-file entry of {cfg.name}\nFROM {path or cfg.path}\n"
                + "".join(f"PARAMETER {p}\n" for p in parameters),
                "parameters": "\n".join(parameters),
                "template": template or (gguf.template if gguf else ""),
                "details": info["details"],
                "model_info": model_info,
                "capabilities": capabilities(cfg, gguf),
                "modified_at": info["modified_at"],
            }
        )

    @delete("/delete", status_code=200)
    async def delete_model(self, request: Request) -> Response:
        """Stop serving a model (an admin key: it is the cluster's, not the caller's); its files stay."""
        self._admin(request)
        req = await read_json(request, NameRequest, any_type=True)
        await change_model(
            self.gw, CMD_SCHEDULER_REMOVE, RemoveModelRequest(name=req.model or req.name), req.model or req.name
        )
        return Response(content=b"", status_code=200)

    @post("/copy", status_code=200)
    async def copy(self, request: Request) -> Response:
        """Serve a model again under another name (an admin key), as its models-file entry with the new name."""
        self._admin(request)
        req = await read_json(request, CopyRequest, any_type=True)
        cfg = await self.gw.visible_model(self.caller(request), req.source)
        new = msgspec.structs.replace(cfg, name=checked_name(req.destination))
        await change_model(self.gw, CMD_SCHEDULER_ADD, AddModelRequest(model=new, replace=False), new.name)
        return Response(content=b"", status_code=200)

    @post("/push", status_code=200)
    async def push(self, request: Request) -> Response:
        raise ApiError(
            501,
            "Pushing models to a registry is not supported by coderai: its models come from its "
            "models file and catalogue (POST /admin/models/pull).",
            code="not_supported",
        )

    @post("/pull", status_code=200)
    async def pull(self, request: Request) -> Response | Stream:
        """A catalogue pull (an admin key), its progress streamed as Ollama's; the model is served when whole."""
        self._admin(request)
        req = await read_json(request, PullRequest, any_type=True)
        if not (req.model or req.name).strip():
            raise ApiError(400, "model is required", param="model", code="invalid_value")
        jobs = self.pulls.jobs()
        spec, name = spec_for(req.model or req.name, jobs)
        layers = await layers_of(spec, name)
        job = jobs.start(spec, name)
        serving = serve_when_done(self.gw, jobs, job.id)
        if not req.stream:
            await asyncio.shield(serving)
            return json_response({"status": "success"})

        async def lines() -> AsyncIterator[bytes]:
            async for obj in progress(jobs, job.id, layers, serving):
                yield line(obj)

        return Stream(lines(), media_type=NDJSON)
