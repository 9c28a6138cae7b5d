"""Ollama's model routes (`/api/tags`, `/api/ps`, `/api/show`, `/api/pull`, `/api/create`, `/api/blobs/:digest`,
`/api/copy`, `/api/delete`, `/api/push`), as routes `OllamaController` inherits: what is served, described from
the GGUF where a model is one, and the admin's ways to change it: a catalogue pull, a model made from an uploaded
GGUF, a Modelfile's `FROM` or another model.

Uploaded blobs live in the model store, `<data>/models/ollama/blobs/sha256-<hex>` (Ollama's own names), so a model
made from one is fetched by a node without the file as any stored model is (`store_path`)."""

from __future__ import annotations

import asyncio
import datetime
import hashlib
import os
import re
import secrets
import shlex
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import msgspec
from litestar import Request, Response, delete, get, head, post
from litestar.exceptions import InternalServerException
from litestar.params import FromPath
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
from coderai.gateway.ollama_gguf import Digests, GgufFacts, facts
from coderai.gateway.ollama_pull import layers_of, progress, serve_when_done, spec_for
from coderai.gateway.state import InferenceController

NDJSON = "application/x-ndjson"
FOREVER = datetime.timedelta(microseconds=(2**63 - 1) // 1000)  # Ollama's "never" (its longest duration): `ollama ps` says Forever
BLOB_DIGEST = re.compile(r"^sha256[:-]([0-9a-f]{64})$")
BLOBS = "ollama/blobs"  # under the model store


def now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat().replace("+00:00", "Z")


def line(obj: dict[str, Any]) -> bytes:
    return msgspec.json.encode(obj) + b"\n"


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


class CreateRequest(msgspec.Struct, kw_only=True):
    model: str = ""
    name: str = ""  # older clients
    from_: str = msgspec.field(default="", name="from")
    files: dict[str, str] | None = None
    modelfile: str = ""  # older clients send the Modelfile's text
    parameters: dict[str, Any] | None = None
    stream: bool = True
    quantize: str | None = None
    adapters: dict[str, str] | None = None
    template: str | None = None
    system: str | None = None
    messages: list[Any] | None = None
    license: Any = None  # kept by Ollama as a layer; nothing to do with serving


def model_json(m: ModelConfig, gguf: GgufFacts | None = None, digest: str = "") -> dict[str, Any]:
    """One model in `/api/tags` and `/api/ps`: read from its GGUF where it is one on this machine, else coderai's
    name and engine, which is all that is known."""
    if gguf is None:
        return {"name": m.name, "model": m.name, "modified_at": now(), "size": 0,
                "digest": hashlib.sha256(m.name.encode()).hexdigest(),
                "details": {"format": "gguf" if m.engine in GGUF_FAMILIES else m.engine, "family": m.engine,
                            "families": [m.engine], "parameter_size": "", "quantization_level": ""}}
    modified = datetime.datetime.fromtimestamp(gguf.mtime, datetime.timezone.utc)
    return {"name": m.name, "model": m.name, "modified_at": modified.isoformat().replace("+00:00", "Z"),
            "size": gguf.size, "digest": digest or hashlib.sha256(m.name.encode()).hexdigest(),
            "details": {"parent_model": "", "format": "gguf", "family": gguf.architecture,
                        "families": [gguf.architecture], "parameter_size": gguf.parameter_size,
                        "quantization_level": gguf.quantization_level}}


def running_json(m: ModelConfig, ready: list[Copy], now_: datetime.datetime,
                 described: dict[str, Any] | None = None) -> dict[str, Any]:
    """One model in `/api/ps`: the memory one copy was placed for (`size`; `size_vram` when it is on a GPU) and when
    the last of its copies may be unloaded, from its keep-alive and how long it has been idle."""

    def expires(c: Copy) -> datetime.datetime:
        keep = m.keep_alive(c.status.keep_alive_s)
        return now_ + (FOREVER if keep is None else datetime.timedelta(seconds=max(0.0, keep - c.status.idle_s)))

    until = max(expires(c) for c in ready)
    return {**(described or model_json(m)), "size": max(c.status.memory for c in ready),
            "size_vram": max((c.status.memory for c in ready if c.on_gpu), default=0),
            "expires_at": until.isoformat().replace("+00:00", "Z")}


def capabilities(m: ModelConfig, gguf: GgufFacts | None) -> list[str]:
    """What Ollama's clients gate features on: completion, embedding, tools (the chat template handles them),
    vision (a projector is configured), thinking (the template has a thinking switch or block)."""
    caps = {"completion" if kind_of(op) in ("chat", "completion") else kind_of(op) for op in m.serves()}
    template = m.params.get("chat_template") if isinstance(m.params.get("chat_template"), str) else ""
    template = template or (gguf.template if gguf else "")
    if "completion" in caps and "tools" in template:
        caps.add("tools")
    if "completion" in caps and ("enable_thinking" in template or "<think>" in template):
        caps.add("thinking")
    if m.params.get("mmproj"):
        caps.add("vision")
    return sorted(caps)


def parse_modelfile(text: str) -> tuple[str, list[tuple[str, str]], list[str]]:
    """A Modelfile's `FROM`, its `PARAMETER`s (name, value) and the other instructions it holds (by name)."""
    source, parameters, others = "", [], []
    lines = iter(text.splitlines())
    for raw in lines:
        text_ = raw.strip()
        if not text_ or text_.startswith("#"):
            continue
        word, _, rest = text_.partition(" ")
        word, rest = word.upper(), rest.strip()
        if rest.startswith('"""') and not (len(rest) > 5 and rest.endswith('"""')):  # a block over several lines
            for more in lines:
                if more.rstrip().endswith('"""'):
                    break
        if word == "FROM":
            source = rest
        elif word == "PARAMETER":
            key, _, value = rest.partition(" ")
            parameters.append((key.strip(), _unquote(value.strip())))
        else:
            others.append(word)
    return source, parameters, others


def _unquote(value: str) -> str:
    try:
        parts = shlex.split(value)
    except ValueError:
        return value
    return parts[0] if len(parts) == 1 else value


def _with_parameters(cfg: ModelConfig, parameters: list[tuple[str, Any]]) -> ModelConfig:
    """`cfg` with Ollama's PARAMETERs that mean something to serving: `stop` (each one), `num_ctx` (the context),
    `num_predict` (the default output length). Sampling defaults have no place in a models-file entry: a 400."""
    stop, params, changes = list(cfg.stop), dict(cfg.params), {}
    for key, value in parameters:
        try:
            if key == "stop":
                stop += [str(v) for v in value] if isinstance(value, list) else [str(value)]
            elif key == "num_ctx":
                params["n_ctx"] = int(value)
            elif key == "num_predict":
                changes["default_output_tokens"] = max(0, int(value))
            else:
                raise ApiError(400, f"PARAMETER {key} is not supported by coderai's create (stop, num_ctx and "
                                    "num_predict are); sampling options go with each request.",
                               param="parameters", code="unsupported_parameter")
        except (TypeError, ValueError):
            raise ApiError(400, f"PARAMETER {key} {value!r} is not a number.", param="parameters",
                           code="invalid_value") from None
    return msgspec.structs.replace(cfg, stop=list(dict.fromkeys(stop)), params=params, **changes)


class OllamaModelRoutes(InferenceController):
    """The model routes of `OllamaController` (which sets the path and Ollama's error shape)."""

    pulls: Pulls
    _digests = Digests()

    def _admin(self, request: Request) -> None:
        if "admin" not in self.caller(request).scopes:
            raise ApiError(403, "Changing the models served needs an admin key.", code="forbidden")

    def _store(self) -> ModelStore:
        return ModelStore(self.gw.settings.data_dir)

    def _gguf(self, m: ModelConfig, store: ModelStore) -> tuple[Path | None, GgufFacts | None]:
        """The model's GGUF on this machine (its `path`, else its file in the model store) and what it says."""
        if m.engine not in GGUF_FAMILIES:
            return None, None
        where = [m.path]
        if m.store_path:
            where.append(str(store.root / m.store_path / m.store_file) if m.store_path.endswith("/")
                         else str(store.root / m.store_path))
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
        loaded = [(m, ready) for m in await self.gw.visible_models(self.caller(request))
                  if (ready := [c for c in copies.get(m.name, []) if c.status.state == "ready"])]
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
        return json_response({
            "modelfile": f"# the models-file entry of {cfg.name}\nFROM {path or cfg.path}\n"
                         + "".join(f"PARAMETER {p}\n" for p in parameters),
            "parameters": "\n".join(parameters), "template": template or (gguf.template if gguf else ""),
            "details": info["details"], "model_info": model_info, "capabilities": capabilities(cfg, gguf),
            "modified_at": info["modified_at"]})

    @delete("/delete", status_code=200)
    async def delete_model(self, request: Request) -> Response:
        """Stop serving a model (an admin key: it is the cluster's, not the caller's); its files stay."""
        self._admin(request)
        req = await read_json(request, NameRequest, any_type=True)
        await change_model(self.gw, CMD_SCHEDULER_REMOVE, RemoveModelRequest(name=req.model or req.name),
                           req.model or req.name)
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
        raise ApiError(501, "Pushing models to a registry is not supported by coderai: its models come from its "
                            "models file and catalogue (POST /admin/models/pull).", code="not_supported")

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

    def _blob(self, digest: str) -> Path:
        digest = digest.removeprefix("/")  # a path parameter's leading slash
        m = BLOB_DIGEST.match(digest)
        if m is None:
            raise ApiError(400, f"invalid digest format {digest[:80]!r}: sha256:<64 lowercase hex digits>",
                           param="digest", code="invalid_value")
        return self._store().root / BLOBS / f"sha256-{m.group(1)}"

    @head("/blobs/{digest:path}")  # a path: a digest holding "/" is refused here (400), not left to the router
    async def has_blob(self, request: Request, digest: FromPath[str]) -> Response[None]:
        """200 when the blob is here (an upload may be skipped), 404 when not."""
        self._admin(request)
        return Response(content=None, status_code=200 if self._blob(digest).is_file() else 404)

    @post("/blobs/{digest:path}", status_code=201, request_max_body_size=None)
    async def upload_blob(self, request: Request, digest: FromPath[str]) -> Response:
        """The body is the file: written to disk as it comes, hashed on the way, kept only if its sha256 is the
        one its name says (400 and nothing kept otherwise). 200 without reading it when the blob is here."""
        self._admin(request)
        dest = self._blob(digest)
        if dest.is_file():
            return Response(content=b"", status_code=200)
        dest.parent.mkdir(parents=True, exist_ok=True)
        part = dest.with_name(f".{dest.name}.{secrets.token_hex(4)}.part")
        h, pending = hashlib.sha256(), bytearray()
        try:
            with open(part, "wb") as fh:

                def flush(data: bytes) -> None:
                    h.update(data)
                    fh.write(data)

                async for chunk in request.stream():
                    pending += chunk
                    if len(pending) >= 1 << 20:
                        await asyncio.to_thread(flush, bytes(pending))
                        pending.clear()
                await asyncio.to_thread(flush, bytes(pending))
            if h.hexdigest() != dest.name.removeprefix("sha256-"):
                raise ApiError(400, f"digest mismatch: the body's is sha256:{h.hexdigest()}, not {digest}",
                               param="digest", code="digest_mismatch")
            os.replace(part, dest)
        except InternalServerException:  # litestar's "client disconnected prematurely"
            raise ApiError(400, "The upload ended before it was whole.", code="incomplete_body") from None
        finally:
            part.unlink(missing_ok=True)
        return Response(content=b"", status_code=201)

    def _gguf_engine(self) -> str:
        """The llama.cpp family a GGUF made here is served by: the one the served GGUF models use when they agree
        (what this cluster's nodes run), else llama-server, as the catalogue's GGUFs are."""
        families = {m.engine for m in self.gw.catalog.models.values() if m.engine in GGUF_FAMILIES}
        return families.pop() if len(families) == 1 else "llama-server"

    def _from_blobs(self, name: str, digests: list[str]) -> tuple[ModelConfig, list[str]]:
        """A model from uploaded GGUF blobs: the language model, and a projector (mmproj) if one is among them."""
        main, projector, used = None, None, []
        for d in digests:
            path = self._blob(d)
            if not path.is_file():
                raise ApiError(400, f"blob {d} not found: upload it first (POST /api/blobs/{d})", param="files",
                               code="blob_not_found")
            gguf = facts(path)
            if gguf is None:
                raise ApiError(400, f"blob {d} is not a GGUF file: only GGUF models can be created",
                               param="files", code="unsupported_format")
            if gguf.projector:
                projector = projector or path
            else:
                main = main or path
            used.append(f"sha256:{path.name.removeprefix('sha256-')}")
        if main is None:
            raise ApiError(400, "no GGUF model among the files (a projector alone cannot be served)", param="files",
                           code="invalid_value")
        store = self._store()
        cfg = ModelConfig(name=name, engine=self._gguf_engine(), path=str(main),  # type: ignore[arg-type]  # a str of GGUF_FAMILIES
                          store_path=str(main.relative_to(store.root)),
                          params={"mmproj": str(projector)} if projector else {})
        return cfg, used

    @post("/create", status_code=200)
    async def create(self, request: Request) -> Response | Stream:
        """A new served model (an admin key) from uploaded GGUF blobs (`files`), or `from` (or a Modelfile's
        `FROM`): a blob's digest or a served model's name; `PARAMETER stop/num_ctx/num_predict` apply."""
        self._admin(request)
        req = await read_json(request, CreateRequest, any_type=True)
        name = checked_name((req.model or req.name).strip())
        source, parameters, others = parse_modelfile(req.modelfile) if req.modelfile else ("", [], [])
        unsupported = [k for k, v in (("quantize", req.quantize), ("adapters", req.adapters),
                                      ("template", req.template), ("system", req.system),
                                      ("messages", req.messages)) if v] + [
            w.lower() for w in others if w in ("ADAPTER", "TEMPLATE", "SYSTEM", "MESSAGE")]
        if unsupported:
            raise ApiError(400, f"{', '.join(sorted(set(unsupported)))} not supported by coderai's create: a model is "
                                "served as its GGUF says (its own chat template); a system prompt goes with each "
                                "request.", param=unsupported[0], code="not_supported")
        source = req.from_ or source
        ggufs = list((req.files or {}).values())
        if not ggufs and BLOB_DIGEST.match(source.removeprefix("@")):
            ggufs = [source.removeprefix("@")]
        statuses = []
        if ggufs:
            cfg, used = self._from_blobs(name, ggufs)
            statuses = [{"status": "parsing GGUF"}] + [{"status": f"using existing layer {d}"} for d in used]
        elif source:
            base = await self.gw.visible_model(self.caller(request), source.removesuffix(":latest"))
            cfg = msgspec.structs.replace(base, name=name)
        else:
            raise ApiError(400, "neither 'from' nor 'files' given: name the model or uploaded GGUF to create from",
                           param="from", code="invalid_value")
        cfg = _with_parameters(cfg, [*parameters, *(req.parameters or {}).items()])
        await change_model(self.gw, CMD_SCHEDULER_ADD, AddModelRequest(model=cfg, replace=False), name)
        statuses += [{"status": "writing manifest"}, {"status": "success"}]
        if not req.stream:
            return json_response({"status": "success"})
        return Stream(iter([line(s) for s in statuses]), media_type=NDJSON)
