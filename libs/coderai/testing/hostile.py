"""A hostile node: it joins the cluster with the token (as any node may), then tries, with its own credentials,
everything a node must not do. Run on a test host: `python -m coderai.testing.hostile --nats-url ... --token ...
--node-id evil --victim good --data-dir D`. Prints one JSON line: each attack, whether it was refused, and why.
With `--claim ID` it tries one attack only: joining with the token under member ID's id (a takeover of its identity).

An attack counts as refused when NATS answers with a permissions violation (or refuses the login), or when the
service that answers refuses it; anything else (a reply with data, a message delivered) is a success.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import hashlib
import hmac
import json
import secrets
import time
from typing import Any

import msgspec
import nats
import nats.errors

from coderai.runtime.cluster import join_password, user_of, with_user
from coderai.runtime.tls import client_context

WAIT_S = 2.0


class Node:
    """A raw connection as the joined node, collecting the server's permission errors."""

    def __init__(self, nc: Any, errors: list[str]) -> None:
        self.nc, self.errors = nc, errors

    async def _violation(self, needle: str) -> bool:
        deadline = time.monotonic() + WAIT_S
        while time.monotonic() < deadline:
            if any(needle.lower() in e.lower() for e in self.errors):
                return True
            await asyncio.sleep(0.02)
        return False

    async def sub_refused(self, subject: str) -> tuple[bool, str]:
        got: list[bytes] = []

        async def cb(m: Any) -> None:
            got.append(m.data)

        sub = await self.nc.subscribe(subject, cb=cb)
        await self.nc.flush()
        refused = await self._violation(f'subscription to "{subject}"')
        await sub.unsubscribe()
        return refused and not got, "violation" if refused else f"subscribed ({len(got)} messages)"

    async def pub_refused(self, subject: str, payload: bytes = b"{}") -> tuple[bool, str]:
        await self.nc.publish(subject, payload)
        await self.nc.flush()
        refused = await self._violation(f'publish to "{subject}"')
        return refused, "violation" if refused else "published"

    async def request_refused(self, subject: str, payload: bytes, *, error_ok: bool = True) -> tuple[bool, str]:
        """Refused by NATS (violation, no reply), or answered with an error by the service."""
        ask = asyncio.ensure_future(self.nc.request(subject, payload, timeout=WAIT_S * 2))
        violation = asyncio.ensure_future(self._violation(f'publish to "{subject}"'))
        await asyncio.wait({ask, violation}, return_when=asyncio.FIRST_COMPLETED)
        if violation.done() and violation.result():
            ask.cancel()
            return True, "violation"
        try:
            msg = await ask
        except (nats.errors.TimeoutError, nats.errors.NoRespondersError, asyncio.CancelledError) as exc:
            refused = await violation
            return refused, "violation" if refused else f"no answer ({type(exc).__name__})"
        violation.cancel()
        data = msg.data
        if error_ok and (b'"code"' in data and b'"message"' in data or (msg.headers or {}).get("Status")):
            return True, "answered with an error: " + data[:120].decode(errors="replace")
        return False, "answered: " + data[:120].decode(errors="replace")

    async def request_on_own_subject(self, subject: str, payload: bytes, node_id: str) -> tuple[bool, str]:
        """A request whose answer goes to a subject the node may subscribe to but that is not its inbox
        (`coderai.engine.<id>.x`): a service that judged the asker by "not a node inbox, so a service" would serve
        it everything."""
        reply = f"coderai.engine.{node_id}.{secrets.token_hex(8)}"
        got: asyncio.Future = asyncio.get_running_loop().create_future()

        async def cb(m: Any) -> None:
            if not got.done():
                got.set_result(m)

        sub = await self.nc.subscribe(reply, cb=cb)
        await self.nc.publish(subject, payload, reply=reply)
        try:
            msg = await asyncio.wait_for(got, WAIT_S * 2)
        except asyncio.TimeoutError:
            return True, "no answer"
        finally:
            await sub.unsubscribe()
        data = msg.data
        if b'"code"' in data and b'"message"' in data or (msg.headers or {}).get("Status"):
            return True, "answered with an error: " + data[:120].decode(errors="replace")
        return False, "answered: " + data[:120].decode(errors="replace")


async def _login_refused(url: str, user: str, password: str) -> bool:
    async def quiet(_e: Exception) -> None:
        pass

    try:  # TLS first, as the head's NATS speaks (the certificate is not what is tried here)
        nc = await nats.connect(
            with_user(url, user, password),
            connect_timeout=2,
            allow_reconnect=False,
            max_reconnect_attempts=0,
            error_cb=quiet,
            tls=client_context(),
            tls_handshake_first=True,
        )
    except Exception:  # any refusal to log in is what we want
        return True
    await nc.close()
    return False


async def attacks(
    url: str,
    token: str,
    node_id: str,
    victim: str,
    joined_url: str,
    ca_pem: str = "",
    store_files: tuple[str, ...] = (),
) -> list[dict]:
    """Every attack, each as {attack, refused, detail}. `store_files`: files of the head's store that belong to
    models and jobs of other nodes (they exist, so only a scope keeps them from this node)."""
    errors: list[str] = []

    async def on_error(e: Exception) -> None:
        errors.append(str(e))

    base_url = url
    tls = client_context(ca_pem) if ca_pem else None
    nc = await nats.connect(
        joined_url,
        inbox_prefix=f"_N.{node_id}",
        error_cb=on_error,
        connect_timeout=5,
        tls=tls,
        tls_handshake_first=tls is not None,
    )
    me = Node(nc, errors)
    out: list[dict] = []

    async def tried(name: str, result: tuple[bool, str]) -> None:
        out.append({"attack": name, "refused": bool(result[0]), "detail": result[1]})

    # 1. credentials: nothing the token gives logs in as a service or as another node
    guesses = [
        join_password(token),
        token,
        hmac.new(token.encode(), b"coderai-nats-service-v1", hashlib.sha256).hexdigest(),
    ]
    await tried(
        "derive the service credential from the token",
        (all([await _login_refused(base_url, "service", g) for g in guesses]), "every guess refused"),
    )
    my_password = user_of(joined_url)[1]
    assert not await _login_refused(base_url, f"node-{node_id}", my_password), "the control: its own login must work"
    await tried("log in as another node", (await _login_refused(base_url, f"node-{victim}", my_password), "refused"))
    await tried(
        "log in as `join` with a made-up password",
        (await _login_refused(base_url, "join", secrets.token_hex(16)), "refused"),
    )

    # 2. eavesdropping
    for subject in (
        "_INBOX.>",
        f"coderai.engine.{victim}.>",
        "coderai.engine.>",
        f"coderai.cmd.node.{victim}.>",
        "coderai.hb.*",
        "coderai.evt.>",
        "coderai.work.>",
        "coderai.reply.>",
        f"_N.{victim}.>",
        ">",
        "coderai.join.>",
        "_JOIN.>",
    ):
        await tried(f"subscribe {subject}", await me.sub_refused(subject))

    # 3. forging: gateway inboxes, another node's heartbeat and events, training uploads and reports
    await tried(
        "publish into a gateway inbox", await me.pub_refused(f"_INBOX.{secrets.token_hex(11)}.{secrets.token_hex(8)}")
    )
    await tried("publish another node's heartbeat", await me.pub_refused(f"coderai.hb.{victim}"))
    await tried("publish another node's model-loaded event", await me.pub_refused(f"coderai.evt.model.loaded.{victim}"))
    await tried(
        "publish a request-completed event (usage, spend)", await me.pub_refused("coderai.evt.request.completed")
    )
    await tried("publish a fan-out part into the work queue", await me.pub_refused("coderai.work.m.embed"))
    await tried(
        "upload an adapter as another rank",
        await me.request_refused(
            f"coderai.train.upload.ftjob-x.{victim}",
            b'{"job_id":"ftjob-x","node_id":"%s","offset":0}' % victim.encode(),
        ),
    )
    await tried(
        "upload an adapter for a job it is not rank 0 of",
        await me.request_refused(
            f"coderai.train.upload.ftjob-x.{node_id}",
            b'{"job_id":"ftjob-x","node_id":"%s","offset":0}' % node_id.encode(),
        ),
    )
    await tried("forge another rank's training report", await me.pub_refused(f"coderai.train.report.ftjob-x.{victim}"))

    # 4. blobs: no listing, reading without the name, purging, or the object store at all
    await tried("list the blob store", await me.request_refused("$JS.API.STREAM.INFO.OBJ_coderai_blobs", b""))
    await tried(
        "read any blob's metadata (a wildcard as the name)",
        await me.request_refused("$JS.API.DIRECT.GET.OBJ_coderai_blobs.$O.coderai_blobs.M.*", b""),
    )
    await tried(
        "read blob chunks by stream sequence",
        await me.request_refused("$JS.API.STREAM.MSG.GET.OBJ_coderai_blobs", b'{"seq":1}'),
    )
    await tried(
        "read blobs through a consumer on every chunk",
        await me.request_refused(
            "$JS.API.CONSUMER.CREATE.OBJ_coderai_blobs",
            b'{"stream_name":"OBJ_coderai_blobs","config":{"filter_subject":"$O.coderai_blobs.C.>"}}',
        ),
    )
    await tried("purge the blob store", await me.request_refused("$JS.API.STREAM.PURGE.OBJ_coderai_blobs", b"{}"))
    await tried(
        "overwrite a blob's metadata",
        await me.pub_refused("$O.coderai_blobs.M." + base64.urlsafe_b64encode(b"guess").decode()),
    )
    await tried(
        "read a blob whose name it was not given",
        await me.request_refused("coderai.cmd.blob.read", msgspec.json.encode({"name": secrets.token_urlsafe(24)})),
    )

    # 5. state: another node's assignment, the model registry, JetStream administration
    kv = "$JS.API.DIRECT.GET.KV_coderai_assignments.$KV.coderai_assignments"
    await tried("read another node's assignment", await me.request_refused(f"{kv}.{victim}", b""))
    await tried("read every assignment (a wildcard as the key)", await me.request_refused(f"{kv}.*", b""))
    await tried(
        "watch another node's assignment",
        await me.request_refused(
            f"$JS.API.CONSUMER.CREATE.KV_coderai_assignments.w.$KV.coderai_assignments.{victim}",
            b'{"stream_name":"KV_coderai_assignments","config":{"name":"w","filter_subject":"$KV.coderai_assignments.%s"}}'
            % victim.encode(),
        ),
    )
    await tried(
        "watch every assignment",
        await me.request_refused(
            "$JS.API.CONSUMER.CREATE.KV_coderai_assignments", b'{"stream_name":"KV_coderai_assignments","config":{}}'
        ),
    )
    await tried("write an assignment", await me.pub_refused(f"$KV.coderai_assignments.{node_id}"))
    await tried("read the model registry", await me.request_refused("$JS.API.STREAM.INFO.KV_coderai_models", b""))
    await tried("delete the WORK stream", await me.request_refused("$JS.API.STREAM.DELETE.WORK", b""))
    await tried(
        "create a stream", await me.request_refused("$JS.API.STREAM.CREATE.EVIL", b'{"name":"EVIL","subjects":[">"]}')
    )
    await tried(
        "pull the fan-out parts of a model it does not hold",
        await me.request_refused("$JS.API.CONSUMER.MSG.NEXT.WORK.work-good-tiny-embed", b'{"batch":1}'),
    )
    await tried(
        "widen a shared work consumer to every part",
        await me.request_refused(
            "$JS.API.CONSUMER.CREATE.WORK.work-good-tiny-embed.coderai.work.>",
            b'{"stream_name":"WORK","config":{"name":"work-good-tiny-embed","filter_subject":"coderai.work.>"}}',
        ),
    )
    await tried(
        "fetch a file outside the model store",
        await me.request_refused("coderai.cmd.store.fetch", b'{"path":"../../../../etc/passwd","offset":0}'),
    )

    # 6. the head's model store: only the files of the models it holds and the jobs it trains
    for path in store_files:
        await tried(
            f"fetch {path} from the store (not its model's or job's)",
            await me.request_refused(
                "coderai.cmd.store.fetch", msgspec.json.encode({"path": path, "offset": 0, "length": 64})
            ),
        )
        folder = path.rsplit("/", 1)[0]
        await tried(
            f"list the store folder {folder}",
            await me.request_refused("coderai.cmd.store.list", msgspec.json.encode({"path": folder})),
        )
        await tried(
            f"fetch {path} with the answer sent to a subject of its own, not its inbox",
            await me.request_on_own_subject(
                "coderai.cmd.store.fetch", msgspec.json.encode({"path": path, "length": 64}), node_id
            ),
        )
    await tried(
        "list the fine-tuning folder",
        await me.request_refused("coderai.cmd.store.list", msgspec.json.encode({"path": "finetune"})),
    )

    # 7. commands meant for services
    for subject in (
        "coderai.cmd.scheduler.add",
        "coderai.cmd.scheduler.place",
        "coderai.cmd.scheduler.revoke",
        "coderai.cmd.scheduler.pod_user",
        "coderai.cmd.scheduler.members",
        "coderai.cmd.scheduler.nodes",
        "coderai.cmd.scheduler.train",
        "coderai.cmd.broker.acquire",
        "coderai.cmd.broker.lease",
        "coderai.cmd.broker.status",
        "coderai.route.pick",
        f"coderai.cmd.node.{victim}.drain",
        "coderai.join.hello",
    ):
        await tried(f"request {subject}", await me.request_refused(subject, b"{}"))
    await nc.close()
    return out


async def claim(url: str, token: str, victim: str, data_dir: str) -> dict:
    """Join under `victim`'s id with nothing but the token (a fresh data dir: none of the victim's credential), as
    any token holder could: refused unless the head lets one identity be claimed again. Got in, it shows what the
    victim's login reaches (its assignment)."""
    from coderai.contracts import BusError
    from coderai.runtime.joining import JoinRefused, join

    name = f"join again under member {victim}'s id with only the token"
    try:
        joined, ca_pem = await join(url, token, victim, data_dir, wait_s=20)
    except (JoinRefused, BusError) as exc:
        return {"attack": name, "refused": True, "detail": str(exc)}
    tls = client_context(ca_pem) if ca_pem else None
    nc = await nats.connect(
        joined, inbox_prefix=f"_N.{victim}", connect_timeout=30, tls=tls, tls_handshake_first=tls is not None
    )
    try:
        msg = await nc.request(
            f"$JS.API.DIRECT.GET.KV_coderai_assignments.$KV.coderai_assignments.{victim}", b"", timeout=5
        )
        got = msg.data[:120].decode(errors="replace")
    except Exception as exc:  # the login alone is the takeover; the assignment is what it shows
        got = f"(no assignment read: {type(exc).__name__})"
    finally:
        await nc.close()
    return {"attack": name, "refused": False, "detail": f"logged in as node-{victim}; its assignment: {got}"}


async def run(args: argparse.Namespace) -> dict:
    from coderai.runtime.joining import join

    if args.claim:
        r = await claim(args.nats_url, args.token, args.claim, args.data_dir)
        return {"tried": 1, "succeeded": [] if r["refused"] else [r], "results": [r]}
    joined, ca_pem = await join(args.nats_url, args.token, args.node_id, args.data_dir)
    results = await attacks(
        args.nats_url, args.token, args.node_id, args.victim, joined, ca_pem, tuple(args.store_file)
    )
    return {"tried": len(results), "succeeded": [r for r in results if not r["refused"]], "results": results}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m coderai.testing.hostile")
    ap.add_argument("--nats-url", required=True)
    ap.add_argument("--token", required=True)
    ap.add_argument("--node-id", default="evil")
    ap.add_argument("--victim", default="")
    ap.add_argument("--data-dir", required=True)
    ap.add_argument(
        "--store-file",
        action="append",
        default=[],
        metavar="PATH",
        help="a file of the head's store this node is not given (repeatable): it tries to read it",
    )
    ap.add_argument("--claim", default="", metavar="ID", help="only try to join under member ID's id (its takeover)")
    args = ap.parse_args(argv)
    print(json.dumps(asyncio.run(run(args))))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
