"""Each head service logs in to NATS as a user of its own with only the subjects it needs (issue 40, item 11), on a
real stack: a secured nats-server (its users rendered by runtime/members.py), router, scheduler, metrics, a pod
broker (on a fake RunPod), a gateway and a worker `w1`.

Logged in with one service's credentials (as an attacker holding that service's process would be), each test
tries what only other services (or nodes) may do, prints each attack and its verdict, and checks that nothing
changed; then that the stack still serves. A control tries two of the attacks as `service` (every right, the
login every service shared before): they are not refused, so these tests fail against a shared login.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any

import httpx
import nats
import pytest

from coderai.accounts.keyfile import KeyRecord, hash_key, write_keys
from coderai.contracts import Assignment, decode
from coderai.contracts.leaders import LeaderRecord
from coderai.contracts.topology import AFFINITY, ASSIGNMENTS, EVENTS, LEADERS, MEMBERS
from coderai.runtime import members
from coderai.runtime.bus import Bus
from coderai.runtime.kv import list_keys
from coderai.runtime.lifecycle import wait_for
from coderai.testing.fake_runpod import FakeRunPod
from coderai.testing.hostile import Node
from coderai.testing.stack import running_stack

pytestmark = pytest.mark.slow

ADMIN_KEY = "sk-test-admin-service-users-0123456789"
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
REFUSED_LOG = "NATS refused"  # what a connection logs (at ERROR) when the server refuses it a subject


@pytest.fixture(scope="module")
def stack(tmp_path_factory, redis_server, tiny_gguf):
    root = tmp_path_factory.mktemp("service-users")
    keys = root / "keys.toml"
    write_keys(str(keys), [KeyRecord(name="admin", sha256=hash_key(ADMIN_KEY), scopes=["inference", "admin"])])
    models = [{"name": "tiny", "engine": "llama", "path": str(tiny_gguf), "params": {"n_ctx": 256}, "nodes": ["w1"]}]
    fake = FakeRunPod().start()  # no pod is rented here: the broker answers status and leases
    try:
        with running_stack(
            root,
            models,
            gateway_args=("--api-keys-file", str(keys)),
            redis_url=redis_server.url,
            extra_env={"CODERAI_GATEWAY_REDIS_URL": redis_server.url},
            headers=ADMIN,
        ) as s:
            s.start(
                "pod-broker",
                "coderai.pod_broker",
                env={
                    "CODERAI_POD_BROKER_RUNPOD_API_KEY": fake.api_key,
                    "CODERAI_POD_BROKER_RUNPOD_API_BASE": fake.base_url,
                    "CODERAI_POD_BROKER_REDIS_URL": redis_server.url,
                    "CODERAI_POD_BROKER_POD_NATS_URL": s.nats.url,
                    "CODERAI_POD_BROKER_DEPLOYMENT": "svcusers",
                },
            )
            yield s
    finally:
        fake.close()


@contextlib.asynccontextmanager
async def login(url: str, role: str = ""):
    """A raw connection with `url`'s credentials (a service's inbox prefix for a service), collecting the
    server's permission errors."""
    errors: list[str] = []

    async def on_error(exc: Exception) -> None:
        errors.append(str(exc))

    kw = {"inbox_prefix": members.service_inbox(role)} if role else {}
    nc = await nats.connect(url, error_cb=on_error, connect_timeout=5, allow_reconnect=False, **kw)
    try:
        yield Node(nc, errors)
    finally:
        await nc.close()


def _verdict(who: str, attack: str, result: tuple[bool, str]) -> bool:
    refused, detail = result
    print(f"as {who or 'service'}: {attack}: {'refused' if refused else 'SUCCEEDED'} ({detail})")
    return refused


async def _attacks(url: str, role: str, pubs: dict[str, str], subs: dict[str, str]) -> list[str]:
    """Each publish in `pubs` and subscription in `subs` (subject: what it would do) tried as `role`; the ones that
    were not refused."""
    succeeded = []
    async with login(url, role) as node:
        for subject, what in pubs.items():
            if not _verdict(role, f"{what} (publish {subject})", await node.pub_refused(subject, b'{"x": 1}')):
                succeeded.append(subject)
        for subject, what in subs.items():
            if not _verdict(role, f"{what} (subscribe {subject})", await node.sub_refused(subject)):
                succeeded.append(subject)
    return succeeded


async def _state(url: str) -> tuple[Assignment, str, int]:
    """(w1's assignment, the scheduler's lease holder and fencing token), read as `service`."""
    bus = await Bus.connect(url, "test-reader")
    try:
        assignment = decode((await (await bus.kv(ASSIGNMENTS)).get("w1")).value, Assignment)
        lease = decode((await (await bus.kv(LEADERS)).get("scheduler")).value, LeaderRecord)
        return assignment, lease.holder, lease.token
    finally:
        await bus.close()


def _chat(stack, **headers: str) -> httpx.Response:
    return httpx.post(
        f"{stack.base_url}/chat/completions",
        headers=ADMIN | headers,
        timeout=60,
        json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
    )


def test_the_gateways_user_cannot_do_what_only_other_services_may(stack):
    before = asyncio.run(_state(stack.nats.service_url))
    succeeded = asyncio.run(
        _attacks(
            stack.nats.role_url("gateway"),
            "gateway",
            pubs={
                f"$KV.{ASSIGNMENTS.name}.w1": "write w1's assignment (the scheduler's bucket)",
                f"$KV.{MEMBERS.name}.registry": "write the member registry every head's nats-server follows",
                f"$KV.{LEADERS.name}.scheduler": "take the scheduler's leader lease",
                "coderai.hb.w1": "publish node w1's heartbeat",
                "coderai.cmd.node.w1.train": "send w1 a command only the scheduler sends",
                "_S.scheduler.forged.reply": "answer into the scheduler's inbox, unasked",
                "_INBOX.forged.reply": "answer into another connection's inbox, unasked",
                "coderai.cmd.scheduler.revoke": "revoke a node (the operator's and the pod broker's command)",
                "coderai.cmd.scheduler.pod_user": "make a pod's NATS user",
                "$JS.API.CONSUMER.CREATE.WORK.thief.coderai.work.x.chat": "take fan-out parts from the nodes' work queue",
                f"$JS.API.STREAM.DELETE.KV_{ASSIGNMENTS.name}": "delete the assignments bucket",
                # its routing copy reads these two (gateway/picker.py), and writes nothing there
                f"$JS.API.STREAM.UPDATE.KV_{ASSIGNMENTS.name}": "change the assignments bucket (a TTL would empty it)",
                "$KV.coderai_pods.p1": "write a pod's record (the pod broker's bucket)",
                "coderai.evt.engine.ready.tiny": "announce an engine in the router's place",
            },
            subs={
                "coderai.engine.>": "receive every engine's jobs",
                "coderai.cmd.scheduler.>": "answer scheduler commands in its place",
                "coderai.route.pick": "answer route picks in the router's place",
                "_S.scheduler.>": "read the scheduler's replies",
                "_INBOX.>": "read other connections' replies",
                "coderai.cmd.node.>": "receive the commands sent to nodes",
            },
        )
    )
    assert succeeded == []
    assert asyncio.run(_state(stack.nats.service_url)) == before, "an attack changed the assignment or the lease"
    assert _chat(stack).status_code == 200


def test_the_routers_user_cannot_write_what_it_only_reads(stack):
    before = asyncio.run(_state(stack.nats.service_url))
    succeeded = asyncio.run(
        _attacks(
            stack.nats.role_url("router"),
            "router",
            pubs={
                f"$KV.{ASSIGNMENTS.name}.w1": "write w1's assignment",
                "$KV.coderai_models.tiny": "rewrite a model's config",
                "$KV.coderai_keys.x": "write an API key record",
                "$KV.coderai_nodes.w1": "write w1's membership record",
                f"$JS.API.STREAM.UPDATE.KV_{ASSIGNMENTS.name}": "change the assignments bucket (a TTL would empty it)",
                "$JS.API.STREAM.PURGE.KV_coderai_models": "purge the models bucket",
                "coderai.evt.request.completed": "publish a forged usage event (billing)",
                "coderai.engine.w1.x.chat": "send an engine a job",
            },
            subs={
                "coderai.cmd.blob.read": "serve nodes' blob reads in the gateway's place",
                "_S.gateway.>": "read the gateway's replies (tenants' answers)",
            },
        )
    )
    assert succeeded == []
    assert asyncio.run(_state(stack.nats.service_url)) == before
    assert _chat(stack).status_code == 200


def test_metrics_user_cannot_publish_jobs_or_take_a_lease(stack):
    before = asyncio.run(_state(stack.nats.service_url))
    succeeded = asyncio.run(
        _attacks(
            stack.nats.role_url("metrics"),
            "metrics",
            pubs={
                "coderai.engine.w1.x.chat": "send an engine a chat job",
                "coderai.work.tiny.embed": "queue a fan-out part",
                "coderai.route.pick": "ask the router for an engine",
                "coderai.evt.request.completed": "publish a forged usage event (billing)",
                f"$KV.{LEADERS.name}.scheduler": "take the scheduler's leader lease",
                f"$KV.{LEADERS.name}.pod-broker": "take the pod broker's leader lease",
                "coderai.cmd.broker.acquire": "rent a pod",
            },
            subs={"coderai.engine.>": "receive every engine's jobs"},
        )
    )
    assert succeeded == []
    assert asyncio.run(_state(stack.nats.service_url)) == before


def test_the_pod_brokers_user_cannot_drive_nodes_or_placement(stack):
    before = asyncio.run(_state(stack.nats.service_url))
    succeeded = asyncio.run(
        _attacks(
            stack.nats.role_url("pod-broker"),
            "pod-broker",
            pubs={
                "coderai.cmd.node.w1.drain": "drain node w1",
                "coderai.cmd.scheduler.place": "place a model",
                f"$KV.{ASSIGNMENTS.name}.w1": "write w1's assignment",
                f"$KV.{LEADERS.name}.scheduler": "take the scheduler's leader lease",
                "coderai.evt.request.completed": "publish a forged usage event (billing)",
            },
            subs={"coderai.engine.>": "receive every engine's jobs"},
        )
    )
    assert succeeded == []
    assert asyncio.run(_state(stack.nats.service_url)) == before


def test_control_the_shared_service_login_was_refused_none_of_it(stack):
    """The same attacks as `service` (what every service logged in as before): not refused, so the tests above
    would fail against it."""
    succeeded = asyncio.run(
        _attacks(
            stack.nats.service_url,
            "",
            pubs={"_S.scheduler.forged.reply": "answer unasked"},
            subs={"coderai.engine.>": "receive every engine's jobs"},
        )
    )
    assert succeeded == ["_S.scheduler.forged.reply", "coderai.engine.>"]


def test_a_refused_publish_is_logged_at_error_with_its_subject(stack, caplog):
    """A right a service lacks shows up loudly (runtime/nats_conn.py), not as a message that silently never
    arrived."""

    async def go() -> None:
        bus = await Bus.connect(stack.nats.role_url("router"), "router-test")
        try:
            await bus.nc.publish("coderai.hb.w1", b"{}")
            await bus.nc.flush()
            deadline = time.monotonic() + 10
            while not any("coderai.hb.w1" in r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR):
                assert time.monotonic() < deadline, "no ERROR line for the refused publish"
                await asyncio.sleep(0.02)  # a poll with a deadline (asserted above)
        finally:
            await bus.close()

    with caplog.at_level(logging.ERROR, logger="coderai.bus"):
        asyncio.run(go())
    line = next(r.getMessage() for r in caplog.records if "coderai.hb.w1" in r.getMessage())
    print(f"logged: {line}")
    assert "svc-router" in line and "publish" in line
    assert stack.nats.service_passwords["router"] not in line  # the login is named, never its password


def test_each_service_still_does_its_job_under_its_own_user(stack):
    """Router (picks, writes affinity), scheduler (placed `tiny` on w1), metrics (its lease, its EVENTS consumer
    keeps up), pod broker (answers the gateway's status), gateway (serves, keeps keys); and no service's log says
    NATS refused it anything."""
    session = {"X-Session-Id": "service-users-session"}
    for _ in range(3):
        assert _chat(stack, **session).status_code == 200
    r = httpx.post(
        f"{stack.http_url}/admin/keys",
        headers=ADMIN,
        timeout=30,
        json={"name": "svc-users-tenant", "scopes": ["inference"]},
    )
    assert r.status_code == 201, r.text
    assert httpx.get(f"{stack.http_url}/admin/pods", headers=ADMIN, timeout=30).status_code == 200
    assert httpx.get(f"{stack.http_url}/admin/nodes", headers=ADMIN, timeout=30).status_code == 200  # heads too

    async def check() -> None:
        bus = await Bus.connect(stack.nats.service_url, "test-reader")
        try:
            assert "tiny" in {
                m.name for m in decode((await (await bus.kv(ASSIGNMENTS)).get("w1")).value, Assignment).models
            }
            affinity = await bus.kv(AFFINITY)
            started = time.monotonic()

            def left() -> float:  # the 20 s the three waits below share
                return max(0.0, 20 - (time.monotonic() - started))

            await wait_for(lambda: list_keys(affinity), left(), what="the router's affinity writes")
            leaders = await bus.kv(LEADERS)

            async def leads(role: str) -> bool:
                with contextlib.suppress(Exception):
                    return bool(decode((await leaders.get(role)).value, LeaderRecord).holder)
                return False

            for role in ("scheduler", "metrics", "pod-broker"):
                await wait_for(lambda role=role: leads(role), left(), what=f"{role} to hold its lease")
            stream = await bus.js.stream_info(EVENTS.name)

            async def caught_up() -> bool:
                return (
                    await bus.js.consumer_info(EVENTS.name, "metrics")
                ).delivered.stream_seq >= stream.state.last_seq

            await wait_for(caught_up, left(), what="metrics' EVENTS consumer to catch up")
        finally:
            await bus.close()

    asyncio.run(check())
    for name, proc in stack.procs.items():
        if name.startswith("worker"):  # a node's rights are not these (tests/security/test_hostile_node.py)
            continue
        refused = [line for line in proc.log_text().splitlines() if REFUSED_LOG in line]
        print(f"{name}: {len(refused)} refusals logged")
        assert refused == [], f"{name} lacks a right it uses: {refused[:3]}"


def test_an_answer_to_a_request_received_before_a_reload_of_the_users_still_arrives(stack):
    """nats-server forgets the replies `allow_responses` let through whenever it reloads its users (each join,
    revocation and pod): found in tests/integration/test_pods.py, where the pod broker's answer to the scheduler's
    `acquire` was refused as the pod joined. A service may answer into its askers' inboxes outright."""

    async def go() -> tuple[bytes, list[str]]:
        async with (
            login(stack.nats.role_url("gateway"), "gateway") as gw,
            login(stack.nats.role_url("router"), "router") as router,
        ):
            loop = asyncio.get_running_loop()
            answer, asked = loop.create_future(), loop.create_future()

            async def on_answer(m: Any) -> None:
                if m.data == b"after-reload" and not answer.done():
                    answer.set_result(m.data)

            async def on_ask(m: Any) -> None:
                if not asked.done():
                    asked.set_result(m)

            await gw.nc.subscribe("_S.gateway.reload-probe.*", cb=on_answer)
            await router.nc.subscribe("coderai.route.pick", cb=on_ask)
            await router.nc.flush()
            # the ask is core NATS (at most once) and not what this test is about: sent again, bounded, if it was
            # not heard (r36 lost one, once in many runs, with no error on either side), and said so
            for attempt in range(1, 4):
                await gw.nc.publish("coderai.route.pick", b"{}", reply="_S.gateway.reload-probe.1")
                await gw.nc.flush()
                try:
                    m = await asyncio.wait_for(asyncio.shield(asked), 5)
                    break
                except asyncio.TimeoutError:
                    print(f"ask {attempt} not heard in 5 s; errors: gw {gw.errors}, router {router.errors}")
            else:
                raise AssertionError(f"no ask heard in 3 tries; errors: gw {gw.errors}, router {router.errors}")
            await asyncio.to_thread(stack.nats.add_node, "reload-probe")  # users rewritten, the reload applied
            await router.nc.publish(m.reply, b"after-reload")
            await router.nc.flush()
            try:
                return await asyncio.wait_for(answer, 10), router.errors
            except asyncio.TimeoutError:
                return b"", router.errors

    got, errors = asyncio.run(go())
    print(f"the router's answer after a reload: {'arrived' if got else 'REFUSED'} {errors[-1:]}")
    assert got == b"after-reload"
