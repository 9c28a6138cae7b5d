"""Cut the operations coderai claims (`coderai.gateway.contract.CLAIMED`) out of OpenAI's OpenAPI document, with
every component they reference, into the subset the gateway serves at `/openapi.json`.

    python scripts/openai_spec.py PATH-TO-openai-openapi [--rev main]
    python scripts/openai_spec.py --repatch      # the patches below again, on the vendored document

PATH is a clone (bare or not) of https://github.com/openai/openai-openapi; the script reads `openapi.json` and
`LICENSE` at `--rev` and writes `services/gateway/openapi/openai.json` (the source commit in `info.x-source`) and
`services/gateway/openapi/LICENSE-openai-openapi`. The few schema patches below are where OpenAI's document says
less than, or other than, what OpenAI's API answers; each names why.
"""

from __future__ import annotations

import argparse
import copy
import json
import subprocess
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
OUT_DIR = ROOT / "services" / "gateway" / "openapi"
SOURCE_REPO = "https://github.com/openai/openai-openapi"


def claimed() -> tuple[tuple[str, str], ...]:
    try:
        from coderai.gateway.contract import CLAIMED
    except ImportError:
        raise SystemExit("run it with the project's venv: .venv/bin/python scripts/openai_spec.py ...") from None
    return CLAIMED


def git_show(repo: Path, rev: str, path: str) -> str:
    return subprocess.run(
        ["git", "-C", str(repo), "show", f"{rev}:{path}"], check=True, capture_output=True, text=True
    ).stdout


def refs_in(node: Any) -> set[str]:
    """Every local `$ref` under `node`."""
    found: set[str] = set()
    stack = [node]
    while stack:
        n = stack.pop()
        if isinstance(n, dict):
            ref = n.get("$ref")
            if isinstance(ref, str) and ref.startswith("#/components/"):
                found.add(ref)
            stack.extend(n.values())
        elif isinstance(n, list):
            stack.extend(n)
    return found


def strip_meta(node: Any) -> Any:
    """`node` without OpenAI's documentation-site extensions (`x-oaiMeta`: SDK snippets, no contract)."""
    if isinstance(node, dict):
        return {k: strip_meta(v) for k, v in node.items() if k != "x-oaiMeta"}
    if isinstance(node, list):
        return [strip_meta(v) for v in node]
    return node


def subset(spec: dict[str, Any], ops: tuple[tuple[str, str], ...], commit: str) -> dict[str, Any]:
    """The claimed operations of `spec` and the components they reach, transitively."""
    paths: dict[str, dict[str, Any]] = {}
    for method, path in ops:
        item = spec["paths"].get(path, {})
        if method not in item:
            raise SystemExit(f"OpenAI's spec at {commit} has no {method.upper()} {path}")
        shared = {k: v for k, v in item.items() if k in ("parameters", "summary", "description")}
        paths.setdefault(path, dict(shared))[method] = strip_meta(item[method])
    components: dict[str, dict[str, Any]] = {}
    todo = refs_in(paths)
    seen: set[str] = set()
    while todo:
        ref = todo.pop()
        if ref in seen:
            continue
        seen.add(ref)
        _, _, kind, name = ref.split("/", 3)
        value = strip_meta(spec["components"][kind][name])
        components.setdefault(kind, {})[name] = value
        todo |= refs_in(value) - seen
    schemes = spec["components"]["securitySchemes"]
    components["securitySchemes"] = {"ApiKeyAuth": schemes["ApiKeyAuth"]}
    tags = {t for item in paths.values() for op in item.values() if isinstance(op, dict) for t in op.get("tags", [])}
    doc = {
        "openapi": spec["openapi"],
        "info": {
            "title": "coderai: the OpenAI API subset it implements",
            "description": (
                "The operations of OpenAI's API that coderai implements, as OpenAI's OpenAPI document "
                "describes them (cut by scripts/openai_spec.py; MIT, see LICENSE-openai-openapi). "
                "Paths are relative to the server, `/v1` on the gateway, as OpenAI's are relative to "
                "https://api.openai.com/v1. coderai's own extensions are in docs/api.md."
            ),
            "version": spec["info"]["version"],
            "license": spec["info"]["license"],
            "x-source": {
                "repository": SOURCE_REPO,
                "commit": commit,
                "path": "openapi.json",
                "openai-version": spec["info"]["version"],
            },
        },
        "servers": [{"url": "/v1", "description": "this gateway"}],
        "security": [{"ApiKeyAuth": []}],
        "tags": [t for t in spec.get("tags", []) if t.get("name") in tags],
        "paths": {p: paths[p] for p in sorted(paths)},
        "components": {k: dict(sorted(v.items())) for k, v in sorted(components.items())},
    }
    patch(doc)
    return doc


def patch(doc: dict[str, Any]) -> None:
    """Where OpenAI's document differs from what OpenAI's API answers (and coderai answers the same way)."""
    # GET /files/{id}/content answers the file's bytes (the SDK's `files.content` returns them raw), not a JSON
    # string: the document's `application/json` string would hold no file but a JSONL one.
    ok = doc["paths"]["/files/{file_id}/content"]["get"]["responses"]["200"]
    ok["content"] = {"application/octet-stream": {"schema": {"type": "string", "format": "binary"}}}
    # The 404s of DELETE /responses/{id} and .../cancel name the bare `Error` object; OpenAI answers every error
    # wrapped, `{"error": {...}}` (`ErrorResponse`, as the same document's 429s say).
    wrapped = {"$ref": "#/components/schemas/ErrorResponse"}
    for item in doc["paths"].values():
        for op in item.values():
            for answer in (op.get("responses") or {}).values() if isinstance(op, dict) else ():
                schema = answer.get("content", {}).get("application/json", {}).get("schema")
                if schema == {"$ref": "#/components/schemas/Error"}:
                    answer["content"]["application/json"]["schema"] = wrapped
    doc["components"]["schemas"].setdefault(
        "ErrorResponse",
        {"type": "object", "properties": {"error": {"$ref": "#/components/schemas/Error"}}, "required": ["error"]},
    )
    # A `text/event-stream` schema describes one event (OpenAPI 3.2: `data`, `event`, `id`, `retry`); OpenAI's
    # document gives the schema of each event's JSON `data` there. Said as meant: `data` is JSON of that schema
    # (or chat's last `[DONE]`).
    for item in doc["paths"].values():
        for op in item.values():
            if not isinstance(op, dict):
                continue
            for answer in (op.get("responses") or {}).values():
                stream = answer.get("content", {}).get("text/event-stream")
                payload = (stream or {}).get("schema")
                if payload is None or payload.get("x-coderai-sse"):
                    continue
                stream["schema"] = {
                    "type": "object",
                    "required": ["data"],
                    "x-coderai-sse": True,
                    "properties": {
                        "data": {
                            "anyOf": [
                                {"const": "[DONE]"},
                                {"type": "string", "contentMediaType": "application/json", "contentSchema": payload},
                            ]
                        }
                    },
                }
    schemas = doc["components"]["schemas"]
    # An empty page has no first or last id: OpenAI answers null for both, where the document requires a string.
    for name in ("ListFilesResponse", "ResponseItemList"):
        listed = schemas[name]["properties"]
        for end in ("first_id", "last_id"):
            listed[end] = {
                "anyOf": [{"type": "string"}, {"type": "null"}],
                **{k: v for k, v in listed[end].items() if k not in ("type", "anyOf")},
            }
    # A file uploaded with purpose `evals` (CreateFileRequest allows it) is a file with that purpose.
    purposes = schemas["OpenAIFile"]["properties"]["purpose"]["enum"]
    purposes += [p for p in schemas["CreateFileRequest"]["properties"]["purpose"]["enum"] if p not in purposes]
    # `encoding_format: "base64"` (the SDK's default) answers each embedding as a base64 string of float32s;
    # the document only has the list of floats.
    vector = schemas["Embedding"]["properties"]["embedding"]
    if "anyOf" not in vector:
        schemas["Embedding"]["properties"]["embedding"] = {
            "anyOf": [
                {k: v for k, v in vector.items() if k != "description"},
                {"type": "string", "description": "base64 of the float32s, with encoding_format: base64"},
            ],
            "description": vector.get("description", ""),
        }
    # A discriminator without a mapping maps by component name (OpenAPI 3.1, 4.8.25), and no item's `type`
    # ("message", "function_call", ...) is a component's name: the oneOf under it says the same without it.
    dropped = []
    for name, schema in schemas.items():
        if isinstance(schema.get("discriminator"), dict) and "mapping" not in schema["discriminator"]:
            del schema["discriminator"]
            dropped.append(name)
    doc["info"]["x-patches"] = [
        "GET /files/{file_id}/content: the 200 answer is application/octet-stream bytes, not a JSON string",
        'the 404s of DELETE /responses/{response_id} and POST .../cancel: ErrorResponse ({"error": ...}), '
        "not the bare Error",
        "ListFilesResponse, ResponseItemList: first_id and last_id are null on an empty page",
        "text/event-stream answers: the schema is each event's, its data JSON of OpenAI's schema (or [DONE])",
        "OpenAIFile.purpose: every purpose CreateFileRequest accepts",
        "Embedding.embedding: a base64 string too (encoding_format: base64)",
        "no discriminator without a mapping (no type value is a component name): see x-dropped-discriminators",
    ]
    doc["info"]["x-dropped-discriminators"] = sorted(
        set(dropped) | set(doc["info"].get("x-dropped-discriminators", []))
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("repo", type=Path, nargs="?", help="a clone of github.com/openai/openai-openapi (bare or not)")
    ap.add_argument(
        "--repatch",
        action="store_true",
        help="apply the patches below to the vendored document again, without a clone (they are idempotent)",
    )
    ap.add_argument("--rev", default="HEAD", help="the commit, branch or tag to read (default HEAD)")
    ap.add_argument("--out", type=Path, default=OUT_DIR, help=f"where to write (default {OUT_DIR.relative_to(ROOT)})")
    args = ap.parse_args(argv)
    if args.repatch:
        path = args.out / "openai.json"
        doc = json.loads(path.read_text("utf-8"))
        patch(doc)
        path.write_text(json.dumps(doc, indent=1, ensure_ascii=False) + "\n", "utf-8")
        print(f"patched {path}")
        return 0
    if args.repo is None:
        ap.error("give a clone of openai-openapi, or --repatch")
    commit = subprocess.run(
        ["git", "-C", str(args.repo), "rev-parse", f"{args.rev}^{{commit}}"], check=True, capture_output=True, text=True
    ).stdout.strip()
    spec = json.loads(git_show(args.repo, commit, "openapi.json"))
    doc = subset(copy.deepcopy(spec), claimed(), commit)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "openai.json").write_text(json.dumps(doc, indent=1, ensure_ascii=False) + "\n", "utf-8")
    (args.out / "LICENSE-openai-openapi").write_text(
        f"From {SOURCE_REPO} at {commit}:\n\n" + git_show(args.repo, commit, "LICENSE"), "utf-8"
    )
    n_ops = sum(
        len([m for m in item if m not in ("parameters", "summary", "description")]) for item in doc["paths"].values()
    )
    n_comp = sum(len(v) for v in doc["components"].values())
    print(f"{n_ops} operations, {n_comp} components from {commit} -> {args.out / 'openai.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
