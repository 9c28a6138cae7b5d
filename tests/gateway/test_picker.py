"""The gateway's own copy of the router's view (gateway/picker.py), on the session's nats-server: a node's heartbeat
and its assignment in the real buckets, a fake router on `coderai.route.pick` that counts what it is asked. The
copy picks once it is whole and current, and the router is asked whenever it is not, or when it knows no engine."""

from __future__ import annotations

import pytest

from coderai.contracts import (
    Assignment,
    BusError,
    EngineStatus,
    Heartbeat,
    ModelConfig,
    RequestCompleted,
    RouteDecision,
    RouteRequest,
    encode,
    model_key,
)
from coderai.contracts.subjects import HEARTBEAT, ROUTE_PICK
from coderai.contracts.topology import ASSIGNMENTS
from coderai.gateway.picker import Picker
from coderai.gateway.relay import Relay
from coderai.gateway.settings import GatewaySettings
from coderai.router.settings import RouterSettings
from coderai.runtime.lifecycle import wait_for


class FakeRouter:
    """Answers every pick with its own engine, or `no_engine` for a model it is told nothing serves."""

    def __init__(self) -> None:
        self.asked: list[RouteRequest] = []

    async def pick(self, req: RouteRequest, _m) -> RouteDecision:
        self.asked.append(req)
        if req.model.startswith("absent"):
            raise BusError("no_engine", f"no live engine serves chat for model {req.model!r}", retryable=True)
        return RouteDecision(engine_id="router-engine", node_id="router-node", reason="least_busy")


@pytest.fixture
async def router(bus):
    fake = FakeRouter()
    sub = await bus.serve(ROUTE_PICK, fake.pick, queue="router")
    await bus.nc.flush()
    yield fake
    await sub.unsubscribe()


@pytest.fixture
async def picker(bus, nats_server):
    p = Picker(bus, RouterSettings(nats_url=nats_server.url))
    p.start()
    yield p
    await p.stop()


def heartbeat(node: str, model: str) -> Heartbeat:
    engine = EngineStatus(
        engine_id=f"{node}-{model_key(model)}", model=model, engine="llama", ops=["chat"], state="ready", slots=4
    )
    return Heartbeat(node_id=node, version="0", seq=1, ts=0.0, host=node, capabilities=["llama"], engines=[engine])


async def place(bus, picker: Picker, node: str, model: str) -> None:
    """The scheduler's assignment of `model` to `node`, and the node's heartbeat saying it serves it, once the
    copy listens (a node sends one every 2 s; the test, one)."""
    cfg = ModelConfig(name=model, engine="llama", path=f"/m/{model}.gguf")
    await (await bus.kv(ASSIGNMENTS)).put(node, encode(Assignment(node_id=node, models=[cfg])))
    await wait_for(lambda: picker.following, 10, what="the copy following the bus")
    await bus.publish(HEARTBEAT, heartbeat(node, model), node_id=node)


def ask(model: str, session: str = "") -> RouteRequest:
    return RouteRequest(request_id="r", model=model, op="chat", session=session)


async def test_the_copy_picks_once_whole_and_the_router_is_asked_before(bus, nats_server, router, picker, unique):
    relay = Relay(bus, GatewaySettings(nats_url=nats_server.url), picker)
    model, node = f"m-{unique}", f"n-{unique}"
    # nothing heard yet: the copy does not answer, the router does
    if not picker.ready:
        assert (await relay.route(ask(model), [], {})).engine_id == "router-engine"
    await place(bus, picker, node, model)
    engine = f"{node}-{model_key(model)}"
    await wait_for(lambda: engine in picker.router.table.engines and picker.ready, 10, what="the copy whole")
    asked = len(router.asked)
    for _ in range(5):
        decision = await relay.route(ask(model, session=f"s-{unique}"), [], {})
        assert (decision.engine_id, decision.node_id) == (engine, node)
    assert len(router.asked) == asked and picker.local >= 5  # not one pick over the bus
    # the engine that failed before its first token is excluded: the copy has no other, so the router is asked
    assert (await relay.route(ask(model), [engine], {})).engine_id == "router-engine"
    assert router.asked[-1].exclude == [engine]


async def test_a_model_the_copy_knows_no_engine_for_is_the_routers_to_refuse(bus, nats_server, router, picker, unique):
    relay = Relay(bus, GatewaySettings(nats_url=nats_server.url), picker)
    await place(bus, picker, f"n-{unique}", f"m-{unique}")
    await wait_for(lambda: picker.ready, 10, what="the copy whole")
    with pytest.raises(BusError) as exc:
        await relay.route(ask(f"absent-{unique}"), [], {})
    assert exc.value.code == "no_engine" and router.asked[-1].model == f"absent-{unique}"
    assert picker.asked >= 1


async def test_after_a_reconnect_the_router_answers_until_the_copy_has_caught_up(
    bus, nats_server, router, picker, unique
):
    relay = Relay(bus, GatewaySettings(nats_url=nats_server.url), picker)
    model = f"m-{unique}"
    await place(bus, picker, f"n-{unique}", model)
    await wait_for(lambda: picker.ready, 10, what="the copy whole")
    picker.on_reconnect()  # what the gateway does when its connection comes back
    assert not picker.ready
    assert (await relay.route(ask(model), [], {})).engine_id == "router-engine"
    await wait_for(lambda: picker.ready, 10, what="the copy caught up")
    assert (await relay.route(ask(model), [], {})).engine_id != "router-engine"


async def test_a_finished_request_takes_its_load_off_the_copy(bus, picker, unique):
    model, node = f"m-{unique}", f"n-{unique}"
    await place(bus, picker, node, model)
    engine = f"{node}-{model_key(model)}"
    await wait_for(lambda: engine in picker.router.table.engines and picker.ready, 10, what="the copy whole")
    view = picker.router.table.engines[engine]
    for _ in range(3):
        assert picker.pick(ask(model)) is not None
    assert view.load == 3
    picker.completed(engine)
    picker.completed("")  # a request that never reached an engine
    assert view.load == 2


async def test_the_gateway_counts_its_finished_requests_into_the_copy(bus, nats_server, picker, unique, tmp_path):
    """`Accounts.finish` hands each `request.completed` to the copy (state.py wires it), as the router's
    subscription to the event does for the router."""
    from coderai.gateway.accounting import Accounts, Admission, Trace
    from coderai.gateway.auth import Caller

    model, node = f"m-{unique}", f"n-{unique}"
    await place(bus, picker, node, model)
    engine = f"{node}-{model_key(model)}"
    await wait_for(lambda: engine in picker.router.table.engines and picker.ready, 10, what="the copy whole")
    accounts = Accounts(bus, None, tmp_path / "outbox")
    accounts.on_done = lambda done: picker.completed(done.engine_id)
    assert picker.pick(ask(model)) is not None and picker.router.table.engines[engine].load == 1
    done = RequestCompleted(
        request_id="r", ts=0.0, key_name="k", model=model, op="chat", status="ok", http_status=200, engine_id=engine
    )
    await accounts.finish(Caller("k", frozenset({"inference"})), Admission(None), done, Trace())
    assert picker.router.table.engines[engine].load == 0
