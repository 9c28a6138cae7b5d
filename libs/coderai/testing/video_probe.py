"""A probe for video jobs, run on a test host (inside its network namespace): create a job, read its record,
wait for it to end, fetch its MP4; which models each node has ready (`engines`). Prints one JSON line.
`python -m coderai.testing.video_probe CMD ...`"""

from __future__ import annotations

import argparse
import json

import httpx

from coderai.testing.procs import wait_until


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m coderai.testing.video_probe")
    ap.add_argument("cmd", choices=("create", "get", "wait", "content", "engines"))
    ap.add_argument("--base-url", required=True)
    ap.add_argument("--key", default="")
    ap.add_argument("--id", default="")
    ap.add_argument("--body", default="{}", help="create: the JSON body")
    ap.add_argument("--out", default="", help="content: where to write the MP4")
    ap.add_argument("--timeout", type=float, default=240)
    a = ap.parse_args(argv)
    client = httpx.Client(base_url=a.base_url, headers={"Authorization": f"Bearer {a.key}"}, timeout=30)
    if a.cmd == "create":
        r = client.post("/videos", json=json.loads(a.body))
        print(json.dumps({**r.json(), "http_status": r.status_code}))
    elif a.cmd == "get":
        print(json.dumps(client.get(f"/videos/{a.id}").json()))
    elif a.cmd == "wait":
        rec = wait_until(
            lambda: (v := client.get(f"/videos/{a.id}").json())["status"] in ("completed", "failed") and v,
            a.timeout,
            f"video {a.id} to end",
            interval_s=0.2,
        )
        print(json.dumps(rec))
    elif a.cmd == "engines":
        nodes = client.get(a.base_url.removesuffix("/v1") + "/admin/nodes").json()["nodes"]
        print(
            json.dumps(
                {
                    n["heartbeat"]["node_id"]: sorted(
                        e["model"] for e in n["heartbeat"].get("engines", []) if e.get("state") == "ready"
                    )
                    for n in nodes
                }
            )
        )
    else:
        r = client.get(f"/videos/{a.id}/content")
        with open(a.out, "wb") as fh:
            fh.write(r.content)
        print(json.dumps({"status": r.status_code, "bytes": len(r.content)}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
