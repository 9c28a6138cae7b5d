"""Admin HTTP for the model catalogue (admin keys only): start a pull, watch it, cancel it, list pulls and what
the store holds.

Pulls run as background threads of the gateway process that received the request and write their state to files
in `<data_dir>/models/.jobs/`, so every gateway worker sharing the data dir answers for every job."""

from __future__ import annotations

from collections.abc import Callable

import msgspec
from litestar import Request, Response, get, post
from litestar.params import FromPath

from coderai.catalog.errors import CatalogError, MissingExtra, NotFound
from coderai.catalog.jobs import PullJobs
from coderai.catalog.pull import hub
from coderai.catalog.store import ModelStore
from coderai.gateway.errors import ApiError
from coderai.gateway.http import json_response, read_json
from coderai.gateway.state import AdminController, Gateway


class _Pull(msgspec.Struct, forbid_unknown_fields=True):
    spec: str
    name: str = ""


class Pulls:
    """This process's pull jobs, made on first use (the catalogue's extra may be missing: a 501 then)."""

    def __init__(self, gw: Gateway) -> None:
        self.gw = gw
        self._jobs: PullJobs | None = None

    def jobs(self) -> PullJobs:
        try:
            hub()
        except MissingExtra as exc:
            raise ApiError(501, str(exc), type="service_unavailable", code="no_catalog") from None
        if self._jobs is None:
            self._jobs = PullJobs(ModelStore(self.gw.settings.data_dir))
        return self._jobs


def _job_or_404(fn: Callable[[str], object], job_id: str) -> Response:
    try:
        return json_response(fn(job_id))
    except NotFound as exc:
        raise ApiError(404, str(exc), code="job_not_found", param="job") from None


class CatalogController(AdminController):
    path = "/admin/models"
    pulls: Pulls

    @post("/pull", status_code=202)
    async def start_pull(self, request: Request) -> Response:
        """`{spec, name?}`: a catalogue name, `<owner>/<repo>` or `<owner>/<repo>:<file>`; 202 with the job."""
        req = await read_json(request, _Pull, empty=b"{}")
        try:
            job = self.pulls.jobs().start(req.spec, req.name)
        except CatalogError as exc:
            raise ApiError(400, str(exc), code="invalid_spec", param="spec") from None
        return json_response(job, 202)

    @get("/pull")
    async def list_pulls(self) -> Response:
        return json_response({"jobs": self.pulls.jobs().list()})

    @get("/pull/{job:str}")
    async def pull_status(self, job: FromPath[str]) -> Response:
        """The job: state (running, done, failed, cancelled, interrupted), progress (bytes, percent, rate), events."""
        return _job_or_404(self.pulls.jobs().get, job)

    @post("/pull/{job:str}/cancel", status_code=200)
    async def cancel_pull(self, job: FromPath[str]) -> Response:
        return _job_or_404(self.pulls.jobs().cancel, job)

    @get("/pulled")
    async def pulled(self) -> Response:
        """What the model store holds: name, repo, engine, kind, size, path."""
        store = self.pulls.jobs().store
        return json_response(
            {
                "models": [
                    {
                        "name": r.name,
                        "repo": r.repo,
                        "engine": r.engine,
                        "kind": r.kind,
                        "size": r.size,
                        "path": str(store.model_path(r)),
                    }
                    for r in store.list()
                ]
            }
        )
