"""Ollama's routes that make a served model (`/api/blobs/:digest`, `/api/create`), an admin's: a model made from
uploaded GGUF blobs, a Modelfile's `FROM` or another model, with the PARAMETERs that mean something to serving.

Uploaded blobs live in the model store, `<data>/models/ollama/blobs/sha256-<hex>` (Ollama's own names), so a model
made from one is fetched by a node without the file as any stored model is (`store_path`)."""

from __future__ import annotations

import asyncio
import hashlib
import os
import re
import secrets
import shlex
from pathlib import Path
from typing import Any

import msgspec
from litestar import Request, Response, head, post
from litestar.exceptions import InternalServerException
from litestar.params import FromPath
from litestar.response import Stream

from coderai.catalog.store import ModelStore
from coderai.contracts import GGUF_FAMILIES, ModelConfig
from coderai.contracts.families import EngineFamily
from coderai.contracts.admin import AddModelRequest
from coderai.contracts.subjects import CMD_SCHEDULER_ADD
from coderai.gateway.admin.models import change_model, checked_name
from coderai.gateway.errors import ApiError
from coderai.gateway.http import json_response, read_json
from coderai.gateway.ollama_gguf import facts
from coderai.gateway.ollama_types import NDJSON, line
from coderai.gateway.state import InferenceController

BLOB_DIGEST = re.compile(r"^sha256[:-]([0-9a-f]{64})$")
BLOBS = "ollama/blobs"  # under the model store


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
                raise ApiError(
                    400,
                    f"PARAMETER {key} is not supported by coderai's create (stop, num_ctx and "
                    "num_predict are); sampling options go with each request.",
                    param="parameters",
                    code="unsupported_parameter",
                )
        except (TypeError, ValueError):
            raise ApiError(
                400, f"PARAMETER {key} {value!r} is not a number.", param="parameters", code="invalid_value"
            ) from None
    return msgspec.structs.replace(cfg, stop=list(dict.fromkeys(stop)), params=params, **changes)


class OllamaCreateRoutes(InferenceController):
    """The routes that make a model, inherited by `OllamaModelRoutes` (and so by `OllamaController`, which sets the
    path and Ollama's error shape), with the admin check and the model store every model route uses."""

    def _admin(self, request: Request) -> None:
        if "admin" not in self.caller(request).scopes:
            raise ApiError(403, "Changing the models served needs an admin key.", code="forbidden")

    def _store(self) -> ModelStore:
        return ModelStore(self.gw.settings.data_dir)

    def _blob(self, digest: str) -> Path:
        digest = digest.removeprefix("/")  # a path parameter's leading slash
        m = BLOB_DIGEST.match(digest)
        if m is None:
            raise ApiError(
                400,
                f"invalid digest format {digest[:80]!r}: sha256:<64 lowercase hex digits>",
                param="digest",
                code="invalid_value",
            )
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
                raise ApiError(
                    400,
                    f"digest mismatch: the body's is sha256:{h.hexdigest()}, not {digest}",
                    param="digest",
                    code="digest_mismatch",
                )
            os.replace(part, dest)
        except InternalServerException:  # litestar's "client disconnected prematurely"
            raise ApiError(400, "The upload ended before it was whole.", code="incomplete_body") from None
        finally:
            part.unlink(missing_ok=True)
        return Response(content=b"", status_code=201)

    def _gguf_engine(self) -> EngineFamily:
        """The llama.cpp family a GGUF made here is served by: the one the served GGUF models use when they agree
        (what this cluster's nodes run), else llama-server, as the catalogue's GGUFs are."""
        families: set[EngineFamily] = {m.engine for m in self.gw.catalog.models.values() if m.engine in GGUF_FAMILIES}
        return families.pop() if len(families) == 1 else "llama-server"

    def _from_blobs(self, name: str, digests: list[str]) -> tuple[ModelConfig, list[str]]:
        """A model from uploaded GGUF blobs: the language model, and a projector (mmproj) if one is among them."""
        main, projector, used = None, None, []
        for d in digests:
            path = self._blob(d)
            if not path.is_file():
                raise ApiError(
                    400,
                    f"blob {d} not found: upload it first (POST /api/blobs/{d})",
                    param="files",
                    code="blob_not_found",
                )
            gguf = facts(path)
            if gguf is None:
                raise ApiError(
                    400,
                    f"blob {d} is not a GGUF file: only GGUF models can be created",
                    param="files",
                    code="unsupported_format",
                )
            if gguf.projector:
                projector = projector or path
            else:
                main = main or path
            used.append(f"sha256:{path.name.removeprefix('sha256-')}")
        if main is None:
            raise ApiError(
                400,
                "no GGUF model among the files (a projector alone cannot be served)",
                param="files",
                code="invalid_value",
            )
        store = self._store()
        cfg = ModelConfig(
            name=name,
            engine=self._gguf_engine(),
            path=str(main),
            store_path=str(main.relative_to(store.root)),
            params={"mmproj": str(projector)} if projector else {},
        )
        return cfg, used

    @post("/create", status_code=200)
    async def create(self, request: Request) -> Response | Stream:
        """A new served model (an admin key) from uploaded GGUF blobs (`files`), or `from` (or a Modelfile's
        `FROM`): a blob's digest or a served model's name; `PARAMETER stop/num_ctx/num_predict` apply."""
        self._admin(request)
        req = await read_json(request, CreateRequest, any_type=True)
        name = checked_name((req.model or req.name).strip())
        source, parameters, others = parse_modelfile(req.modelfile) if req.modelfile else ("", [], [])
        unsupported = [
            k
            for k, v in (
                ("quantize", req.quantize),
                ("adapters", req.adapters),
                ("template", req.template),
                ("system", req.system),
                ("messages", req.messages),
            )
            if v
        ] + [w.lower() for w in others if w in ("ADAPTER", "TEMPLATE", "SYSTEM", "MESSAGE")]
        if unsupported:
            raise ApiError(
                400,
                f"{', '.join(sorted(set(unsupported)))} not supported by coderai's create: a model is "
                "served as its GGUF says (its own chat template); a system prompt goes with each "
                "request.",
                param=unsupported[0],
                code="not_supported",
            )
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
            raise ApiError(
                400,
                "neither 'from' nor 'files' given: name the model or uploaded GGUF to create from",
                param="from",
                code="invalid_value",
            )
        cfg = _with_parameters(cfg, [*parameters, *(req.parameters or {}).items()])
        await change_model(self.gw, CMD_SCHEDULER_ADD, AddModelRequest(model=cfg, replace=False), name)
        statuses += [{"status": "writing manifest"}, {"status": "success"}]
        if not req.stream:
            return json_response({"status": "success"})
        return Stream(iter([line(s) for s in statuses]), media_type=NDJSON)
