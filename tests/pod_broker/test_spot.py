"""The pod-broker with spot pods and a failing RunPod, against the fake RunPod API (pods without processes: their
heartbeats are handed to the broker here) on real NATS and Redis: a preempted spot pod is told from a crash, booked
once to its last heartbeat and replaced only for a floor; while RunPod's API fails nothing waits on it."""

from __future__ import annotations

import contextlib
import logging
import time
import uuid
from types import SimpleNamespace

import msgspec
import pytest
import redis.asyncio as aioredis

from coderai.accounts.pod_money import PodMoney
from coderai.contracts import BusError, ModelConfig
from coderai.contracts.admin import PodUser
from coderai.contracts.models import PodPolicy
from coderai.contracts.nodes import EngineStatus, Heartbeat
from coderai.contracts.pods import BrokerStatusRequest, PodInfo
from coderai.contracts.subjects import CMD_SCHEDULER_POD_USER
from coderai.contracts.topology import NODE_TTL_S, PODS
from coderai.pod_broker.runpod_api import RunPodClient
from coderai.pod_broker.service import Broker
from coderai.pod_broker.settings import BrokerSettings
from coderai.runtime.settings import load_settings
from coderai.testing.fake_runpod import FakeRunPod

SPOT = ModelConfig(name="m", engine="llama", path="/m.gguf", pod=PodPolicy(burst="when_no_fit", spot=True, max_pods=2))


async def no_sleep(_s: float) -> None:
    pass


@pytest.fixture
async def env(bus, redis_server):
    """(broker, fake): a broker that rents from the fake, with its own ledger prefix and deployment name."""
    tag = uuid.uuid4().hex[:8]
    settings = load_settings(
        BrokerSettings, "pod-broker", env={}, max_hourly_usd=10.0, pod_nats_url="nats://pods:4222", deployment=f"t{tag}"
    )

    async def pod_user(req, _m) -> PodUser:  # the scheduler's part: the pod's own NATS login
        return PodUser(user=f"pod-{req.pod_id}", password="pw", expires_at=time.time() + req.ttl_s)

    with FakeRunPod() as fake:  # its server closed whatever happened
        async with contextlib.AsyncExitStack() as cleanup:
            r = aioredis.from_url(redis_server.url)
            cleanup.push_async_callback(r.aclose)
            broker = Broker(
                settings,
                api=RunPodClient(fake.api_key, fake.base_url, sleep=no_sleep),
                money=PodMoney(r, prefix=f"coderai:pods:{tag}"),
            )
            cleanup.push_async_callback(broker.api.aclose)
            broker.bus, broker.kv = bus, await bus.kv(PODS)
            broker.models = SimpleNamespace(values={"m": SPOT})
            sub = await bus.serve(CMD_SCHEDULER_POD_USER, pod_user)
            cleanup.push_async_callback(sub.unsubscribe)
            yield broker, fake


async def rented(broker: Broker) -> PodInfo:
    """A pod rented for `m` a minute ago, as the broker has it."""
    pod = await broker.acquire("m")
    broker.pods[pod.name] = msgspec.structs.replace(pod, created_at=pod.created_at - 60)
    return broker.pods[pod.name]


def pod_beat(pod: PodInfo, state: str = "ready", leaving: bool = False) -> Heartbeat:
    """Its worker's heartbeat, with `m` in `state`."""
    engine = EngineStatus(engine_id=f"{pod.name}/m", model="m", engine="llama", ops=["chat"], state=state)
    return Heartbeat(
        node_id=pod.name,
        version="t",
        seq=1,
        ts=time.time(),
        host="pod",
        capabilities=["llama"],
        pod=pod.name,
        engines=[engine],
        leaving=leaving,
    )


async def ready_pod(broker: Broker, seen_s_ago: float = 0.0):
    """A pod rented for `m` a minute ago (as the broker has it), its worker heard from with `m` ready `seen_s_ago`
    seconds ago, and marked ready."""
    pod = await rented(broker)
    hb = pod_beat(pod)
    await broker._on_heartbeat(hb, None)
    await broker.reconcile()
    assert broker.pods[pod.name].state == "ready"
    broker.heard.last[pod.name] = (time.monotonic() - seen_s_ago, hb)
    return broker.pods[pod.name]


async def test_spot_pods_are_rented_interruptible_at_the_spot_bid(env):
    broker, fake = env
    pod = await broker.acquire("m")
    rented = fake.pod(pod.pod_id)
    assert pod.spot and rented.spot and rented.gpu_type_id == "NVIDIA GeForce RTX 4090"  # the cheapest that fits
    assert pod.hourly_usd == rented.rate_hr == 0.35  # its spot price, not the on-demand 0.69


async def test_a_preempted_spot_pod_is_booked_once_to_its_last_heartbeat_and_not_replaced(env):
    broker, fake = env
    pod = await ready_pod(broker, seen_s_ago=NODE_TTL_S + 1)  # its worker went silent past the TTL
    fake.preempt(pod.pod_id, warning_s=0)
    await broker.reconcile()
    over = broker.pods[pod.name]
    assert over.state == "preempted" and "preempted" in over.error and fake.pod(pod.pod_id).status == "TERMINATED"
    assert over.ended_at == pytest.approx(time.time() - NODE_TTL_S - 1, abs=1.0)  # billed to the last heartbeat
    await broker.reconcile()
    [entry] = [e for e in await broker.money.ledger() if e.pod_id == pod.name]  # booked exactly once
    assert entry.end == over.ended_at and entry.usd == over.cost_usd
    assert [p.id for p in fake.pods()] == [pod.pod_id]  # nothing asked for another: none rented


async def test_a_preempted_spot_pod_is_booked_to_when_its_worker_said_it_was_leaving(env):
    """RunPod's SIGTERM reaches the pod's worker as RunPod takes the GPU back: the worker's first heartbeat after it
    says it is leaving, and that is when the pod stopped billing, however late the broker gives it up; the
    heartbeats of its unloads after it change nothing."""
    broker, fake = env
    pod = await ready_pod(broker)
    hb = broker.heard.last[pod.name][1]
    fake.preempt(pod.pod_id, warning_s=0)
    await broker._on_heartbeat(msgspec.structs.replace(hb, seq=2, leaving=True), None)
    said = broker.heard.left[pod.name] = time.time() - 5  # heard 5 s ago
    await broker._on_heartbeat(msgspec.structs.replace(hb, seq=3, leaving=True, engines=[]), None)
    broker.heard.last[pod.name] = (time.monotonic() - NODE_TTL_S - 1, hb)  # then quiet past the TTL
    await broker.reconcile()
    over = broker.pods[pod.name]
    assert over.state == "preempted" and over.ended_at == said
    [entry] = [e for e in await broker.money.ledger() if e.pod_id == pod.name]
    assert entry.end == said and pod.name not in broker.heard.left


async def test_a_spot_pod_preempted_before_it_was_seen_ready_is_booked_to_its_leaving(env):
    broker, fake = env
    pod = await rented(broker)
    # its first word: it is leaving (the stream it served was on before the broker saw it ready)
    await broker._on_heartbeat(pod_beat(pod, "draining", leaving=True), None)
    said = broker.heard.left[pod.name] = time.time() - 20
    fake.preempt(pod.pod_id, warning_s=0)
    await broker.reap_orphans()
    over = broker.pods[pod.name]
    assert over.state == "preempted" and over.ended_at == said  # not "now", when the scan came round


async def test_a_pod_that_says_it_is_leaving_and_heartbeats_on_does_not_end_its_bill_early(env):
    """Attack: a pod's worker claims to be leaving, then goes on serving; when RunPod later stops it, the bill runs
    to its last heartbeat, not to the claim."""
    broker, fake = env
    pod = await ready_pod(broker, seen_s_ago=NODE_TTL_S + 1)
    broker.heard.left[pod.name] = time.time() - 300  # it said so 5 minutes ago, and was heard since
    fake.preempt(pod.pod_id, warning_s=0)
    await broker.reconcile()
    over = broker.pods[pod.name]
    assert over.state == "preempted"
    assert over.ended_at == pytest.approx(time.time() - NODE_TTL_S - 1, abs=1.0)  # its last heartbeat


async def test_a_warm_floor_replaces_a_preempted_spot_pod_in_the_same_round(env):
    broker, fake = env
    pod = await ready_pod(broker, seen_s_ago=NODE_TTL_S + 1)
    broker.leases["m"] = (1, time.time() + 600)
    fake.preempt(pod.pod_id, warning_s=0)
    await broker.reconcile()
    assert broker.pods[pod.name].state == "preempted"
    [new] = [p for p in broker._live("m")]
    assert new.name != pod.name and new.spot and fake.pod(new.pod_id).spot


async def test_a_crashed_spot_pod_is_a_crash_billed_to_its_termination(env):
    broker, fake = env
    pod = await ready_pod(broker, seen_s_ago=NODE_TTL_S + 1)
    fake.crash(pod.pod_id)  # RunPod still wants it running: nobody stopped it
    await broker.reconcile()
    over = broker.pods[pod.name]
    assert over.state == "failed" and "heartbeating" in over.error
    assert over.ended_at == pytest.approx(time.time(), abs=1.0)


async def test_a_spot_pod_preempted_while_booting_is_not_taken_for_one_that_never_boots(env):
    broker, fake = env
    pod = await broker.acquire("m")
    fake.preempt(pod.pod_id, warning_s=0)
    await broker.reap_orphans()
    assert broker.pods[pod.name].state == "preempted" and fake.pod(pod.pod_id).status == "TERMINATED"


async def test_while_runpods_api_fails_renting_is_refused_at_once_and_the_outage_said_once(env, caplog):
    broker, fake = env
    caplog.set_level(logging.WARNING, logger="coderai.pod_broker")
    fake.outage(503)
    await broker.reap_orphans()  # the broker's periodic look at RunPod finds it down, after its retries
    calls = fake.request_count
    for _ in range(5):
        started = time.monotonic()
        with pytest.raises(BusError, match="RunPod's API has been failing since .* \\(injected HTTP 503\\)") as exc:
            await broker.acquire("m")
        assert exc.value.code == "no_engine" and exc.value.retryable and time.monotonic() - started < 0.5
    await broker.reap_orphans()
    assert fake.request_count == calls + broker.api.attempts  # the scan asked again; no acquisition did
    status = await broker._status(BrokerStatusRequest(), None)
    assert status.configured and status.outage.startswith("RunPod's API has been failing since")
    said = [r.getMessage() for r in caplog.records]
    assert sum("RunPod's API is failing" in m for m in said) == 1, said

    fake.outage(None)
    await broker.reap_orphans()
    assert (await broker._status(BrokerStatusRequest(), None)).outage == ""
    assert any("RunPod's API answers again" in r.getMessage() for r in caplog.records)
    assert (await broker.acquire("m")).state == "booting"
