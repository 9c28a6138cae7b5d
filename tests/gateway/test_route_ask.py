"""A gateway whose router does not answer in time asks once more before it gives the client a 503: a router that
did not run for a moment (a loaded box) answers the second ask. A fake router on the session's nats-server."""

from __future__ import annotations

import pytest

from coderai.contracts import BusError, RouteDecision, RouteRequest, decode, encode
from coderai.contracts.subjects import ROUTE_PICK
from coderai.gateway.relay import Relay
from coderai.gateway.settings import GatewaySettings


class SlowRouter:
    """Silent on the first `silent` asks (as a router that is not running is), then answers."""

    def __init__(self, bus, silent: int) -> None:
        self.bus, self.silent, self.asked = bus, silent, []

    async def on_ask(self, m) -> None:
        self.asked.append(decode(m.data, RouteRequest).request_id)
        if len(self.asked) > self.silent:
            await m.respond(encode(RouteDecision(engine_id="e1", node_id="n1", reason="least_busy")))


@pytest.fixture
async def relay_for(bus, nats_server):
    subs = []

    async def make(silent: int) -> tuple[Relay, SlowRouter]:
        router = SlowRouter(bus, silent)
        subs.append(await bus.nc.subscribe(ROUTE_PICK.pattern, queue="router", cb=router.on_ask))
        await bus.nc.flush()
        return Relay(bus, GatewaySettings(nats_url=nats_server.url, route_timeout_s=0.3)), router

    yield make
    for sub in subs:
        await sub.unsubscribe()


async def test_a_router_silent_once_is_asked_again_and_its_answer_used(relay_for):
    relay, router = await relay_for(silent=1)
    decision = await relay.route(RouteRequest(request_id="r1", model="m", op="chat"), ["e0"], {})
    assert decision.engine_id == "e1" and router.asked == ["r1", "r1"]


async def test_a_router_silent_twice_is_a_retryable_503_not_a_missing_engine(relay_for):
    relay, router = await relay_for(silent=2)
    with pytest.raises(BusError) as exc:
        await relay.route(RouteRequest(request_id="r2", model="m", op="chat"), [], {})
    assert exc.value.code == "overloaded" and exc.value.retryable and "no router answered" in exc.value.message
    assert router.asked == ["r2", "r2"]  # twice, not more
