"""The router service counts a finished request against an engine's load only when it picked that request itself.

Gateways pick in their own copies of the table (gateway/picker.py) and count their own requests there; the router
is asked only now and then. Before, it took every `request.completed` off the load it had counted, so an engine
busy with the gateways' requests read as idle on the router's next pick."""

from __future__ import annotations

import time
from types import SimpleNamespace

from coderai.contracts import EngineStatus, Heartbeat, RequestCompleted, RouteRequest
from coderai.router import service
from coderai.router.service import Router
from coderai.router.settings import RouterSettings


def router() -> Router:
    r = Router(RouterSettings(nats_url="nats://127.0.0.1:1", policy="least_busy"))
    engines = [
        EngineStatus(engine_id=e, model="m", engine="llama-server", ops=["chat"], state="ready", slots=1)
        for e in ("e1", "e2")
    ]
    hb = Heartbeat(node_id="n", version="0", seq=1, ts=0.0, host="n", capabilities=[], engines=engines)
    r.table.apply(hb, time.monotonic())  # heard now: the router expires nodes by its monotonic clock
    return r


def done(request_id: str, engine_id: str) -> RequestCompleted:
    return RequestCompleted(
        request_id=request_id, ts=0.0, key_name="k", model="m", op="chat", status="ok", http_status=200,
        engine_id=engine_id, node_id="n",
    )  # fmt: skip


async def ask(r: Router, request_id: str) -> str:
    req = RouteRequest(request_id=request_id, model="m", op="chat")
    return (await r._on_pick(req, SimpleNamespace(headers=None))).engine_id


async def test_only_the_routers_own_picks_finish_against_its_load():
    r = router()
    first = await ask(r, "a")
    second = await ask(r, "b")
    assert {first, second} == {"e1", "e2"}, "least busy: one each"
    # requests a gateway routed itself finish on e1: not this router's to take off
    for i in range(5):
        await r._on_completed(done(f"gw-{i}", first), None)
    assert r.table.engines[first].load == 1 and r.table.engines[second].load == 1
    await r._on_completed(done("a", first), None)
    assert r.table.engines[first].load == 0
    await r._on_completed(done("a", first), None)  # said twice (an outbox resend): counted once
    assert r.table.engines[first].load == 0 and r.table.engines[second].load == 1
    assert await ask(r, "c") == first, "the engine whose own request finished is the least busy"


async def test_a_failover_finishes_against_the_engine_picked_last():
    r = router()
    first = await ask(r, "a")
    req = RouteRequest(request_id="a", model="m", op="chat", exclude=[first])
    other = (await r._on_pick(req, SimpleNamespace(headers=None))).engine_id
    assert other != first
    await r._on_completed(done("a", other), None)
    assert r.table.engines[other].load == 0


async def test_requests_never_heard_finishing_are_forgotten_past_a_bound(monkeypatch):
    monkeypatch.setattr(service, "PICKS_KEPT", 3)
    r = router()
    for i in range(5):
        await ask(r, f"r{i}")
    assert list(r._picked) == ["r2", "r3", "r4"]
