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


async def _watch_nodes(data_dir: str, present: set[str], absent: set[str], timeout_s: float, ready_file: str) -> dict:
    """Read the nodes every 0.1 s until `present` are all there and `absent` all gone: the nodes then, and the wall
    time of the read that saw it (`at`), which is when the cluster got there give or take 0.1 s. A test starts this
    before what it times and takes `at`: polling from a new process each time would add that process's start, seconds
    on a loaded machine. `ready_file` is written once the first read is done."""
    import time
    from pathlib import Path

    from coderai.contracts.topology import NODES
    from coderai.runtime.kv import list_keys
    from coderai.up import service_bus

    bus = await service_bus(Path(data_dir), "probe")
    try:
        kv = await bus.kv(NODES)
        deadline, first = time.monotonic() + timeout_s, True
        while True:
            nodes = set(await list_keys(kv))
            at = time.time()
            if first and ready_file:
                Path(ready_file).write_text("watching")
                first = False
            if present <= nodes and not absent & nodes or time.monotonic() > deadline:
                return {"nodes": sorted(nodes), "at": at, "met": present <= nodes and not absent & nodes}
            await asyncio.sleep(0.1)
    finally:
        await bus.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m coderai.testing.probe")
    sub = ap.add_subparsers(dest="cmd", required=True)
    n = sub.add_parser("nodes")
    n.add_argument("--data-dir", required=True, help="the head's `coderai up --data-dir`")
    n.add_argument("--until-present", default="", help="comma-separated: watch until these nodes are all there")
    n.add_argument("--until-absent", default="", help="comma-separated: watch until these nodes are all gone")
    n.add_argument("--timeout", type=float, default=60.0, help="give up watching after this many seconds")
    n.add_argument("--ready-file", default="", help="written once watching (the first read done)")
    c = sub.add_parser("chat")
    c.add_argument("--base-url", required=True)
    c.add_argument("--key", default="")
    c.add_argument("--model", required=True)
    c.add_argument("--prompt", default="where am I?")
    c.add_argument("--max-tokens", type=int, default=2)
    c.add_argument("--temperature", type=float, default=None)
    a = ap.parse_args(argv)
    if a.cmd == "nodes" and (a.until_present or a.until_absent):
        present, absent = ({x for x in v.split(",") if x} for v in (a.until_present, a.until_absent))
        print(json.dumps(asyncio.run(_watch_nodes(a.data_dir, present, absent, a.timeout, a.ready_file))))
        return 0
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
