"""The router forgets a conversation's engine once that engine's cache dropped the conversation (issue 44: routing on
what engines report). A vLLM worker reads its server's KV-cache events and its heartbeat names the affinity keys
whose prompts the cache lost (`EngineStatus.evicted`); the router deletes those entries from `coderai_affinity`,
and the next turn goes to the least busy holder instead of to a cold engine.

A node's word can only take conversations off its own engines: keys that point at another engine, or engines the
node was not given, are left alone."""

from __future__ import annotations

import contextlib
import time

import pytest

from coderai.contracts import Assignment, EngineStatus, Heartbeat, ModelConfig, RouteRequest, encode, model_key
from coderai.contracts.nodes import EVICTED_MAX
from coderai.contracts.routing import AffinityEntry
from coderai.contracts.topology import AFFINITY, ASSIGNMENTS
from coderai.router.picking import EngineTable, evicted_keys, pick
from coderai.router.service import Router
from coderai.router.settings import RouterSettings
from coderai.runtime.lifecycle import wait_for


def status(eid: str, evicted: list[str], model: str = "m") -> EngineStatus:
    return EngineStatus(engine_id=eid, model=model, engine="vllm", ops=["chat"], state="ready", evicted=evicted)


def hb(node: str, *engines: EngineStatus) -> Heartbeat:
    return Heartbeat(node_id=node, version="0", seq=1, ts=0.0, host=node, capabilities=["vllm"], engines=list(engines))


def entry(engine: str, node: str) -> AffinityEntry:
    return AffinityEntry(engine_id=engine, node_id=node, ts=time.time())


def test_only_keys_pointing_at_the_reporting_engine_are_forgotten():
    t = EngineTable()
    t.apply(hb("n1", status("e1", [])), 0.0)
    t.apply(hb("n2", status("e2", [])), 0.0)
    affinity = {"mine": entry("e1", "n1"), "theirs": entry("e2", "n2"), "moved": entry("e2", "n2")}
    said = hb("n1", status("e1", ["mine", "theirs", "unknown"]))
    assert evicted_keys(said, t, affinity) == ["mine"]
    # a node speaking for another node's engine, or for an engine the table does not route to: nothing
    assert evicted_keys(hb("n1", status("e2", ["theirs"])), t, affinity) == []
    assert evicted_keys(hb("n3", status("e9", ["mine"])), t, affinity) == []
    many = [f"k{i}" for i in range(EVICTED_MAX + 50)]
    flood = {k: entry("e1", "n1") for k in many}
    assert len(evicted_keys(hb("n1", status("e1", many)), t, flood)) == EVICTED_MAX, "read up to the bound"


def test_a_forgotten_conversation_goes_to_the_least_busy_holder():
    t = EngineTable()
    t.apply(
        hb("n1", EngineStatus(engine_id="e1", model="m", engine="vllm", ops=["chat"], state="ready", in_flight=3)), 0
    )
    t.apply(hb("n2", status("e2", [])), 0.0)
    req = RouteRequest(request_id="r", model="m", op="chat", prefix=["h1", "h2"])
    affinity = {"h2": entry("e1", "n1")}
    assert pick(t, req, affinity, now=time.time()).engine_id == "e1", "warm: kept within the load guard"
    for key in evicted_keys(hb("n1", status("e1", ["h2"])), t, affinity):
        del affinity[key]
    d = pick(t, req, affinity, now=time.time())
    assert (d.engine_id, d.reason) == ("e2", "least_busy")


@pytest.fixture
async def router(bus, nats_server):
    r = Router(RouterSettings(nats_url=nats_server.url))
    async with contextlib.AsyncExitStack() as stack:
        await r.follow(bus, stack, sync_wait_s=5)
        yield r


async def test_the_router_deletes_the_entries_from_the_bucket(bus, router, unique):
    """On the session's nats-server: entries in `coderai_affinity`, a heartbeat from the node of one engine naming
    its lost keys; those entries leave the bucket (and every gateway's mirror with it), the others stay."""
    node, other, model = f"n-{unique}", f"o-{unique}", f"m-{unique}"
    mine, theirs = f"{node}-{model_key(model)}", f"{other}-{model_key(model)}"
    cfg = ModelConfig(name=model, engine="vllm", path="/m")
    assignments = await bus.kv(ASSIGNMENTS)
    for n in (node, other):
        await assignments.put(n, encode(Assignment(node_id=n, models=[cfg])))
    await wait_for(lambda: {node, other} <= set(router.placed), 10, what="the assignments mirrored")
    router._apply(hb(node, status(mine, [], model)), time.monotonic())
    router._apply(hb(other, status(theirs, [], model)), time.monotonic())
    kv = await bus.kv(AFFINITY)
    keys = {f"lost-{unique}": mine, f"kept-{unique}": mine, f"other-{unique}": theirs}
    for key, engine in keys.items():
        await kv.put(key, encode(entry(engine, node if engine == mine else other)))
    await wait_for(lambda: set(keys) <= set(router.affinity.values), 10, what="the entries mirrored")

    router._apply(hb(node, status(mine, [f"lost-{unique}", f"other-{unique}"], model)), time.monotonic())
    await wait_for(lambda: f"lost-{unique}" not in router.affinity.values, 5, what="forgotten here")

    async def gone() -> bool:
        try:
            got = await kv.get(f"lost-{unique}")
        except Exception:  # KeyNotFoundError: deleted
            return True
        return got.value in (b"", None)

    deadline = time.monotonic() + 10
    while not await gone():
        assert time.monotonic() < deadline, "the entry is still in the bucket"
        await bus.nc.flush()
    for key in (f"kept-{unique}", f"other-{unique}"):
        assert (await kv.get(key)).value, f"{key} stays"
    assert router.forgotten == 1
