"""Admin HTTP with an admin key: nodes, a node's logs, drain, and model placement, against a live stack."""

from __future__ import annotations

import httpx
import pytest

from coderai.testing.procs import wait_until

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def admin(api_stack, admin_key):
    with httpx.Client(base_url=api_stack.http_url, headers={"Authorization": f"Bearer {admin_key}"}, timeout=30) as c:
        yield c


def _chat(admin: httpx.Client, model: str) -> int:
    return admin.post(
        "/v1/chat/completions", json={"model": model, "messages": [{"role": "user", "content": "x"}], "max_tokens": 1}
    ).status_code


def test_admin_routes_need_an_admin_key(api_stack, user_key):
    r = httpx.get(f"{api_stack.http_url}/admin/nodes", headers={"Authorization": f"Bearer {user_key}"})
    assert r.status_code == 403
    assert httpx.get(f"{api_stack.http_url}/admin/nodes").status_code == 401


def test_nodes_lists_the_worker_and_what_it_holds(admin):
    doc = admin.get("/admin/nodes").json()
    [w1] = [n for n in doc["nodes"] if n["heartbeat"]["node_id"] == "w1"]
    assert "tiny" in w1["assigned"] and w1["age_s"] < 10
    assert {e["model"] for e in w1["heartbeat"]["engines"]} >= {"tiny"}
    assert "ghost" in doc["unplaced"]


def test_a_nodes_logs(admin):
    doc = admin.get("/admin/nodes/w1/logs", params={"lines": 5}).json()
    assert doc["node_id"] == "w1" and 0 < len(doc["lines"]) <= 5
    assert all(line.startswith("{") for line in doc["lines"])
    assert admin.get("/admin/nodes/nobody/logs").status_code == 404
    assert admin.get("/admin/nodes/w1/logs", params={"lines": "many"}).status_code == 400


def test_place_and_unplace_a_model(admin):
    assert _chat(admin, "ghost") == 503
    r = admin.post("/admin/models/ghost/place", json={"node": "w1"})
    assert r.status_code == 200 and r.json()["model"]["nodes"] == ["nowhere", "w1"]
    wait_until(lambda: _chat(admin, "ghost") == 200, 30, "ghost to be served after placing it on w1")
    r = admin.post("/admin/models/ghost/unplace", json={"node": "w1"})
    assert r.status_code == 200 and r.json()["model"]["nodes"] == ["nowhere"]
    wait_until(lambda: _chat(admin, "ghost") == 503, 30, "ghost to be gone from w1 again")
    # tiny may go anywhere, and w1 is the only node: unplacing it there would leave it nowhere, so it is refused
    assert admin.post("/admin/models/tiny/unplace", json={"node": "w1"}).status_code == 400
    assert admin.post("/admin/models/nope/place", json={"node": "w1"}).status_code == 404
    assert admin.post("/admin/models/ghost/place", json={"nod": "w1"}).status_code == 400


def test_drain_stops_new_work_and_undrain_resumes(admin):
    r = admin.post("/admin/nodes/w1/drain")
    assert r.status_code == 200 and r.json()["draining"] is True
    wait_until(lambda: _chat(admin, "tiny") == 503, 15, "a drained node to get no new work")
    r = admin.post("/admin/nodes/w1/drain", json={"drain": False})
    assert r.json()["draining"] is False
    wait_until(lambda: _chat(admin, "tiny") == 200, 15, "work to come back after undrain")
