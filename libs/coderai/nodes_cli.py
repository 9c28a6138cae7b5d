"""`coderai nodes`: the members of this cluster (nodes that joined, pods), and revoking one; `coderai token new`."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from pathlib import Path

from coderai.runtime.cluster import new_token
from coderai.stack.local import head_bus


async def _ask(args: argparse.Namespace, subject, msg):
    """One request to the head's scheduler as a service: --nats-url with CODERAI_NATS_PASSWORD_FILE (and
    CODERAI_NATS_CA for TLS), else the `coderai up` running on --data-dir."""
    data = Path(os.path.expanduser(args.data_dir)).resolve()
    try:
        bus = await head_bus("coderai-nodes", args.nats_url, data)
    except (OSError, KeyError, ValueError):
        raise SystemExit(
            f"coderai nodes: no running `coderai up` in {data}: pass --nats-url (and "
            "CODERAI_NATS_PASSWORD_FILE) or --data-dir"
        ) from None
    try:
        return await bus.request(subject, msg, timeout=10.0)
    finally:
        await bus.close()


def nodes_main(argv: list[str] | None = None) -> int:
    from coderai.contracts import BusError
    from coderai.contracts.admin import MembersRequest, RevokeRequest
    from coderai.contracts.subjects import CMD_SCHEDULER_MEMBERS, CMD_SCHEDULER_REVOKE

    ap = argparse.ArgumentParser(prog="coderai nodes", description=(__doc__ or "").partition("\n")[0])
    ap.add_argument("--data-dir", default=os.environ.get("CODERAI_DATA_DIR", "~/.coderai"))
    ap.add_argument("--nats-url", default="")
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("list", help="members: nodes that joined, pods, and the revoked ids")
    r = sub.add_parser("revoke", help="end a node's credentials now (it is disconnected and may not join again)")
    r.add_argument("node_id")
    r.add_argument(
        "--forget",
        action="store_true",
        help="also let this id join again later, afresh (a machine that lost its credential)",
    )
    args = ap.parse_args(argv)
    msg = MembersRequest() if args.cmd == "list" else RevokeRequest(node_id=args.node_id, forget=args.forget)
    try:
        reply = asyncio.run(_ask(args, CMD_SCHEDULER_MEMBERS if args.cmd == "list" else CMD_SCHEDULER_REVOKE, msg))
    except BusError as exc:
        print(f"coderai nodes: {exc.message}", file=sys.stderr)
        return 1
    now = time.time()
    for m in reply.members:
        left = f", {max(0, m.expires_at - now) / 3600:.1f} h left" if m.expires_at else ""
        print(
            json.dumps(
                {
                    "node_id": m.node_id,
                    "kind": m.kind,
                    "joined": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(m.joined_at)),
                }
            )
            + (f"  # {m.kind}{left}" if left else "")
        )
    if reply.revoked:
        print(json.dumps({"revoked": reply.revoked}))
    return 0


def token_main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="coderai token", description="make a cluster token (256 random bits)")
    ap.add_argument("cmd", choices=["new"])
    ap.parse_args(argv)
    print(new_token())
    return 0
