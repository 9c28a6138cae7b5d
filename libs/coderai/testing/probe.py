"""Small probes run on a test host (inside its network namespace): which nodes the cluster knows, and where a
chat request lands. Prints one JSON line. `python -m coderai.testing.probe nodes|chat ...`"""

from __future__ import annotations

import argparse
import asyncio
import json

import httpx


async def _nodes(data_dir: str) -> list[str]:
    from pathlib import Path

    from coderai.contracts.topology import NODES
    from coderai.runtime.kv import list_keys
    from coderai.up import service_bus

    bus = await service_bus(Path(data_dir), "probe")
    try:
        return sorted(await list_keys(await bus.kv(NODES)))
    finally:
        await bus.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m coderai.testing.probe")
    sub = ap.add_subparsers(dest="cmd", required=True)
    n = sub.add_parser("nodes")
    n.add_argument("--data-dir", required=True, help="the head's `coderai up --data-dir`")
    c = sub.add_parser("chat")
    c.add_argument("--base-url", required=True)
    c.add_argument("--key", default="")
    c.add_argument("--model", required=True)
    c.add_argument("--prompt", default="where am I?")
    c.add_argument("--max-tokens", type=int, default=2)
    c.add_argument("--temperature", type=float, default=None)
    a = ap.parse_args(argv)
    if a.cmd == "nodes":
        print(json.dumps(asyncio.run(_nodes(a.data_dir))))
        return 0
    body = {"model": a.model, "messages": [{"role": "user", "content": a.prompt}], "max_tokens": a.max_tokens}
    if a.temperature is not None:
        body["temperature"] = a.temperature
    r = httpx.post(
        f"{a.base_url}/chat/completions", headers={"Authorization": f"Bearer {a.key}"}, timeout=30, json=body
    )
    content = r.json()["choices"][0]["message"]["content"] if r.status_code == 200 else None
    print(
        json.dumps(
            {
                "status": r.status_code,
                "engine": r.headers.get("Coderai-Engine", ""),
                "body": r.text[:300],
                "content": content,
            }
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
