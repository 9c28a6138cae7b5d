"""Admin HTTP for the model catalogue (admin-scoped keys only): start a pull, watch it, cancel it, list pulls.

Pulls run as background threads of the gateway process that received the request and write their state to files
in `<data_dir>/models/.jobs/`, so every gateway worker sharing the data dir answers for every job."""

from __future__ import annotations

from typing import Any

import msgspec
from coderai.catalog.errors import CatalogError, MissingExtra, NotFound
from coderai.catalog.jobs import PullJobs
from coderai.catalog.pull import hub
from coderai.catalog.store import ModelStore
from coderai.gateway.errors import ApiError
from litestar import Request, Response, get, post

JSON = "application/json"


class _Pull(msgspec.Struct, forbid_unknown_fields=True):
    spec: str
    name: str = ""


def catalog_routes(gw: Any, caller) -> list:
    """Route handlers bound to the gateway state `gw`; `caller(request, scope)` authenticates."""
    jobs_: list[Any] = []

    def jobs() -> PullJobs:
        try:
            hub()
        except MissingExtra as exc:
            raise ApiError(501, str(exc), type="service_unavailable", code="no_catalog") from None
        if not jobs_:
            jobs_.append(PullJobs(ModelStore(gw.settings.data_dir)))
        return jobs_[0]

    def json(obj: Any, status: int = 200) -> Response:
        return Response(content=msgspec.json.encode(obj), media_type=JSON, status_code=status)

    def job_or_404(fn, job_id: str) -> Response:
        try:
            return json(fn(job_id))
        except NotFound as exc:
            raise ApiError(404, str(exc), code="job_not_found", param="job") from None

    @post("/admin/models/pull", status_code=202)
    async def start_pull(request: Request) -> Response:
        """`{spec, name?}`: a catalogue name, `<owner>/<repo>` or `<owner>/<repo>:<file>`; 202 with the job."""
        await caller(request, "admin")
        try:
            req = msgspec.json.decode(await request.body() or b"{}", type=_Pull)
        except (msgspec.ValidationError, msgspec.DecodeError) as exc:
            raise ApiError(400, f"Invalid request: {exc}", code="invalid_request") from None
        try:
            job = jobs().start(req.spec, req.name)
        except CatalogError as exc:
            raise ApiError(400, str(exc), code="invalid_spec", param="spec") from None
        return json(job, 202)

    @get("/admin/models/pull")
    async def list_pulls(request: Request) -> Response:
        await caller(request, "admin")
        return json({"jobs": jobs().list()})

    @get("/admin/models/pull/{job:str}")
    async def pull_status(request: Request) -> Response:
        """The job: state (running, done, failed, cancelled, interrupted), progress (bytes, percent, rate), events."""
        await caller(request, "admin")
        return job_or_404(jobs().get, request.path_params["job"])

    @post("/admin/models/pull/{job:str}/cancel", status_code=200)
    async def cancel_pull(request: Request) -> Response:
        await caller(request, "admin")
        return job_or_404(jobs().cancel, request.path_params["job"])

    @get("/admin/models/pulled")
    async def pulled(request: Request) -> Response:
        """What the model store holds: name, repo, engine, kind, size, path."""
        await caller(request, "admin")
        store = jobs().store
        return json({"models": [{"name": r.name, "repo": r.repo, "engine": r.engine, "kind": r.kind, "size": r.size,
                                 "path": str(store.model_path(r))} for r in store.list()]})

    return [start_pull, list_pulls, pull_status, cancel_pull, pulled]
