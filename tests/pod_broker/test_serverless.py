"""Escalation to RunPod serverless endpoints through the fake RunPod API, whose serverless workers are real
processes answering OpenAI chat (`fake_runpod_serverless`), with the whole stack running: the OpenAI SDK's chat
for a model no node holds escalates, the broker starts its relay (a real engine worker with a `remote` engine,
through the broker's proxy that holds the RunPod key), each request is booked in Redis, and a budget it reaches
refuses the next request with the over_budget 429 a pod gives.

Models: `sls` (a roomy budget), `sls-capped` (a budget of two requests), `sls-bad` (an endpoint answering junk);
none has a local engine (`nodes = ["nowhere"]`)."""

from __future__ import annotations

import asyncio
import math
import uuid
from pathlib import Path

import httpx
import pytest

from coderai.models_file import ModelsFileError, load_models
from coderai.runtime.embedded import NatsServer
from coderai.testing.procs import wait_until
from coderai.testing.stack import Stack, write_models_file

pytestmark = pytest.mark.slow
pytest.importorskip("graphql")
openai = pytest.importorskip("openai")

from coderai.testing.fake_runpod import FakeRunPod  # noqa: E402  (needs graphql, checked above)

ADMIN = "sk-serverless-admin-0123456789"
PER_S, PER_REQUEST, MAX_S = 0.001, 0.01, 20.0


def serverless(endpoint: str, **policy: object) -> dict:
    return {
        "burst": "when_no_fit",
        "idle_timeout_s": 600,
        "serverless_endpoint": endpoint,
        "serverless_usd_per_s": PER_S,
        "serverless_usd_per_request": PER_REQUEST,
        "serverless_max_s": MAX_S,
        **policy,
    }


@pytest.fixture(scope="module")
def env(tmp_path_factory, redis_server):
    from coderai.accounts.keyfile import KeyRecord, hash_key, write_keys

    root = tmp_path_factory.mktemp("serverless")
    keys = root / "keys.toml"
    write_keys(str(keys), [KeyRecord(name="admin", sha256=hash_key(ADMIN), scopes=["inference", "admin"])])
    fake = FakeRunPod(api_key=f"rp-secret-{uuid.uuid4().hex}").start()
    good, capped, bad = (fake.serverless.add_endpoint(usd_per_s=PER_S, idle_timeout_s=5) for _ in range(3))
    echo = {"engine": "echo", "path": "-", "nodes": ["nowhere"]}
    models = [
        {"name": "sls", **echo, "pod": serverless(good.id, budget_usd=5)},
        # one request reserves 0.01 + 0.001 x 20 = $0.03: two fit under $0.05, a third does not
        {"name": "sls-capped", **echo, "pod": serverless(capped.id, budget_usd=0.05, period="day")},
        {"name": "sls-bad", **echo, "pod": serverless(bad.id, budget_usd=5)},
    ]
    deployment = "t" + uuid.uuid4().hex[:6]
    prefix = f"coderai:pods:{deployment}"
    nats = stack = None
    try:
        nats = NatsServer.secured(root / "nats").start()
        stack = Stack(
            root,
            nats.service_url,
            redis_server.url,
            {"CODERAI_WORKER_MDNS": "false", "CODERAI_WORKER_FAMILIES": "echo", "CODERAI_POD_LEDGER_PREFIX": prefix},
        )
        stack.nats = nats
        stack.start_core(write_models_file(root / "models.toml", models))
        stack.start(
            "pod-broker",
            "coderai.pod_broker",
            env={
                "CODERAI_POD_BROKER_RUNPOD_API_KEY": fake.api_key,
                "CODERAI_POD_BROKER_RUNPOD_API_BASE": fake.base_url,
                "CODERAI_POD_BROKER_RUNPOD_SERVERLESS_BASE": fake.base_url,
                "CODERAI_POD_BROKER_REDIS_URL": redis_server.url,
                "CODERAI_POD_BROKER_DEPLOYMENT": deployment,
                "CODERAI_POD_BROKER_MAX_HOURLY_USD": "20",
                "CODERAI_POD_BROKER_BOOT_TIMEOUT_S": "60",
                "CODERAI_POD_BROKER_RECONCILE_S": "0.5",
            },
        )
        stack.start_worker("w1")
        stack.start_gateway(
            "--api-keys-file",
            str(keys),
            env={"CODERAI_GATEWAY_REDIS_URL": redis_server.url, "CODERAI_GATEWAY_ESCALATE_WAIT_S": "60"},
        )
        yield stack, fake, prefix, {"sls": good.id, "sls-capped": capped.id, "sls-bad": bad.id}
    finally:
        if stack is not None:
            stack.stop()
        fake.close()
        if nats is not None:
            nats.stop()


def client(stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.base_url, api_key=ADMIN, timeout=120, max_retries=0)


def chat(stack, model: str) -> httpx.Response:
    body = {"model": model, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 3}
    return httpx.post(
        f"{stack.base_url}/chat/completions", json=body, headers={"Authorization": f"Bearer {ADMIN}"}, timeout=120
    )


def ledger(redis_url: str, prefix: str, model: str) -> list:
    from coderai.accounts.pod_money import PodMoney
    from coderai.runtime import redis_client

    async def read() -> list:
        redis = redis_client.connect(redis_url)
        try:
            return [e for e in await PodMoney(redis, prefix=prefix).ledger() if e.model == model]
        finally:
            await redis.aclose()

    return asyncio.run(read())


def relays(stack, model: str) -> list[dict]:
    r = httpx.get(f"{stack.http_url}/admin/pods", headers={"Authorization": f"Bearer {ADMIN}"}, timeout=10)
    assert r.status_code == 200, r.text
    return [p for p in r.json()["pods"] if p["model"] == model]


def test_escalation_to_a_serverless_endpoint_answers_and_books_each_request(env, redis_server):
    stack, fake, prefix, eps = env
    c = client(stack)
    answer = c.chat.completions.create(
        model="sls", messages=[{"role": "user", "content": "hello"}], max_tokens=3
    )  # no engine anywhere: escalated, the relay started, then answered by the endpoint's worker
    assert answer.choices[0].message.content == "Hello from the"
    streamed = c.chat.completions.create(
        model="sls", messages=[{"role": "user", "content": "again"}], max_tokens=4, stream=True
    )
    text = "".join(ch.choices[0].delta.content or "" for ch in streamed if ch.choices)
    assert text == "Hello from the fake"

    # the router may route to the relay on the heartbeat that the broker's next round marks it ready on
    wait_until(lambda: [p for p in relays(stack, "sls") if p["state"] == "ready"], 10, "the relay to be ready")
    (relay,) = [p for p in relays(stack, "sls") if p["state"] == "ready"]
    assert relay["serverless"] == eps["sls"] and relay["gpu_type"] == "serverless"
    assert fake.serverless.endpoints[eps["sls"]].openai_calls == 2  # /v1/models came from /health: no worker woken
    booked = ledger(redis_server.url, prefix, "sls")
    assert len(booked) == 2  # one entry per request, none for the relay itself
    for e in booked:
        assert e.gpu == f"serverless:{eps['sls']}"
        assert e.usd == pytest.approx(PER_REQUEST + PER_S * math.ceil(e.seconds), abs=1e-6)
    assert relay["cost_usd"] == pytest.approx(sum(e.usd for e in booked), abs=1e-6)


def test_a_reached_budget_refuses_the_next_request_as_a_pod_would(env, redis_server):
    stack, fake, prefix, eps = env
    for _ in range(2):
        r = chat(stack, "sls-capped")
        assert r.status_code == 200, r.text
    assert len(ledger(redis_server.url, prefix, "sls-capped")) == 2
    calls = fake.serverless.endpoints[eps["sls-capped"]].openai_calls
    for _ in range(2):
        r = chat(stack, "sls-capped")
        assert r.status_code == 429, r.text
        err = r.json()["error"]
        assert err["type"] == "insufficient_quota"
        assert "'sls-capped'" in err["message"] and "day budget" in err["message"] and "resets at" in err["message"]
    assert fake.serverless.endpoints[eps["sls-capped"]].openai_calls == calls  # nothing more reached RunPod
    assert not [p for p in relays(stack, "sls-capped") if p["state"] in ("creating", "booting", "ready")]


@pytest.mark.parametrize("how", ["malformed", "huge"])
def test_a_malformed_or_huge_serverless_answer_is_a_clean_error(env, how):
    stack, fake, _, eps = env
    fake.serverless.misbehave(eps["sls-bad"], how)
    r = chat(stack, "sls-bad")
    assert r.status_code == 502, r.text[:500]
    msg = r.json()["error"]["message"]
    assert ("malformed answer" if how == "malformed" else "sent an answer of more than") in msg, msg
    assert "Traceback" not in msg and fake.api_key not in msg
    fake.serverless.misbehave(eps["sls-bad"], "")
    assert chat(stack, "sls-bad").status_code == 200  # the relay is still there, and well


def test_the_runpod_key_is_used_and_never_logged(env):
    stack, fake, _, _ = env
    assert fake.api_key in fake.serverless.keys_seen  # the broker's proxy did send it to RunPod
    files = [p for p in Path(stack.root).rglob("*") if p.is_file()]  # every log, the relays' data dirs, NATS' files
    assert any(p.parts[-3] == "serverless" and p.name == "worker.log" for p in files)  # the relays' logs are there
    leaked = [str(p) for p in files if fake.api_key.encode() in p.read_bytes()]
    assert not leaked, leaked


@pytest.mark.parametrize("bad", ["../../graphql", "evil.example.com", "abc/../def", "ABC123", "a" * 65, "x?y=1"])
def test_an_endpoint_id_not_of_runpods_shape_is_refused_at_load(tmp_path, bad):
    models = [{"name": "m", "engine": "echo", "path": "-", "pod": {"burst": "always", "serverless_endpoint": bad}}]
    with pytest.raises(ModelsFileError, match="serverless_endpoint"):
        load_models(str(write_models_file(tmp_path / "models.toml", models)))
