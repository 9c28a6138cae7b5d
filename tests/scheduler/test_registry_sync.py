"""One member registry for three heads (`scheduler/registry_sync.py`), on three clustered nats-servers that each
read their own users file: a pod's user made on the leader's head logs in at the other two, a revocation there
cuts a node off at all three, and a scheduler that starts leading on a head whose files are stale takes the
cluster's registry instead of publishing its own."""

from __future__ import annotations

import contextlib
import secrets
import shutil

import msgspec

import pytest

from coderai.contracts.admin import PodUserRequest, RevokeRequest
from coderai.contracts.subjects import CMD_SCHEDULER_POD_USER, CMD_SCHEDULER_REVOKE
from coderai.runtime import members
from coderai.runtime.bus import Bus
from coderai.runtime.cluster import new_token
from coderai.runtime.embedded import NatsServer, Routes, _login_ok, free_port
from coderai.runtime.lifecycle import wait_for
from coderai.scheduler.membership import Membership
from coderai.contracts.topology import MEMBERS
from coderai.scheduler.registry_sync import REGISTRY_KEY, Follower, HeadFiles

pytestmark = pytest.mark.slow

TOKEN = new_token()


@pytest.fixture
def heads(tmp_path):
    """Three heads with one registry, as a head's join hands it over: the same service login on each."""
    routes = {n: f"127.0.0.1:{free_port()}" for n in "abc"}
    password = secrets.token_urlsafe(24)
    servers = {}
    for name, listen in routes.items():
        peers = tuple(r for n, r in routes.items() if n != name)
        servers[name] = NatsServer.secured(
            tmp_path / name, token=TOKEN, port=free_port(), cluster=Routes(f"head-{name}", listen, peers, password)
        )
    first = servers["a"]
    for s in (servers["b"], servers["c"]):
        shutil.copy(first.members_file, s.members_file)
        shutil.copy(first.users_file, s.users_file)
        s.service_password = first.service_password
    no_joins = members.load(servers["c"].members_file)  # head c was started without the cluster token
    no_joins.join_hash = ""
    members.save(servers["c"].members_file, no_joins)
    members.write_users(servers["c"].users_file, no_joins)
    try:  # every server stopped, the ones started before one that failed to start too
        for s in servers.values():
            s.start(log_file=s.data_dir / "nats.log")
        yield servers
    finally:
        for s in servers.values():
            s.stop()


def files(server: NatsServer) -> HeadFiles:
    return HeadFiles(server.members_file, server.users_file, server.pid_file)


async def _connected(stack: contextlib.AsyncExitStack, server: NatsServer, name: str) -> Bus:
    async def ready() -> bool:  # JetStream answers once the three have elected their meta leader
        try:
            await bus.js.account_info()
            return True
        except Exception:  # still forming
            return False

    bus = await Bus.connect(server.service_url, name)
    stack.push_async_callback(bus.close)
    await wait_for(ready, 30, what=f"JetStream on {name}")
    return bus


async def _login(server: NatsServer, user: str, password: str, want: bool = True) -> None:
    await wait_for(
        lambda: _login_ok(server.url, user, password) == want,
        20.0,
        interval_s=0.05,
        what=f"{user}'s login at {server.data_dir.name} to be {'taken' if want else 'refused'}",
    )


async def test_a_change_on_the_leaders_head_reaches_every_heads_nats_server(heads):
    a, b, c = heads["a"], heads["b"], heads["c"]
    async with contextlib.AsyncExitStack() as stack:
        bus_a = await _connected(stack, a, "scheduler-a")
        followers = []
        for server in (a, b, c):
            f = Follower(await _connected(stack, server, f"registry-{server.data_dir.name}"), files(server))
            await f.start(stack)
            followers.append(f)
        m = Membership(bus_a, TOKEN, str(a.members_file), str(a.users_file), str(a.pid_file))
        await m.start(stack)

        pod = await bus_a.request(CMD_SCHEDULER_POD_USER, PodUserRequest(pod_id="pod-1", ttl_s=3600))
        for server in (a, b, c):
            await _login(server, pod.user, pod.password)
        assert members.load(c.members_file).members["pod-1"].kind == "pod"
        assert members.load(c.members_file).join_hash == ""  # its own logins stay its own: nobody joins through c

        await bus_a.request(CMD_SCHEDULER_REVOKE, RevokeRequest(node_id="pod-1"))
        for server in (a, b, c):
            await _login(server, pod.user, pod.password, want=False)
        assert "pod-1" in members.load(b.members_file).revoked
        assert all(f.applied >= 2 for f in followers[1:])  # the other heads' files were written by their followers


async def test_a_new_leader_with_stale_files_takes_the_clusters_registry(heads):
    a, b = heads["a"], heads["b"]
    async with contextlib.AsyncExitStack() as stack:
        bus_a, bus_b = await _connected(stack, a, "scheduler-a"), await _connected(stack, b, "scheduler-b")
        first = contextlib.AsyncExitStack()
        m = Membership(bus_a, TOKEN, str(a.members_file), str(a.users_file), str(a.pid_file))
        await m.start(first)
        pod = await bus_a.request(CMD_SCHEDULER_POD_USER, PodUserRequest(pod_id="pod-2", ttl_s=3600))
        await wait_for(lambda: _in_bucket(bus_a, "pod-2"), 20, what="the registry with pod-2 in the bucket")
        await first.aclose()  # head a's scheduler stops; b never followed (no follower ran there): stale files
        assert "pod-2" not in members.load(b.members_file).members

        nxt = Membership(bus_b, TOKEN, str(b.members_file), str(b.users_file), str(b.pid_file))
        await nxt.start(stack)
        assert "pod-2" in members.load(b.members_file).members  # taken from the bucket, not overwritten by b's
        await _login(b, pod.user, pod.password)


async def _in_bucket(bus: Bus, node_id: str) -> bool:
    import msgspec

    entry = await (await bus.kv(MEMBERS)).get(REGISTRY_KEY)
    return node_id in msgspec.json.decode(entry.value, type=members.Registry).members


def test_the_echo_of_an_older_registry_does_not_undo_a_newer_one(tmp_path):
    """A head's follower sees its own leader's changes come back from the bucket, possibly after it has made the
    next one: a registry no newer than the head's own is left alone (its files, its nats-server untouched)."""
    reg, _ = members.new_registry(TOKEN)
    members.add_node(reg, "n1")
    reg.version = 5
    head = HeadFiles(tmp_path / "members.json", tmp_path / "users.conf", None)  # no nats-server: none to reload
    members.save(head.members_file, reg)
    older = msgspec.structs.replace(reg, members={}, version=4)
    assert head.write(older) is False and head.write(msgspec.structs.replace(older, version=5)) is False
    assert "n1" in members.load(head.members_file).members
