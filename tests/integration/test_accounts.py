"""Accounts across two gateway replicas sharing Redis: key lifecycle, revocation, limits, budgets, usage,
/metrics, and the gates on every admin and telemetry route."""

from __future__ import annotations

import asyncio
import re

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from coderai.gateway.app import create_app
from coderai.gateway.settings import GatewaySettings
from coderai.runtime.embedded import NatsServer, free_port
from coderai.testing.procs import wait_until
from coderai.testing.stack import Stack, write_models_file

pytestmark = pytest.mark.slow

SCRAPE = "scrape-token-for-tests"
RESPONSES_QUOTA = 3  # stored responses one key may keep


@pytest.fixture(scope="module")
def duo(tmp_path_factory, redis_server, tiny_gguf, keys_file, admin_key):
    """One worker, two gateways (A and B) on the same NATS and Redis."""
    root = tmp_path_factory.mktemp("accounts")
    models = write_models_file(
        root / "models.toml",
        [
            {
                "name": "tiny",
                "engine": "llama",
                "path": str(tiny_gguf),
                "params": {"n_ctx": 512},
                "price_prompt_per_mtok": 1000.0,
                "price_completion_per_mtok": 2000.0,
            },
            {"name": "other", "engine": "llama", "path": str(tiny_gguf), "params": {"n_ctx": 512}},
            {
                "name": "clip",
                "engine": "video",
                "path": str(tiny_gguf),
                "nodes": ["nowhere"],
            },  # placed nowhere: never loads
        ],
    )
    nats = NatsServer(root / "nats").start()  # last: nothing that can fail runs before the `try` below
    stack = Stack(
        root,
        nats.url,
        redis_server.url,
        extra_env={
            "CODERAI_GATEWAY_REDIS_URL": redis_server.url,
            "CODERAI_GATEWAY_SCRAPE_TOKEN": SCRAPE,
            "CODERAI_GATEWAY_RESPONSES_QUOTA_COUNT": str(RESPONSES_QUOTA),
            "CODERAI_METRICS_SCRAPE_TOKEN": SCRAPE,
        },
    )
    try:
        stack.start_core(models)
        stack.env["CODERAI_GATEWAY_METRICS_URL"] = f"http://127.0.0.1:{stack.metrics_port}/metrics"
        stack.start_worker("w1")
        stack.start_gateway("--api-keys-file", str(keys_file))
        a = stack.http_url
        port_b = free_port()
        stack.start(
            "gateway-b", "coderai.gateway", ["--port", str(port_b), "--api-keys-file", str(keys_file)], ready=None
        )
        b = f"http://127.0.0.1:{port_b}"
        wait_until(lambda: httpx.get(f"{b}/healthz").status_code == 200, 60, "gateway B")
        stack.wait_model_ready("tiny", headers={"Authorization": f"Bearer {admin_key}"})
        stack.urls = (a, b)
        yield stack
    finally:
        stack.stop()
        nats.stop()


def admin(duo, admin_key, which: int = 0) -> httpx.Client:
    return httpx.Client(base_url=duo.urls[which], headers={"Authorization": f"Bearer {admin_key}"}, timeout=30)


def chat(base: str, key: str, model: str = "tiny", max_tokens: int = 4) -> httpx.Response:
    return httpx.post(
        f"{base}/v1/chat/completions",
        headers={"Authorization": f"Bearer {key}"},
        timeout=30,
        json={"model": model, "messages": [{"role": "user", "content": "hello"}], "max_tokens": max_tokens},
    )


def new_key(duo, admin_key, name: str, **spec) -> str:
    with admin(duo, admin_key) as c:
        r = c.post("/admin/keys", json={"name": name, **spec})
    assert r.status_code == 201, r.text
    return r.json()["key"]


def test_key_lifecycle_and_revocation_on_every_replica(duo, admin_key):
    key = new_key(duo, admin_key, "dave")
    a, b = duo.urls
    assert chat(a, key).status_code == 200 and chat(b, key).status_code == 200
    with admin(duo, admin_key) as c:
        listed = {k["name"]: k for k in c.get("/admin/keys").json()["keys"]}
        assert "dave" in listed and "sha256" not in listed["dave"] and "key" not in listed["dave"]
        assert c.post("/admin/keys", json={"name": "dave"}).status_code == 409
        assert c.post("/admin/keys/dave/revoke").json()["revoked"] is True
    for base in (b, a):  # refused at once, on the replica that did not revoke it too
        r = chat(base, key)
        assert r.status_code == 401 and "revoked" in r.json()["error"]["message"]
    with admin(duo, admin_key) as c:
        assert c.post("/admin/keys/nobody/revoke").status_code == 404


def test_a_keys_output_ceiling_caps_its_requests_on_every_replica(duo, admin_key):
    key = new_key(duo, admin_key, "ui-tasks", max_output_tokens=3, default_output_tokens=2)
    for base in duo.urls:
        capped = chat(base, key, max_tokens=40).json()
        assert capped["usage"]["completion_tokens"] <= 3 and capped["choices"][0]["finish_reason"] == "length", capped
    r = httpx.post(
        f"{duo.urls[0]}/v1/chat/completions",
        headers={"Authorization": f"Bearer {key}"},
        timeout=30,
        json={"model": "tiny", "messages": [{"role": "user", "content": "hello"}]},
    )  # names no limit
    assert r.json()["usage"]["completion_tokens"] <= 2, r.text
    with admin(duo, admin_key) as c:
        listed = {k["name"]: k for k in c.get("/admin/keys").json()["keys"]}["ui-tasks"]
        assert (listed["max_output_tokens"], listed["default_output_tokens"]) == (3, 2)
        assert c.post("/admin/keys/ui-tasks/limits", json={"max_output_tokens": -1}).status_code == 400
        assert c.post("/admin/keys/ui-tasks/limits", json={"max_output_tokens": 0}).json()["max_output_tokens"] == 0
    assert chat(duo.urls[1], key, max_tokens=6).json()["usage"]["completion_tokens"] > 3  # lifted


def test_model_allow_list(duo, admin_key):
    key = new_key(duo, admin_key, "erin", models=["tiny"])
    assert chat(duo.urls[0], key).status_code == 200
    auth = {"Authorization": f"Bearer {key}"}
    # attack: tell a model this key may not use from one that does not exist (status, code, message or what the
    # model serves): every answer is the same 404, whatever is asked of it
    forbidden, missing = chat(duo.urls[1], key, model="other"), chat(duo.urls[1], key, model="no-such-model")
    assert forbidden.status_code == missing.status_code == 404, (forbidden.text, missing.text)
    assert forbidden.json() == {"error": {**missing.json()["error"], "message": "The model 'other' does not exist."}}
    embed = [
        httpx.post(f"{duo.urls[0]}/v1/embeddings", json={"model": m, "input": "x"}, headers=auth, timeout=30)
        for m in ("other", "no-such-model")
    ]
    assert [r.status_code for r in embed] == [404, 404], [r.text for r in embed]
    print(
        "the allow-list oracle: a forbidden and a missing model answer alike (404 model_not_found), for chat and "
        "for embeddings (whose 400 would have named what the model serves)"
    )
    listed = httpx.get(f"{duo.urls[0]}/v1/models", headers=auth, timeout=30).json()["data"]
    assert [m["id"] for m in listed] == ["tiny"]  # what it may use, no more
    assert httpx.get(f"{duo.urls[0]}/v1/models/other", headers=auth, timeout=30).status_code == 404
    assert [m["name"] for m in httpx.get(f"{duo.urls[1]}/api/tags", headers=auth, timeout=30).json()["models"]] == [
        "tiny"
    ]
    with admin(duo, admin_key) as c:  # a key without an allow-list sees them all
        assert {m["id"] for m in c.get("/v1/models").json()["data"]} == {"tiny", "other", "clip"}
    # a background job is refused at once too, not answered 200 and failed later
    r = httpx.post(
        f"{duo.urls[0]}/v1/videos",
        json={"model": "clip", "prompt": "a cat"},
        headers={"Authorization": f"Bearer {key}"},
        timeout=30,
    )
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


def test_no_key_takes_the_bootstrap_admins_name(duo, admin_key):
    """Attack: a key named `admin` would own the bootstrap admin's files, responses and batches."""
    with admin(duo, admin_key) as c:
        for name in ("admin", "admin-0a1b2c", "anonymous"):
            r = c.post("/admin/keys", json={"name": name})
            print(f"POST /admin/keys named {name!r}: {r.status_code}")
            assert r.status_code == 400 and "reserved" in r.json()["error"]["message"], r.text
        assert "admin" not in {k["name"] for k in c.get("/admin/keys").json()["keys"]}


def test_requests_per_minute_hold_across_two_replicas_under_concurrent_load(duo, admin_key):
    key = new_key(duo, admin_key, "frank", rpm=5)

    async def fire() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=30) as c:
            body = {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "max_tokens": 1}
            return await asyncio.gather(
                *(
                    c.post(
                        f"{duo.urls[i % 2]}/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"}
                    )
                    for i in range(16)
                )
            )

    rs = asyncio.run(fire())
    codes = [r.status_code for r in rs]
    assert codes.count(200) == 5 and codes.count(429) == 11, (codes, [r.text[:80] for r in rs if r.status_code == 200])
    r = chat(duo.urls[0], key)
    assert r.status_code == 429 and int(r.headers["Retry-After"]) >= 1
    assert r.json()["error"]["code"] == "rate_limit_exceeded"


def test_tokens_per_minute(duo, admin_key):
    key = new_key(duo, admin_key, "gina", tpm=40)
    codes = []
    for i in range(6):
        codes.append(chat(duo.urls[i % 2], key, max_tokens=8).status_code)
    assert codes[0] == 200 and 429 in codes  # each request spends ~20 tokens: the budget of 40 runs out


def _spent(duo, admin_key, name: str, n_ok: int) -> dict:
    with admin(duo, admin_key, 1) as c:

        def row():
            rows = c.get("/admin/usage", params={"key": name}).json()["rows"]
            return rows[0] if rows and rows[0]["requests"] == n_ok else None

        return wait_until(row, 15, f"{name}'s usage")


def test_a_budget_holds_across_two_replicas_under_concurrent_load(duo, admin_key):
    # each request reserves a generous estimate (~$0.04 here) and settles at its real cost (~$0.02)
    budget = 0.1
    key = new_key(duo, admin_key, "ivan", budget_usd=budget, budget_period="day")

    async def burst() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=30) as c:
            body = {"model": "tiny", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}
            return await asyncio.gather(
                *(
                    c.post(
                        f"{duo.urls[i % 2]}/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"}
                    )
                    for i in range(12)
                )
            )

    rs = asyncio.run(burst()) + asyncio.run(burst())
    ok = [r for r in rs if r.status_code == 200]
    refused = [r for r in rs if r.status_code == 429]
    assert ok and refused and len(ok) + len(refused) == len(rs)
    assert {r.json()["error"]["code"] for r in refused} == {"insufficient_quota"}
    row = _spent(duo, admin_key, "ivan", len(ok))
    assert 0 < row["cost_usd"] <= budget  # never overshot, however the requests interleaved


def test_usage_equals_what_requests_used(duo, admin_key):
    key = new_key(duo, admin_key, "hank", budget_usd=1.0, budget_period="day")
    used = {"requests": 0, "prompt_tokens": 0, "completion_tokens": 0}
    for i in range(5):
        r = chat(duo.urls[i % 2], key, max_tokens=4)
        assert r.status_code == 200
        u = r.json()["usage"]
        used["requests"] += 1
        used["prompt_tokens"] += u["prompt_tokens"]
        used["completion_tokens"] += u["completion_tokens"]

    got = _spent(duo, admin_key, "hank", used["requests"])
    with admin(duo, admin_key, 1) as c:
        assert (got["model"], got["prompt_tokens"], got["completion_tokens"]) == (
            "tiny",
            used["prompt_tokens"],
            used["completion_tokens"],
        )
        assert got["cost_usd"] == pytest.approx((used["prompt_tokens"] * 1000 + used["completion_tokens"] * 2000) / 1e6)
        csv = c.get("/admin/usage", params={"key": "hank", "format": "csv"})
        assert csv.headers["content-type"].startswith("text/csv") and csv.text.splitlines()[0].startswith(
            "day,key,model"
        )
        assert c.get("/admin/usage", params={"from": "2026-02-30"}).status_code == 400


def test_metrics_through_the_gateway_parse_with_prometheus_client(duo, admin_key, user_key):
    for _ in range(3):
        assert chat(duo.urls[0], admin_key).status_code == 200

    def scraped():
        r = httpx.get(f"{duo.urls[1]}/metrics", headers={"Authorization": f"Bearer {SCRAPE}"}, timeout=10)
        fams = {f.name: f for f in text_string_to_metric_families(r.text)}
        req = fams.get("coderai_requests")
        ok = [
            s
            for s in (req.samples if req else [])
            if s.labels.get("key") == "admin"
            and s.labels.get("model") == "tiny"
            and s.labels.get("status") == "ok"
            and s.name == "coderai_requests_total"
        ]
        return fams if ok and ok[0].value >= 3 else None

    fams = wait_until(scraped, 20, "admin's requests in /metrics")
    assert {"coderai_request_seconds", "coderai_tokens", "coderai_engine_in_flight", "coderai_route_decisions"} <= set(
        fams
    )
    hist = [
        s for s in fams["coderai_request_seconds"].samples if s.name.endswith("_count") and s.labels["model"] == "tiny"
    ]
    assert hist and hist[0].value >= 3
    assert set(fams["coderai_requests"].samples[0].labels) == {"key", "model", "kind", "status", "engine"}
    assert httpx.get(f"{duo.urls[0]}/metrics", headers={"Authorization": f"Bearer {admin_key}"}).status_code == 200
    assert httpx.get(f"{duo.urls[0]}/metrics").status_code == 401
    assert httpx.get(f"{duo.urls[0]}/metrics", headers={"Authorization": f"Bearer {user_key}"}).status_code == 403
    assert httpx.get(f"http://127.0.0.1:{duo.metrics_port}/metrics").status_code == 401  # the service itself too


def _admin_and_telemetry_routes() -> list[tuple[str, str]]:
    """(method, path with placeholders filled) for every route but health, the OpenAI and Ollama APIs, the UI
    shell and the published contract (open: OpenAI's own spec, cut to what is served)."""
    app = create_app(GatewaySettings(no_auth=True))
    out = []
    for route in app.routes:
        path = route.path
        if path in ("/healthz", "/ui", "/openapi.json") or path.startswith(("/v1/", "/api/")):
            continue
        for method in sorted(getattr(route, "methods", {"GET"}) - {"HEAD", "OPTIONS"}):
            out.append((method, re.sub(r"\{[^}]+\}", "x", path)))
    return out


def test_every_admin_and_telemetry_route_needs_an_admin_key(duo, user_key):
    routes = _admin_and_telemetry_routes()
    assert ("GET", "/admin/nodes") in routes and ("GET", "/metrics") in routes and ("POST", "/admin/keys") in routes
    for method, path in routes:
        for headers, status in (({}, 401), ({"Authorization": f"Bearer {user_key}"}, 403)):
            r = httpx.request(method, f"{duo.urls[0]}{path}", headers=headers, json={}, timeout=10)
            assert r.status_code == status, (method, path, r.status_code, r.text)


def test_requests_served_while_metrics_is_down_are_counted_when_it_comes_back(duo, admin_key):
    """The metrics service reads EVENTS through a durable consumer: what it missed while dead waits for it."""
    key = new_key(duo, admin_key, "olga")
    duo.procs["metrics"].kill()
    for i in range(4):
        assert chat(duo.urls[i % 2], key).status_code == 200  # serving does not need the metrics service
    duo.start(
        "metrics",
        "coderai.metrics",
        env={"CODERAI_METRICS_PORT": str(duo.metrics_port), "CODERAI_METRICS_REDIS_URL": duo.redis_url},
    )
    row = _spent(duo, admin_key, "olga", 4)
    assert row["model"] == "tiny" and row["completion_tokens"] > 0


def test_a_client_request_id_goes_with_the_usage_it_made(duo, admin_key):
    """OpenAI's X-Client-Request-Id: the client's own id for a request, kept in its `request.completed`, so that a
    client can match its records against usage (the soak does) even for an answer that never reached it."""
    import secrets

    import openai

    from coderai.testing.events import read_completed

    sdk = openai.OpenAI(base_url=f"{duo.urls[0]}/v1", api_key=admin_key, max_retries=0)
    whole, streamed = f"whole-{secrets.token_hex(4)}", f"stream-{secrets.token_hex(4)}"
    sdk.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=2,
        extra_headers={"X-Client-Request-Id": whole},
    )
    for _ in sdk.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=2,
        stream=True,
        extra_headers={"X-Client-Request-Id": streamed},
    ):
        pass
    sdk.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    with pytest.raises(openai.BadRequestError) as err:  # OpenAI's bound: at most 512 characters
        sdk.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=2,
            extra_headers={"X-Client-Request-Id": "x" * 513},
        )
    assert err.value.body["param"] == "X-Client-Request-Id"

    def events():
        got = {e.client_request_id: e for e in asyncio.run(read_completed(duo.nats_url))}
        return got if {whole, streamed} <= got.keys() else None

    got = wait_until(events, 30, "the requests' events", interval_s=0.5)
    assert (got[whole].status, got[whole].stream, got[streamed].stream) == ("ok", False, True)
    assert got[whole].request_id != got[streamed].request_id
    assert not any(len(cid) > 512 or not cid.isascii() for cid in got)  # the refused ones made no usage


def test_a_key_cannot_fill_jetstream_with_stored_responses(duo, admin_key):
    """Attack: one key stores responses (each kept 30 days) until the head's disk is full. Past its quota (count,
    and bytes) a stored response is a 429 before any work, on every replica; deleting one makes room; another key
    is not affected."""
    import openai

    key, other = new_key(duo, admin_key, "hoarder"), new_key(duo, admin_key, "neighbour")
    clients = [openai.OpenAI(base_url=f"{u}/v1", api_key=key, max_retries=0, timeout=60) for u in duo.urls]
    kept = [
        clients[i % 2].responses.create(model="tiny", input="hi", max_output_tokens=16) for i in range(RESPONSES_QUOTA)
    ]
    refused = 0
    for c in clients:
        with pytest.raises(openai.RateLimitError) as exc:
            c.responses.create(model="tiny", input="hi", max_output_tokens=16)
        assert exc.value.body["code"] == "responses_quota_exceeded"
        refused += 1
    unstored = clients[0].responses.create(model="tiny", input="hi", max_output_tokens=16, store=False)
    assert unstored.status in ("completed", "incomplete")  # not stored: not counted
    clients[1].responses.delete(kept[0].id)
    clients[0].responses.create(model="tiny", input="hi", max_output_tokens=16)
    neighbour = openai.OpenAI(base_url=f"{duo.urls[0]}/v1", api_key=other, max_retries=0, timeout=60)
    neighbour.responses.create(model="tiny", input="hi", max_output_tokens=16)
    print(
        f"stored responses past a quota of {RESPONSES_QUOTA}: {refused} refused (429) on two replicas; "
        "a delete made room; another key unaffected"
    )


def test_revoking_a_key_cancels_its_running_batch(duo, admin_key):
    """Attack: a key revoked mid-batch went on running and billing its batch (43 -> 400 of 400 lines after the
    revoke). Its batch is cancelled within a line or two of the revoke, and nothing more is billed to it."""
    import io
    import json

    import openai

    key = new_key(duo, admin_key, "batcher")
    c = openai.OpenAI(base_url=f"{duo.urls[0]}/v1", api_key=key, max_retries=0, timeout=60)
    lines = b"".join(
        json.dumps(
            {
                "custom_id": f"l{i}",
                "method": "POST",
                "url": "/v1/chat/completions",
                "body": {"model": "tiny", "messages": [{"role": "user", "content": f"count {i}"}], "max_tokens": 8},
            }
        ).encode()
        + b"\n"
        for i in range(400)
    )
    batch = c.batches.create(
        input_file_id=c.files.create(file=("b.jsonl", io.BytesIO(lines)), purpose="batch").id,
        endpoint="/v1/chat/completions",
        completion_window="24h",
    )
    with admin(duo, admin_key) as a:
        wait_until(
            lambda: (a.get(f"/v1/batches/{batch.id}").json()["request_counts"]["completed"] or 0) >= 5,
            120,
            "some lines answered",
        )
        assert a.post("/admin/keys/batcher/revoke").status_code == 200
        at_revoke = a.get(f"/v1/batches/{batch.id}").json()["request_counts"]["completed"]
        done = wait_until(
            lambda: (
                (b := a.get(f"/v1/batches/{batch.id}").json())["status"]
                in ("cancelled", "completed", "failed", "expired")
                and b
            ),
            120,
            "the revoked key's batch to end",
        )
    answered = done["request_counts"]["completed"] + done["request_counts"]["failed"]
    print(f"a key revoked after {at_revoke} of 400 lines: its batch ended {done['status']} with {answered} answered")
    assert done["status"] == "cancelled" and answered < 200, done
