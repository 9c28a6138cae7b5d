"""`coderai heads invite`: an invite, made on a running head, that makes another machine a head of this cluster."""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from pathlib import Path

import msgspec

from coderai.runtime import members
from coderai.stack.ha import known
from coderai.stack.heads import INVITE_TTL_S, Head, Invite, head_certificate, load, merge, write_private
from coderai.stack.local import service_bus
from coderai.stack.plan import token_from_env


def invite_main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(
        prog="coderai heads invite", description="make an invite that makes another machine a head of this cluster"
    )
    ap.add_argument(
        "--data-dir",
        default=os.environ.get("CODERAI_DATA_DIR", "~/.coderai"),
        help="this head's data dir (its `coderai up` must be running)",
    )
    ap.add_argument("--address", required=True, help="the new head's address, as the other heads reach it")
    ap.add_argument(
        "--out", required=True, help="where to write the invite (mode 0600: it holds the cluster's secrets)"
    )
    ap.add_argument("--ttl", type=float, default=INVITE_TTL_S, help="seconds the invite is good for (default 3600)")
    ap.add_argument(
        "--cluster-token",
        default=None,
        help="the cluster token, so the new head answers workers' joins (default: this head's)",
    )
    args = ap.parse_args(argv)
    token_from_env(ap, args)
    data = Path(os.path.expanduser(args.data_dir)).resolve()
    tls, sec = data / "nats" / "tls", data / "secrets"
    if not (tls / "ca-key.pem").exists() or not (sec / "route.password").exists():
        print(
            f"coderai heads invite: {data} is not a head's data dir (run `coderai up --head --address ...` first)",
            file=sys.stderr,
        )
        return 2
    token = args.cluster_token or (
        members.read_secret(sec / "cluster.token") if (sec / "cluster.token").exists() else ""
    )
    cert, key = head_certificate((tls / "ca.pem").read_text(), (tls / "ca-key.pem").read_text(), args.address)
    expires_at = time.time() + args.ttl

    async def go() -> list[Head]:
        bus = await service_bus(data, "heads-invite")
        try:
            return await asyncio.wait_for(known(bus), 10)
        finally:
            await bus.close()

    try:
        heads = asyncio.run(go())
    except Exception:  # a first head's JetStream answers once a second head is up: it alone, then
        heads = []
    models, keys = data / "models.toml", data / "keys.toml"
    invite = Invite(
        expires_at=expires_at,
        address=args.address,
        heads=merge(load(data), heads),
        ca_pem=(tls / "ca.pem").read_text(),
        ca_key_pem=(tls / "ca-key.pem").read_text(),
        cert_pem=cert,
        key_pem=key,
        route_password=members.read_secret(sec / "route.password"),
        service_password=members.read_secret(sec / "nats-service.password"),
        service_passwords={
            role: members.read_secret(sec / members.service_secret(role))
            for role in members.SERVICE_ROLES
            if (sec / members.service_secret(role)).exists()
        },
        redis_password=members.read_secret(sec / "redis.password"),
        cluster_token=token,
        members=(data / "nats" / "members.json").read_text(),
        models=models.read_text() if models.exists() else "",
        keys=keys.read_text() if keys.exists() else "",
        seal_key=members.ensure_secret(sec / "reasoning-seal.key"),
        blob_url_key=members.ensure_secret(sec / "blob-url.key"),
    )
    write_private(Path(args.out), msgspec.json.encode(invite))
    print(
        f"invite for a head at {args.address} written to {args.out} (good for {args.ttl:.0f} s; it holds the "
        "cluster's keys: copy it privately, delete it once used).\n"
        f"Copy it there privately and run: coderai up --head --address {args.address} --join {args.out}"
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["invite"]:
        return invite_main(argv[1:])
    print("usage: coderai heads invite --address ADDR --out FILE [--data-dir DIR] [--ttl S]", file=sys.stderr)
    return 2
