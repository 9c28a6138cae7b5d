"""`coderai keys`: create, list and revoke API keys in Redis (the same store every gateway reads)."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from pathlib import Path

from coderai.accounts.keys import KeyError_, KeyJournal, KeyStore, public


def _redis_url(args: argparse.Namespace) -> str:
    if args.redis_url:
        return args.redis_url
    up = Path(os.path.expanduser(args.data_dir)) / "run" / "up.json"
    if up.exists():
        from coderai.up import service_urls

        return service_urls(up.parent.parent)[1]
    raise SystemExit("coderai keys: no Redis: pass --redis-url (or CODERAI_REDIS_URL), or run `coderai up` first")


async def _run(args: argparse.Namespace) -> int:
    from coderai.runtime import redis_client

    r = redis_client.connect(_redis_url(args))
    bus = await _journal_bus(args)
    store = KeyStore(r, KeyJournal(bus) if bus is not None else None, taken=_file_names(args))
    try:
        if args.cmd == "create":
            secret, rec = await store.create(
                args.name,
                args.scope or ["inference"],
                models=args.models or [],
                rpm=args.rpm,
                tpm=args.tpm,
                budget_usd=args.budget_usd,
                budget_period=args.budget_period,
                default_output_tokens=args.default_output_tokens,
                max_output_tokens=args.max_output_tokens,
            )
            print(json.dumps({"key": secret, **public(rec)}, indent=2))
            print("The key is shown once: store it now.", file=sys.stderr)
        elif args.cmd == "list":
            for k in await store.list():
                print(json.dumps(public(k)))
        else:
            print(json.dumps(public(await store.revoke(args.name))))
        return 0
    except KeyError_ as exc:
        print(f"coderai keys: {exc}", file=sys.stderr)
        return 1
    finally:
        await r.aclose()
        if bus is not None:
            await bus.close()


def _file_names(args: argparse.Namespace) -> frozenset[str]:
    """The names of this machine's bootstrap keys (`coderai up`'s keys.toml), which a key in Redis may not take."""
    from coderai.accounts.keyfile import load_keys

    path = Path(os.path.expanduser(args.data_dir)) / "keys.toml"
    return frozenset(r.name for r in load_keys(str(path)).values()) if path.exists() else frozenset()


async def _journal_bus(args: argparse.Namespace):
    """The bus of the `coderai up` on this machine, for the key journal (keys then outlive its Redis); None with
    an explicit --redis-url (a cluster's Redis: its gateways journal the keys they change, the CLI does not)."""
    if args.redis_url:
        return None
    from coderai.up import service_bus

    return await service_bus(Path(os.path.expanduser(args.data_dir)), "keys-cli")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="coderai keys", description=(__doc__ or "").partition("\n")[0])
    ap.add_argument("--redis-url", default=os.environ.get("CODERAI_REDIS_URL", ""))
    ap.add_argument(
        "--data-dir",
        default=os.environ.get("CODERAI_DATA_DIR", "~/.coderai"),
        help="where `coderai up` left run/up.json (used when no --redis-url)",
    )
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("create", help="a new key, printed once")
    c.add_argument("name")
    c.add_argument(
        "--scope", action="append", choices=["inference", "admin"], help="repeat for both (default inference)"
    )
    c.add_argument("--models", type=lambda s: [m for m in s.split(",") if m], help="allow-list, comma-separated")
    c.add_argument("--rpm", type=int, default=0, help="requests per minute (0: no limit)")
    c.add_argument("--tpm", type=int, default=0, help="tokens per minute (0: no limit)")
    c.add_argument("--budget-usd", type=float, default=0.0, help="dollars per period (0: no budget)")
    c.add_argument("--budget-period", choices=["hour", "day", "week", "month"], default="month")
    c.add_argument(
        "--default-output-tokens",
        type=int,
        default=0,
        help="output tokens of a request that names none (0: the model's default)",
    )
    c.add_argument(
        "--max-output-tokens",
        type=int,
        default=0,
        help="no request gets more output tokens (0: the model's ceiling alone)",
    )
    sub.add_parser("list", help="every key, without secrets")
    rv = sub.add_parser("revoke", help="refuse a key from now on, on every gateway")
    rv.add_argument("name")
    return asyncio.run(_run(ap.parse_args(argv)))


if __name__ == "__main__":
    raise SystemExit(main())
