"""Per-service NATS users (runtime/members.py): each head service's own login and allow-lists, kept across
restarts, shared by the heads of a cluster, never taken from another head's registry."""

from __future__ import annotations

import contextlib
import json
import re

import bcrypt

from coderai.contracts import BusError
from coderai.runtime import members
from coderai.scheduler.registry_sync import HeadFiles


def _users(reg: members.Registry) -> dict[str, dict]:
    body = re.search(r"users = (\[.*\])\s*}\s*$", members.render(reg), re.S).group(1)
    return {u["user"]: u for u in json.loads(body)}


def test_each_service_logs_in_as_its_own_user_with_its_own_rights():
    reg, _ = members.new_registry()
    passwords = members.add_services(reg)
    users = _users(reg)
    assert len(set(passwords.values())) == len(members.SERVICE_ROLES)  # one password each, none shared
    for role in members.SERVICE_ROLES:
        user = users[members.service_user(role)]
        assert bcrypt.checkpw(passwords[role].encode(), user["password"].encode())
        assert passwords[role] not in members.render(reg)
    assert "permissions" not in users["service"] and "permissions" not in users["svc-scheduler"]
    for role in ("gateway", "router", "pod-broker", "metrics"):
        perms = users[members.service_user(role)]["permissions"]
        assert f"_S.{role}.>" in perms["subscribe"]["allow"]  # its own inbox, no other
        # into inboxes only of those whose requests it answers (an answer allowed by allow_responses alone was
        # refused once nats-server reloaded its users), never its own nor everything
        inboxes = {s for s in perms["publish"]["allow"] if s.startswith(("_INBOX", "_S.", "_N.", ">"))}
        assert (
            inboxes
            == {
                "router": {"_S.gateway.>"},
                "pod-broker": {"_S.scheduler.>", "_S.gateway.>", "_INBOX.>"},
                "gateway": {"_N.*.>"},
                "metrics": set(),
            }[role]
        )
        assert not any(s in (">", "coderai.>", "_INBOX.>") for s in perms["subscribe"]["allow"])
        assert not any(
            s.startswith("$KV.coderai_assignments") or s.startswith("$KV.coderai_members")
            for s in perms["publish"]["allow"]
        )


def test_only_writers_may_change_a_stream():
    assert members.manages("router", "KV_coderai_affinity")
    assert not members.manages("router", "KV_coderai_assignments")
    assert members.manages("gateway", "OBJ_coderai_blobs") and not members.manages("gateway", "WORK")
    assert members.manages("scheduler", "WORK") and members.manages("", "KV_coderai_members")


def test_a_services_inbox_counts_as_a_service_and_no_other_prefix_does():
    assert members.requester("_S.gateway.abc.1") == ""
    assert members.requester("_S.pod-broker.abc.1") == ""
    assert members.requester("_S.nobody.abc.1") is None
    assert members.requester("_N.w1.abc.1") == "w1"


def test_service_passwords_are_kept_across_restarts_and_made_anew_when_lost(tmp_path):
    secret = tmp_path / "secrets" / "nats-service.password"
    reg, _ = members.ensure_registry(tmp_path / "nats", secret)
    members.save(tmp_path / "nats" / "members.json", reg)
    kept = {r: members.read_secret(secret.parent / members.service_secret(r)) for r in members.SERVICE_ROLES}
    for r in members.SERVICE_ROLES:
        assert (secret.parent / members.service_secret(r)).stat().st_mode & 0o777 == 0o600
    again, _ = members.ensure_registry(tmp_path / "nats", secret)
    assert again.services == reg.services
    (secret.parent / members.service_secret("router")).unlink()
    third, _ = members.ensure_registry(tmp_path / "nats", secret)
    fresh = members.read_secret(secret.parent / members.service_secret("router"))
    assert fresh != kept["router"] and third.services["router"] != reg.services["router"]
    assert {r: third.services[r] for r in members.SERVICE_ROLES if r != "router"} == {
        r: reg.services[r] for r in members.SERVICE_ROLES if r != "router"
    }


def test_a_registry_from_another_head_keeps_this_heads_service_logins(tmp_path):
    mine, _ = members.new_registry()
    members.add_services(mine)
    theirs, _ = members.new_registry()
    members.add_services(theirs)
    theirs.version = mine.version + 1
    files = HeadFiles(tmp_path / "members.json", tmp_path / "users.conf", None)
    members.save(files.members_file, mine)
    theirs.members["n1"] = members.Member(node_id="n1", password_hash="x")
    with contextlib.suppress(BusError):  # no nats-server to reload here: the files are written first
        files.write(theirs)
    got = members.load(files.members_file)
    assert "n1" in got.members and got.services == mine.services and got.service_hash == mine.service_hash


def test_a_head_that_joins_by_invite_takes_the_services_passwords(tmp_path):
    """Every head accepts every head's services (a service reconnects to another head when its own dies)."""
    from coderai.heads import Invite, install

    first = tmp_path / "first"
    reg, password = members.ensure_registry(first / "nats", first / "secrets" / "nats-service.password")
    members.save(first / "nats" / "members.json", reg)
    sec = first / "secrets"
    invite = Invite(
        expires_at=0,
        address="10.0.0.2",
        heads=[],
        ca_pem="",
        ca_key_pem="",
        cert_pem="",
        key_pem="",
        route_password="r",
        service_password=password,
        redis_password="p",
        service_passwords={r: members.read_secret(sec / members.service_secret(r)) for r in members.SERVICE_ROLES},
        members=(first / "nats" / "members.json").read_text(),
    )
    second = tmp_path / "second"
    install(second, invite)
    joined, _ = members.ensure_registry(second / "nats", second / "secrets" / "nats-service.password")
    assert joined.services == reg.services
    for r in members.SERVICE_ROLES:
        assert members.read_secret(second / "secrets" / members.service_secret(r)) == invite.service_passwords[r]


def test_a_services_password_file_names_its_user():
    """Deployments that hand a service a password file (CODERAI_NATS_PASSWORD_FILE) log in as its owner."""
    assert members.file_user(members.service_secret("gateway")) == "svc-gateway"
    assert members.file_user("nats-svc-pod-broker.password") == "svc-pod-broker"
    assert members.file_user("nats-service.password") == "" and members.file_user("nats-svc-nobody.password") == ""


def test_a_refusal_is_an_error_naming_the_subject_and_a_nodes_jetstream_probe_a_warning(tmp_path, caplog):
    """A service's missing right is loud; a node's JetStream call refused while its grant is on its way (the
    head reloads nats-server's users a moment after it assigns a model) is a warning."""
    import asyncio
    import logging
    import time

    from coderai.runtime.bus import Bus
    from coderai.runtime.embedded import NatsServer

    async def refuse(url: str, subject: str) -> logging.LogRecord:
        bus = await Bus.connect(url, "probe")
        try:
            await bus.nc.publish(subject, b"{}")
            await bus.nc.flush()
            deadline = time.monotonic() + 10
            while True:
                found = [r for r in caplog.records if subject.lower() in r.getMessage().lower()]
                if found:
                    return found[0]
                assert time.monotonic() < deadline, f"nothing logged for {subject}"
                await asyncio.sleep(0.02)  # a poll with a deadline (asserted above)
        finally:
            await bus.close()

    with NatsServer.secured(tmp_path / "nats").start() as server, caplog.at_level(logging.WARNING, "coderai.bus"):
        node = server.add_node("n1")
        service = asyncio.run(refuse(server.role_url("metrics"), "coderai.work.m.chat"))
        hb = asyncio.run(refuse(node, "coderai.hb.n2"))
        probe = asyncio.run(refuse(node, "$JS.API.CONSUMER.INFO.WORK.work-m-embed"))
    assert service.levelno == logging.ERROR and "svc-metrics" in service.getMessage()
    assert hb.levelno == logging.ERROR and "node-n1" in hb.getMessage()
    assert probe.levelno == logging.WARNING
