""" "Not ready" is never "absent": a gateway whose view of the models is being rebuilt (its bus down, or back and
reading the bucket again) answers a model it lacks with a 503 and `Retry-After` in its API's error shape, after
waiting for the view (bounded); only a model missing from a whole, current view is a 404. Real nats-server, the
real gateway app, and the official openai, anthropic and ollama clients over it."""

from __future__ import annotations

import asyncio
import time

import anthropic
import httpx
import ollama
import openai
import pytest

from coderai.accounts.keyfile import KeyRecord, hash_key, write_keys
from coderai.contracts import ModelConfig, encode, model_key
from coderai.contracts.topology import MODELS
from coderai.runtime.bus import Bus
from coderai.runtime.embedded import NatsServer, free_port
from coderai.testing.procs import wait_until
from coderai.testing.stack import Stack

KEY = "sk-not-ready"
WAIT_S = 1.0  # the failover budget here: short, so a refusal is quick
HEADERS = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def nats(tmp_path_factory):
    server = NatsServer(tmp_path_factory.mktemp("nats-not-ready"), port=free_port()).start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def gateway(nats, tmp_path_factory):
    """A gateway process on its own nats-server (no router, no engine: what is asked here is answered before
    them), the model `real` published; its HTTP client."""
    root = tmp_path_factory.mktemp("gw-not-ready")
    write_keys(str(root / "keys.toml"), [KeyRecord("k", hash_key(KEY), ["inference", "admin"])])

    async def publish() -> None:
        bus = await Bus.connect(nats.url, "test")
        try:
            cfg = ModelConfig(name="real", engine="llama", path="/nowhere.gguf")
            await (await bus.kv(MODELS)).put(model_key(cfg.name), encode(cfg))
        finally:
            await bus.close()

    asyncio.run(publish())
    stack = Stack(
        root,
        nats.url,
        extra_env={"CODERAI_GATEWAY_FAILOVER_WAIT_S": str(WAIT_S), "CODERAI_GATEWAY_ROUTE_TIMEOUT_S": "0.5"},
    )
    try:
        stack.start_gateway("--api-keys-file", str(root / "keys.toml"))
        with httpx.Client(base_url=stack.http_url, headers=HEADERS, timeout=30) as client:
            yield client
    finally:
        stack.stop()


def _sdks(client: httpx.Client):
    """The official clients, without their retries: the test sees each answer."""
    base = str(client.base_url).rstrip("/")
    return (
        openai.OpenAI(base_url=f"{base}/v1", api_key=KEY, max_retries=0),
        anthropic.Anthropic(base_url=base, api_key=KEY, max_retries=0),
        ollama.Client(host=base, headers=HEADERS),
    )


def _complete(client: httpx.Client) -> None:
    """Wait until the gateway's view is whole again: a model that does not exist is a plain 404."""
    wait_until(lambda: client.get("/v1/models/ghost").status_code == 404, 30, "the catalogue to be whole again")


def test_a_model_absent_from_a_whole_view_is_a_404_in_every_api(gateway):
    client = gateway
    _complete(client)
    oa, an, ol = _sdks(client)
    with pytest.raises(openai.NotFoundError) as e:
        oa.chat.completions.create(model="ghost", messages=[{"role": "user", "content": "hi"}])
    assert e.value.body["code"] == "model_not_found"
    with pytest.raises(anthropic.NotFoundError) as a:
        an.messages.create(model="ghost", max_tokens=4, messages=[{"role": "user", "content": "hi"}])
    assert a.value.body["error"]["type"] == "not_found_error"
    with pytest.raises(ollama.ResponseError) as o:
        ol.chat(model="ghost", messages=[{"role": "user", "content": "hi"}])
    assert o.value.status_code == 404
    assert [m.id for m in oa.models.list()] == ["real"]


def test_while_the_bus_is_down_a_missing_model_is_a_503_with_retry_after_not_a_404(gateway, nats):
    client = gateway
    _complete(client)
    oa, an, ol = _sdks(client)
    nats.stop()
    try:
        started = time.monotonic()
        with pytest.raises(openai.InternalServerError) as e:
            oa.chat.completions.create(model="ghost", messages=[{"role": "user", "content": "hi"}])
        waited = time.monotonic() - started
        assert e.value.status_code == 503 and e.value.response.headers.get("retry-after"), e.value.response.text
        assert waited >= WAIT_S * 0.9, "answered before the failover budget was spent"
        with pytest.raises(anthropic.InternalServerError) as a:
            an.messages.create(model="ghost", max_tokens=4, messages=[{"role": "user", "content": "hi"}])
        assert a.value.status_code == 503 and a.value.body["error"]["type"] == "overloaded_error"
        assert a.value.response.headers.get("retry-after")
        with pytest.raises(ollama.ResponseError) as o:
            ol.chat(model="ghost", messages=[{"role": "user", "content": "hi"}])
        assert o.value.status_code == 503
        r = client.get("/api/tags")  # a list that may lack some: 503, with the header the Ollama client drops
        assert r.status_code == 503 and r.headers.get("retry-after") and "error" in r.json()
        with pytest.raises(openai.InternalServerError):
            oa.models.list()
        # a model the view has is served as far as the bus allows: a 503 too, never a 404
        with pytest.raises(openai.InternalServerError) as e:
            oa.chat.completions.create(model="real", messages=[{"role": "user", "content": "hi"}])
        assert e.value.status_code == 503
    finally:
        nats.start()
    _complete(client)  # back: a whole view again, and absent is 404 again
    with pytest.raises(openai.NotFoundError):
        oa.chat.completions.create(model="ghost", messages=[{"role": "user", "content": "hi"}])
