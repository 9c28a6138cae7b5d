"""A request waiting after an escalation (a model loaded on demand, a pod rented) asks the router again when a
router announces an engine of its model (`EngineReady`), not on a timer; and the router announces each engine it
can route to that it could not before. Fake router and scheduler on the session's nats-server."""

from __future__ import annotations

import asyncio
import time
import types

import pytest

from coderai.contracts import (
    Assignment,
    BusError,
    EngineReady,
    EngineStatus,
    Heartbeat,
    ModelConfig,
    RouteDecision,
    RouteRequest,
    model_key,
)
from coderai.contracts.pods import EscalateReply, EscalateRequest
from coderai.contracts.subjects import CMD_SCHEDULER_ESCALATE, EVT_ENGINE_READY, ROUTE_PICK
from coderai.gateway import relay
from coderai.gateway.relay import Relay
from coderai.gateway.settings import GatewaySettings
from coderai.router.service import Router
from coderai.router.settings import RouterSettings


class FakeCluster:
    """A router with no engine for the model until `ready`, and a scheduler that has it loaded on demand."""

    def __init__(self) -> None:
        self.ready = False
        self.picks = 0
        self.asked_twice = asyncio.Event()  # the first pick, and the first one after the escalation

    async def pick(self, req: RouteRequest, _m) -> RouteDecision:
        self.picks += 1
        if self.picks >= 2:
            self.asked_twice.set()
        if not self.ready:
            raise BusError("no_engine", f"no live engine serves chat for model {req.model!r}", retryable=True)
        return RouteDecision(engine_id="e1", node_id="n1", reason="least_busy")

    async def escalate(self, req: EscalateRequest, _m) -> EscalateReply:
        return EscalateReply(action="loading")


@pytest.fixture
async def cluster(bus):
    fake = FakeCluster()
    subs = [
        await bus.serve(ROUTE_PICK, fake.pick, queue="router"),
        await bus.serve(CMD_SCHEDULER_ESCALATE, fake.escalate, queue="scheduler"),
    ]
    await bus.nc.flush()
    yield fake
    for sub in subs:
        await sub.unsubscribe()


def settings(nats_server, wait_s: float) -> GatewaySettings:
    return GatewaySettings(nats_url=nats_server.url, load_wait_s=wait_s)


async def test_the_request_asks_again_when_a_router_announces_an_engine_of_its_model(
    bus, nats_server, cluster, monkeypatch, unique
):
    monkeypatch.setattr(relay, "REASK_S", 60.0)  # no timer within the test: only the announcement can wake it
    model = f"m-{unique}"
    waiting = asyncio.create_task(
        Relay(bus, settings(nats_server, 60.0))._pick(RouteRequest(request_id="r1", model=model, op="chat"), [], {})
    )
    await asyncio.wait_for(cluster.asked_twice.wait(), 10)
    cluster.ready = True
    t0 = time.monotonic()
    await bus.publish(
        EVT_ENGINE_READY, EngineReady(model=model, engine_id="e1", node_id="n1"), model_key=model_key(model)
    )
    decision = await asyncio.wait_for(waiting, 10)
    print(f"answered {time.monotonic() - t0:.3f} s after the announcement, the router asked {cluster.picks} times")
    assert decision.engine_id == "e1" and cluster.picks == 3


async def test_without_an_announcement_of_its_model_the_request_gives_up_at_its_deadline_asking_no_more(
    bus, nats_server, cluster, monkeypatch, unique
):
    monkeypatch.setattr(relay, "REASK_S", 60.0)
    model = f"m-{unique}"
    waiting = asyncio.create_task(
        Relay(bus, settings(nats_server, 1.0))._pick(RouteRequest(request_id="r2", model=model, op="chat"), [], {})
    )
    await asyncio.wait_for(cluster.asked_twice.wait(), 10)
    await bus.publish(
        EVT_ENGINE_READY, EngineReady(model="another", engine_id="e9", node_id="n9"), model_key=model_key("another")
    )
    with pytest.raises(BusError) as exc:
        await asyncio.wait_for(waiting, 10)
    assert exc.value.code == "no_engine" and "still loading" in exc.value.message
    assert cluster.picks == 2  # once before the escalation, once after: no poll


async def test_a_missed_announcement_is_made_up_for_by_asking_again_after_reask_s(
    bus, nats_server, cluster, monkeypatch, unique
):
    monkeypatch.setattr(relay, "REASK_S", 0.2)
    model = f"m-{unique}"
    waiting = asyncio.create_task(
        Relay(bus, settings(nats_server, 60.0))._pick(RouteRequest(request_id="r3", model=model, op="chat"), [], {})
    )
    await asyncio.wait_for(cluster.asked_twice.wait(), 10)
    cluster.ready = True  # and nobody announces it
    assert (await asyncio.wait_for(waiting, 10)).engine_id == "e1"


def heartbeat(node: str, *models: str) -> Heartbeat:
    engines = [
        EngineStatus(engine_id=f"{node}-{model_key(m)}", model=m, engine="llama", ops=["chat"], state="ready")
        for m in models
    ]
    return Heartbeat(node_id=node, version="0", seq=1, ts=0.0, host=node, capabilities=["llama"], engines=engines)


async def test_the_router_announces_each_engine_it_can_route_to_now_once(bus, nats_server, unique):
    a, b = f"a-{unique}", f"b-{unique}"
    heard: list[EngineReady] = []
    two = asyncio.Event()

    async def on_ready(e: EngineReady, _m) -> None:
        heard.append(e)
        if len(heard) >= 2:
            two.set()

    subs = [
        await bus.listen(EVT_ENGINE_READY, on_ready, subject_str=EVT_ENGINE_READY(model_key=model_key(m)))
        for m in (a, b)
    ]
    await bus.nc.flush()
    router = Router(RouterSettings(nats_url=nats_server.url))
    router.bus = bus
    router.placed = {"n1": frozenset({a})}
    now = time.monotonic()
    router._apply(heartbeat("n1", a), now)
    router._apply(heartbeat("n1", a), now)  # the same engine again: nothing new to announce
    # an engine given to the node after its heartbeat counts once the assignment arrives: announced then
    cfg = ModelConfig(name=b, engine="llama", path="/m/b.gguf")
    router.assignments = types.SimpleNamespace(
        values={"n1": Assignment(node_id="n1", models=[ModelConfig(name=a, engine="llama", path="/m/a.gguf"), cfg])}
    )
    router.pods = types.SimpleNamespace(values={})
    router._apply(heartbeat("n1", a, b), now)  # b is not placed yet: a node fault, not announced
    router._placement_changed("n1", None)
    await asyncio.wait_for(two.wait(), 10)
    await bus.nc.flush()
    assert [(e.model, e.engine_id, e.node_id) for e in heard] == [
        (a, f"n1-{model_key(a)}", "n1"),
        (b, f"n1-{model_key(b)}", "n1"),
    ]
    for sub in subs:
        await sub.unsubscribe()
