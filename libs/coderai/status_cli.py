"""`coderai status`: who leads each singleton and which nodes are up, from a gateway's `/admin/cluster`.

With no flags it asks the `coderai up` running on this machine (its `run/up.json` and `admin.key` in the data dir).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path


def _defaults(data: Path) -> tuple[str, str]:
    """(gateway base URL without /v1, admin key) of the `coderai up` on `data`, or ("", "")."""
    base = key = ""
    try:
        base = json.loads((data / "run" / "up.json").read_text())["base_url"].removesuffix("/v1")
    except (OSError, ValueError, KeyError):
        pass
    try:
        key = (data / "admin.key").read_text().strip()
    except OSError:
        pass
    return base, key


def render(cluster: dict) -> str:
    lines = ["leaders:"]
    for lead in cluster.get("leaders", []):
        if lead.get("holder"):
            since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(lead.get("since", 0)))
            lines.append(
                f"  {lead['role']:<11} {lead['holder']}  (token {lead.get('token', 0)}, since {since}, "
                f"renewed {lead.get('age_s', 0):.1f} s ago)"
            )
        else:
            lines.append(f"  {lead['role']:<11} nobody: no head holds the lease")
    if cluster.get("heads"):
        lines.append(f"heads: {', '.join(cluster['heads'])}")
    nodes = cluster.get("nodes", [])
    lines.append(f"nodes: {len(nodes)}")
    for n in nodes:
        kind = f" (pod {n['pod']})" if n.get("pod") else ""
        lines.append(
            f"  {n['node_id']}{kind}: {', '.join(n.get('models', [])) or 'no models'}; {n.get('in_flight', 0)} in flight"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="coderai status", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--url", help="the gateway (default: the `coderai up` on this machine)")
    ap.add_argument("--key", help="an admin key (default: $CODERAI_ADMIN_KEY, or admin.key in the data dir)")
    ap.add_argument("--data-dir", default=os.environ.get("CODERAI_DATA_DIR", "~/.coderai"))
    ap.add_argument("--json", action="store_true", help="print /admin/cluster's JSON as it is")
    args = ap.parse_args(argv)
    base, key = _defaults(Path(os.path.expanduser(args.data_dir)))
    base = (args.url or base).rstrip("/").removesuffix("/v1")
    key = args.key or os.environ.get("CODERAI_ADMIN_KEY", "") or key
    if not base:
        print("coderai status: no gateway to ask: pass --url (no `coderai up` runs on this data dir)", file=sys.stderr)
        return 2
    import httpx

    try:
        r = httpx.get(f"{base}/admin/cluster", headers={"Authorization": f"Bearer {key}"} if key else {}, timeout=10)
    except httpx.HTTPError as exc:
        print(f"coderai status: {base} did not answer: {exc}", file=sys.stderr)
        return 1
    if r.status_code != 200:
        try:
            why = r.json()["error"]["message"]
        except (ValueError, KeyError, TypeError):
            why = r.text[:200]
        print(f"coderai status: {base}/admin/cluster answered {r.status_code}: {why}", file=sys.stderr)
        return 1
    print(json.dumps(r.json(), indent=2) if args.json else render(r.json()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
