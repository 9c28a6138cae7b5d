"""The head's membership against a real nats-server it reloads: a join with the token gives a login of the
node's own; a wrong token, a replayed or transplanted answer and a revoked id get nothing; pods' users end."""

from __future__ import annotations

import asyncio
import contextlib
import json

import pytest

from coderai.contracts import BusError
from coderai.contracts.admin import JoinHello, JoinProof, PodUserRequest, RevokeRequest
from coderai.contracts.subjects import CMD_SCHEDULER_POD_USER, CMD_SCHEDULER_REVOKE, JOIN_HELLO, JOIN_PROVE
from coderai.runtime.joining import JoinRefused, join
from coderai.runtime import members
from coderai.runtime.bus import Bus
from coderai.runtime.nats_conn import close_nats
from coderai.runtime.cluster import JOIN_USER, join_password, member_proof, new_token, node_proof, nonce, with_user
from coderai.runtime.embedded import NatsServer, _login_ok
from coderai.runtime.lifecycle import wait_for
from coderai.scheduler.membership import Membership

TOKEN = new_token()


@pytest.fixture
async def head(tmp_path):
    with NatsServer.secured(tmp_path / "nats", token=TOKEN).start() as server:  # stopped whatever happened
        async with contextlib.AsyncExitStack() as stack:
            bus = await Bus.connect(server.service_url, "scheduler")
            stack.push_async_callback(bus.close)
            m = Membership(bus, TOKEN, str(server.members_file), str(server.users_file), str(server.pid_file))
            await m.start(stack)
            yield server, bus, m


async def _as_joiner(server) -> Bus:
    return await Bus.connect(
        with_user(server.url, JOIN_USER, join_password(TOKEN)),
        "joiner",
        inbox_prefix=f"{members.JOIN_INBOX}.{nonce()}",
        connect_timeout_s=5,
    )


async def _wait_login(url: str, user: str, password: str, want: bool = True) -> None:
    await wait_for(
        lambda: _login_ok(url, user, password) == want,
        5.0,
        interval_s=0.02,
        what=f"the login of {user} to be {'taken' if want else 'refused'}",
    )


async def test_a_join_gives_the_node_a_login_of_its_own(head, tmp_path):
    server, _, _ = head
    url, ca = await join(server.url, TOKEN, "n1", str(tmp_path / "n1"))
    assert ca == ""  # this server has no TLS (the cluster tests run the head with it)
    user, password = members.node_user("n1"), url.split(":")[2].split("@")[0]
    await _wait_login(server.url, user, password)
    assert "n1" in members.load(server.members_file).members
    assert password not in server.users_file.read_text()  # the head has its hash only


async def test_a_wrong_token_gets_no_login_and_no_answer(head, tmp_path):
    server, _, _ = head
    with pytest.raises(BusError):  # the join user's password comes from the token: NATS refuses the login
        await join(server.url, new_token(), "n2", str(tmp_path / "n2"), timeout_s=2)
    assert "n2" not in members.load(server.members_file).members


async def test_a_replayed_or_transplanted_answer_is_refused(head):
    server, _, _ = head
    bus = await _as_joiner(server)
    try:
        mine = nonce()
        ch = await bus.request(JOIN_HELLO, JoinHello(node_id="n3", nonce=mine))
        ph = members.hash_password("pw-of-n3")
        proof = JoinProof(
            node_id="n3",
            nonce=mine,
            head_nonce=ch.nonce,
            password_hash=ph,
            proof=node_proof(TOKEN, "n3", mine, ch.nonce, ph),
        )
        stolen = JoinProof(node_id="n4", nonce=mine, head_nonce=ch.nonce, password_hash=ph, proof=proof.proof)
        with pytest.raises(BusError, match="no such join challenge"):  # the challenge was for n3
            await bus.request(JOIN_PROVE, stolen)
        ch = await bus.request(JOIN_HELLO, JoinHello(node_id="n3", nonce=mine))
        other = members.hash_password("the attacker's")  # the answer binds the password hash too
        with pytest.raises(BusError, match="proof is wrong"):
            await bus.request(
                JOIN_PROVE,
                JoinProof(
                    node_id="n3",
                    nonce=mine,
                    head_nonce=ch.nonce,
                    password_hash=other,
                    proof=node_proof(TOKEN, "n3", mine, "0" * 32, other),
                ),
            )
        ch = await bus.request(JOIN_HELLO, JoinHello(node_id="n3", nonce=mine))
        good = JoinProof(
            node_id="n3",
            nonce=mine,
            head_nonce=ch.nonce,
            password_hash=ph,
            proof=node_proof(TOKEN, "n3", mine, ch.nonce, ph),
        )
        assert (await bus.request(JOIN_PROVE, good)).user == "node-n3"
        with pytest.raises(BusError, match="no such join challenge"):  # the same answer again
            await bus.request(JOIN_PROVE, good)
    finally:
        await bus.close()


async def test_a_revoked_node_is_cut_off_and_may_not_join_again(head, tmp_path):
    server, bus, _ = head
    url, _ = await join(server.url, TOKEN, "n5", str(tmp_path / "n5"))
    node = await Bus.connect(url, "n5", inbox_prefix=members.node_inbox("n5"), connect_timeout_s=10)
    try:
        reply = await bus.request(CMD_SCHEDULER_REVOKE, RevokeRequest(node_id="n5"))
        assert "n5" in reply.revoked and all(m.node_id != "n5" for m in reply.members)
        await wait_for(
            lambda: not node.connected, 20.0, interval_s=0.02, what="the reload to disconnect a removed user"
        )
    finally:
        await close_nats(node.nc)  # while nats-py retries the refused login
    with pytest.raises(JoinRefused, match="was revoked"):
        await join(server.url, TOKEN, "n5", str(tmp_path / "n5b"))
    await bus.request(CMD_SCHEDULER_REVOKE, RevokeRequest(node_id="n5", forget=True))
    await join(server.url, TOKEN, "n5", str(tmp_path / "n5c"))


async def test_a_members_id_is_held_by_its_credential_not_claimed_with_the_token(head, tmp_path):
    server, bus, _ = head
    url, _ = await join(server.url, TOKEN, "n6", str(tmp_path / "n6"))
    password = url.split(":")[2].split("@")[0]
    held = members.load(server.members_file).members["n6"].password_hash
    # a token holder under n6's id: with no credential of n6's, or a made-up proof, it is refused
    with pytest.raises(JoinRefused, match="n6 is already a member.*revoke n6 --forget"):
        await join(server.url, TOKEN, "n6", str(tmp_path / "claim"))
    joiner = await _as_joiner(server)
    try:
        mine = nonce()
        ch = await joiner.request(JOIN_HELLO, JoinHello(node_id="n6", nonce=mine))
        assert ch.member_salt == held[:29]
        ph = members.hash_password("the attacker's")
        forged = member_proof(members.hash_password("a guess"), "n6", mine, ch.nonce, ph)
        with pytest.raises(BusError, match="already a member"):
            await joiner.request(
                JOIN_PROVE,
                JoinProof(
                    node_id="n6",
                    nonce=mine,
                    head_nonce=ch.nonce,
                    password_hash=ph,
                    proof=node_proof(TOKEN, "n6", mine, ch.nonce, ph),
                    member_proof=forged,
                ),
            )
    finally:
        await joiner.close()
    assert members.load(server.members_file).members["n6"].password_hash == held
    assert "user" not in json.loads((tmp_path / "claim" / "node-credentials.json").read_text())  # no welcome came
    await _wait_login(server.url, "node-n6", password)  # the member keeps its login
    # the node itself, holding its saved credential, joins again (a restart that could not log in at once)
    url2, _ = await join(server.url, TOKEN, "n6", str(tmp_path / "n6"))
    assert members.load(server.members_file).members["n6"].password_hash != held
    await _wait_login(server.url, "node-n6", url2.split(":")[2].split("@")[0])
    # a join whose welcome never came back: the head holds the new password, the node kept it as pending
    pending = members.new_password()
    pending_hash = members.hash_password(pending)
    creds = tmp_path / "n6" / "node-credentials.json"
    creds.write_text(
        json.dumps({**json.loads(creds.read_text()), "pending": {"password": pending, "password_hash": pending_hash}})
    )
    with members.file_lock(server.members_file):
        reg = members.load(server.members_file)
        reg.members["n6"].password_hash = pending_hash
        members.save(server.members_file, reg)
    await join(server.url, TOKEN, "n6", str(tmp_path / "n6"))
    assert "pending" not in json.loads(creds.read_text())
    # an operator re-admits the id: the member record goes, and a machine without the credential joins afresh
    reply = await bus.request(CMD_SCHEDULER_REVOKE, RevokeRequest(node_id="n6", forget=True))
    assert all(m.node_id != "n6" for m in reply.members) and "n6" not in reply.revoked
    await join(server.url, TOKEN, "n6", str(tmp_path / "reinstalled"))


async def test_a_pods_user_ends_with_its_time(head):
    server, bus, m = head
    pod = await bus.request(CMD_SCHEDULER_POD_USER, PodUserRequest(pod_id="coderai-x-big-abc123", ttl_s=3600))
    assert pod.user == "pod-coderai-x-big-abc123"
    await _wait_login(server.url, pod.user, pod.password)
    assert await m.sweep(now=pod.expires_at + 1) == ["coderai-x-big-abc123"]
    await _wait_login(server.url, pod.user, pod.password, want=False)


async def _once(url: str, **kw):
    """One connection attempt, no retries (nats-py's own)."""
    import nats

    nc = await nats.connect(url, connect_timeout=2, allow_reconnect=False, max_reconnect_attempts=0, **kw)
    await nc.close()


async def test_over_tls_the_worker_pins_the_ca_it_was_given_and_refuses_another(tmp_path):
    from coderai.runtime.tls import client_context, ensure_certs, fingerprint

    certs = ensure_certs(tmp_path / "tls")
    server = NatsServer.secured(tmp_path / "nats", token=TOKEN, tls=certs).start()
    other = None
    try:
        async with contextlib.AsyncExitStack() as stack:
            bus = await Bus.connect(server.service_url, "scheduler", tls=client_context(certs.ca_pem))
            stack.push_async_callback(bus.close)
            await Membership(
                bus, TOKEN, str(server.members_file), str(server.users_file), str(server.pid_file), ca_pem=certs.ca_pem
            ).start(stack)
            url, ca = await join(server.url, TOKEN, "t1", str(tmp_path / "t1"))
            assert ca == certs.ca_pem and fingerprint(ca) == certs.fingerprint
            node = await Bus.connect(
                url, "t1", inbox_prefix=members.node_inbox("t1"), tls=client_context(ca), connect_timeout_s=10
            )
            await node.close()
            # a server with the same users but a certificate of another CA (a fake head at that address) is refused
            other = NatsServer(
                tmp_path / "other", users_file=server.users_file, tls=ensure_certs(tmp_path / "other-tls")
            ).start()
            fake = url.replace(f":{server.port}", f":{other.port}")
            with pytest.raises(Exception, match="certificate verify failed|CERTIFICATE_VERIFY_FAILED"):
                await asyncio.wait_for(_once(fake, tls=client_context(ca), tls_handshake_first=True), 10)
            # and without TLS nothing gets in, not even the login
            with pytest.raises(Exception):
                await asyncio.wait_for(_once(url), 10)
    finally:
        server.stop()
        if other is not None:
            other.stop()


async def test_a_welcome_names_every_head_this_head_knows_and_a_node_keeps_the_ones_it_reaches(head, tmp_path):
    """The welcome lists the heads the bucket reads and those this head's file names (here no bucket answers, as a
    short read on a busy head once gave a node only the head it joined: restarted while that head was dead, it
    reached no other). A head the node's saved login reaches later is kept in its list too."""
    from coderai.runtime.joining import remember_head, saved_url
    from coderai.stack.heads import Head, save

    server, _, _ = head
    save(tmp_path, [Head("h1", "10.9.0.1"), Head("h2", "10.9.0.2")])  # this head's data dir is tmp_path
    url, _ = await join(server.url, TOKEN, "n2", str(tmp_path / "n2"))
    creds = tmp_path / "n2" / "node-credentials.json"
    assert json.loads(creds.read_text())["heads"] == ["nats://10.9.0.1:4222", "nats://10.9.0.2:4222"]

    assert remember_head(str(tmp_path / "n2"), "n2", "nats://10.9.0.3:4222")  # a head that joined later
    assert not remember_head(str(tmp_path / "n2"), "n2", "nats://10.9.0.3:4222")  # known now
    assert not remember_head(str(tmp_path / "n2"), "n3", "nats://10.9.0.4:4222")  # another node's file: untouched
    saved = json.loads(creds.read_text())
    assert saved["heads"] == ["nats://10.9.0.1:4222", "nats://10.9.0.2:4222", "nats://10.9.0.3:4222"]
    assert saved["password"] == url.split(":")[2].split("@")[0]  # the login kept as it was
    dial, _ = saved_url(str(tmp_path / "n2"), server.url, "n2")
    assert dial.split(",")[1:] == saved["heads"]  # every head after the one it joined
