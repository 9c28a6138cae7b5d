"""The broker's loopback proxy to RunPod serverless (services/pod_broker/serverless_proxy.py) against the fake
RunPod API, with a recording meter: what a relay sends is forwarded with the RunPod key and metered; what anyone
else sends (no token, a wrong one, another relay's name, another route, a body too big, bytes that are not HTTP) is
refused before it reaches RunPod or the meter; an answer past the cap is cut; a cap refusal is an over_budget."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from coderai.contracts import BusError
from coderai.pod_broker.serverless_proxy import MAX_REQUEST, Proxy, Route

pytest.importorskip("graphql")

from coderai.testing.fake_runpod import FakeRunPod  # noqa: E402  (needs graphql, checked above)

TOKEN = {"Authorization": "Bearer relay-token"}
BODY = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}


class Meter:
    def __init__(self) -> None:
        self.refuse = ""
        self.reserved = 0
        self.settled: list[tuple[int, bool]] = []

    async def reserve(self, route: Route) -> int:
        if self.refuse:
            raise BusError("over_budget", self.refuse)
        self.reserved += 1
        return self.reserved

    async def settle(self, route: Route, ticket: int, start: float, end: float, sent: bool) -> None:
        assert end >= start
        self.settled.append((ticket, sent))


@pytest.fixture
async def proxied():
    with FakeRunPod(api_key="rp-proxy-secret") as fake:
        ep = fake.serverless.add_endpoint(idle_timeout_s=1)
        meter = Meter()
        proxy = Proxy(fake.base_url, fake.api_key, meter)
        await proxy.start()
        proxy.routes["r1"] = Route("r1", "m", "relay-token", ep.id, "served-m", 20.0, 1 << 20)
        try:
            async with httpx.AsyncClient(base_url=proxy.url, timeout=60) as c:
                yield c, fake, ep, meter, proxy
        finally:
            await proxy.close()


async def test_a_relays_requests_are_forwarded_with_the_key_and_metered(proxied):
    c, fake, ep, meter, _ = proxied
    r = await c.get("/r1/v1/models", headers=TOKEN)
    assert r.status_code == 200 and r.json()["data"][0]["id"] == "served-m"
    r = await c.post("/r1/v1/chat/completions", headers=TOKEN, json=BODY)
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "Hello from the"
    async with c.stream("POST", "/r1/v1/completions", headers=TOKEN, json={**BODY, "stream": True}) as s:
        lines = [line async for line in s.aiter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]" and len(lines) > 3  # relayed as a stream
    assert meter.settled == [(1, True), (2, True)]
    assert ep.openai_calls == 2 and set(fake.serverless.keys_seen) == {fake.api_key}


async def test_requests_not_from_the_relay_never_reach_runpod(proxied):
    c, _, ep, meter, _ = proxied
    for path, headers in (
        ("/r1/v1/chat/completions", {}),
        ("/r1/v1/chat/completions", {"Authorization": "Bearer wrong"}),
        ("/r1/v1/chat/completions", {"Authorization": "relay-token"}),
    ):
        assert (await c.post(path, headers=headers, json=BODY)).status_code == 401
    for path in ("/r2/v1/chat/completions", "/r1/v1/embeddings", "/r1/v1/../../graphql", "/r1/health", "/"):
        assert (await c.post(path, headers=TOKEN, json=BODY)).status_code == 404, path
    assert (await c.post("/r1/v1/chat/completions", headers=TOKEN, content=b"x" * (MAX_REQUEST + 1))).status_code == 413
    host, port = c.base_url.host, c.base_url.port
    assert port is not None
    reader, writer = await asyncio.open_connection(host, port)
    writer.write(b"\x16\x03\x01 not http at all\r\n\r\n")
    status = await asyncio.wait_for(reader.readline(), 10)
    writer.close()
    assert status.startswith(b"HTTP/1.1 400")
    assert ep.openai_calls == 0 and meter.reserved == 0


async def test_a_cap_refusal_is_over_budget_and_nothing_is_sent(proxied):
    c, _, ep, meter, _ = proxied
    meter.refuse = "model 'm' has spent its $1 day budget"
    r = await c.post("/r1/v1/chat/completions", headers=TOKEN, json=BODY)
    assert r.status_code == 429 and r.json()["error"] == {"message": meter.refuse, "code": "over_budget"}
    assert ep.openai_calls == 0 and meter.settled == []


async def test_an_answer_past_the_cap_is_cut_and_still_billed(proxied):
    c, fake, ep, meter, _ = proxied
    fake.serverless.misbehave(ep.id, "huge")
    with pytest.raises(httpx.RemoteProtocolError):
        await c.post("/r1/v1/chat/completions", headers=TOKEN, json=BODY)
    assert meter.settled == [(1, True)]  # it reached RunPod: its time is booked


async def test_an_unhealthy_endpoint_is_a_503_for_models(proxied):
    c, fake, _, _, proxy = proxied
    proxy.routes["r1"] = Route("r1", "m", "relay-token", "nosuchendpoint", "m", 20.0, 1 << 20)
    r = await c.get("/r1/v1/models", headers=TOKEN)
    assert r.status_code == 503 and "/health answered 404" in r.json()["error"]["message"]
