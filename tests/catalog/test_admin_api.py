"""POST /admin/models/pull and GET /admin/models/pull/{job}, on a Litestar app holding only these routes."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
from coderai.gateway.admin.catalog import CatalogController, Pulls
from coderai.accounts.keyfile import KeyRecord, hash_key
from coderai.gateway.app import bound
from coderai.gateway.auth import Authenticator
from coderai.gateway.errors import ApiError
from coderai.testing.procs import wait_until
from litestar import Litestar, Response
from litestar.testing import TestClient

ADMIN = {"Authorization": "Bearer admin"}


@pytest.fixture
def client(tmp_path, hf_env):
    auth = Authenticator({hash_key("admin"): KeyRecord("admin", hash_key("admin"), ["admin"])})
    gw = SimpleNamespace(settings=SimpleNamespace(data_dir=str(tmp_path / "data"), max_body_bytes=1 << 20), auth=auth)
    pulls = Pulls(gw)
    app = Litestar(
        route_handlers=[bound(CatalogController, {"gw": gw, "pulls": pulls})],
        exception_handlers={
            ApiError: lambda _r, e: Response(content=e.encode(), status_code=e.status, media_type="application/json")
        },
    )
    app.state.gateway = gw
    with TestClient(app) as c:
        yield c


def wait_job(client, job_id: str, timeout: float = 20.0) -> dict:
    def finished() -> dict | None:
        job = client.get(f"/admin/models/pull/{job_id}", headers=ADMIN).json()
        return job if job["state"] != "running" else None

    return wait_until(finished, timeout, f"job {job_id} to finish")


def test_pull_job_reaches_done_with_progress(client, fake_hub, blob, tmp_path):
    data = blob(300_000, 7)
    fake_hub.add("acme/small-GGUF", {"small.gguf": data})
    fake_hub.delay_s = 0.01
    r = client.post("/admin/models/pull", json={"spec": "acme/small-GGUF:small.gguf"}, headers=ADMIN)
    assert r.status_code == 202, r.text
    seen = []

    def finished() -> dict | None:
        job = client.get(f"/admin/models/pull/{r.json()['id']}", headers=ADMIN).json()
        seen.append(job["progress"]["bytes_done"])
        return job if job["state"] != "running" else None

    job = wait_until(finished, 20, "the pull job to finish", interval_s=0.03)
    assert job["state"] == "done", job
    assert job["progress"]["percent"] == 100.0 and job["progress"]["bytes_total"] == len(data)
    assert any(0 < b < len(data) for b in seen)  # watched it move
    assert [e["state"] for e in job["events"]][:1] == ["queued"] and job["events"][-1]["state"] == "done"
    assert job["model"]["engine"] == "llama-server"
    assert Path(job["model"]["path"]).read_bytes() == data
    assert [m["name"] for m in client.get("/admin/models/pulled", headers=ADMIN).json()["models"]] == ["small"]
    assert [j["id"] for j in client.get("/admin/models/pull", headers=ADMIN).json()["jobs"]] == [job["id"]]


def test_pull_job_failures_and_errors(client, fake_hub):
    job = client.post("/admin/models/pull", json={"spec": "nobody/nothing:x.gguf"}, headers=ADMIN).json()
    job = wait_job(client, job["id"])
    assert job["state"] == "failed" and "no repo 'nobody/nothing'" in job["error"]
    r = client.post("/admin/models/pull", json={"spec": "no-such-name"}, headers=ADMIN)
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_spec"
    assert client.post("/admin/models/pull", json={"nope": 1}, headers=ADMIN).status_code == 400
    assert client.get("/admin/models/pull/deadbeef", headers=ADMIN).status_code == 404
    assert client.get("/admin/models/pull/..%2Fx", headers=ADMIN).status_code == 404
    assert client.post("/admin/models/pull", json={"spec": "x/y"}).status_code == 401


def test_cancel_keeps_the_partial_for_a_resume(client, fake_hub, blob):
    data = blob(400_000, 8)
    fake_hub.add("acme/slow-GGUF", {"slow.gguf": data})
    fake_hub.delay_s = 0.05
    job = client.post("/admin/models/pull", json={"spec": "acme/slow-GGUF:slow.gguf"}, headers=ADMIN).json()
    wait_until(
        lambda: client.get(f"/admin/models/pull/{job['id']}", headers=ADMIN).json()["progress"]["bytes_done"],
        20,
        "the pull to start moving",
        interval_s=0.02,
    )
    assert client.post(f"/admin/models/pull/{job['id']}/cancel", headers=ADMIN).status_code == 200
    job = wait_job(client, job["id"])
    assert job["state"] == "cancelled", job
    fake_hub.delay_s = 0
    again = wait_job(
        client, client.post("/admin/models/pull", json={"spec": "acme/slow-GGUF:slow.gguf"}, headers=ADMIN).json()["id"]
    )
    assert again["state"] == "done"
    assert fake_hub.ranges("slow.gguf")[-1].startswith("bytes=") and fake_hub.ranges("slow.gguf")[-1] != "bytes=0-"
