#!/usr/bin/env python3
"""The environment-variable reference, generated from the settings structs themselves.

Every service reads its struct with `load_settings` (runtime/settings.py): a field `port` of the gateway comes
from `CODERAI_GATEWAY_PORT`, else the shared `CODERAI_PORT`. This module walks `CommonSettings` and each
service's struct, takes each field's type and default from msgspec and its description from the comment on its
line in the source, and renders `docs/env.md`. The deploy tests (tests/deploy) use `variables()` to tell a real
variable from a typo in the deploy files.

A development tool, not part of the package: it imports every service, which nothing under libs/ may do.

    .venv/bin/python scripts/envdoc.py            # rewrite docs/env.md
    .venv/bin/python scripts/envdoc.py --check    # exit 1 when docs/env.md is stale
"""

from __future__ import annotations

import argparse
import ast
import importlib
import inspect
import io
import sys
import textwrap
import tokenize
import typing
from dataclasses import dataclass
from pathlib import Path

import msgspec

from coderai.runtime.settings import CommonSettings, file_settable

# service name as load_settings and `coderai <command>` know it -> "module:Struct"
SERVICES: dict[str, str] = {
    "gateway": "coderai.gateway.settings:GatewaySettings",
    "router": "coderai.router.settings:RouterSettings",
    "scheduler": "coderai.scheduler.settings:SchedulerSettings",
    "pod-broker": "coderai.pod_broker.settings:BrokerSettings",
    "metrics": "coderai.metrics.settings:MetricsSettings",
    "worker": "coderai.engine_worker.settings:WorkerSettings",
}

# Variables read outside the settings structs, with who reads them. Keep in step with the code that reads them
# (grep for os.environ); the deploy tests accept exactly these beside the structs' own.
OTHER_VARIABLES: dict[str, tuple[tuple[str, ...], str]] = {
    "CODERAI_CONFIG": (
        ("gateway", "router", "scheduler", "pod-broker", "metrics", "worker"),
        "path of a TOML file with one `[service]` table each (runtime/settings.py); env vars win",
    ),
    "CODERAI_TRACE_FILE": (
        ("gateway", "router", "scheduler", "pod-broker", "metrics", "worker"),
        "write one JSON line per finished span to this file (runtime/tracing.py)",
    ),
    "CODERAI_FAMILIES": (
        ("gateway", "router", "scheduler", "pod-broker", "metrics", "worker"),
        "modules (comma-separated) that each declare an engine family from outside the package, "
        "`FAMILY = FamilySpec(...)` (contracts/families.py); set it for every service",
    ),
    "CODERAI_VLLM_PYTHON": (
        ("worker",),
        "interpreter of a separate venv that has vLLM (default: `vllm/bin/python` in the worker's own venv, where "
        "`scripts/setup` links the one it makes); makes the worker offer the `vllm` family",
    ),
    "CODERAI_SGLANG_PYTHON": (
        ("worker",),
        "interpreter of a separate venv that has SGLang (default: `sglang/bin/python` in the worker's own venv); "
        "makes the worker offer the `sglang` family (engines/sglang.py)",
    ),
    "CODERAI_MODEL_CACHE": (
        ("up",),
        "where `coderai up` keeps the tiny default models it builds (tiny_models/cache.py); "
        "default `$XDG_CACHE_HOME/coderai/models`, i.e. `~/.cache/coderai/models`",
    ),
    "CODERAI_REDIS_URL": (
        ("keys",),
        "Redis for `coderai keys` (also the shared name of the gateway's and metrics' `redis_url`)",
    ),
}

# Said here only for fields whose source line has no comment; a comment added there wins.
FALLBACK_DESCRIPTIONS: dict[str, str] = {
    "node_id": "this machine's id; empty: made once from the host name and kept in `<data_dir>/node_id`",
    "log_level": "DEBUG, INFO, WARNING or ERROR",
    "data_dir": "state directory (node id, keys, caches)",
    "host": "address to listen on (`0.0.0.0` for every interface)",
    "port": "port to listen on",
    "workers": "HTTP worker processes",
    "route_timeout_s": "how long the gateway waits for the router's answer",
    "retry_after_s": "the `Retry-After` of a 503 when no engine serves the model",
    "guard_slack": "requests of headroom before the load guard overrides affinity (see picking.LoadGuard)",
    "runpod_api_key": "RunPod API key; empty: never rents",
    "heartbeat_s": "seconds between heartbeats",
    "drain_timeout_s": "how long in-flight jobs may take to finish when their model is unloaded (evicted, removed, moved) or on SIGTERM",
    "discover_timeout_s": "one mDNS search for the head lasts this long before it is logged and retried",
}

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUTPUT = ROOT / "docs" / "env.md"
COMMAND = "python scripts/envdoc.py"


@dataclass(frozen=True)
class Field:
    """One settings field as the docs show it."""

    name: str
    type: str
    default: str
    description: str
    from_file: bool = False  # may come from the file a `..._FILE` variable names


def prefix(service: str) -> str:
    """`CODERAI_POD_BROKER_` for "pod-broker", as load_settings spells it."""
    return f"CODERAI_{service.upper().replace('-', '_')}_"


def settings_class(service: str) -> type[msgspec.Struct]:
    """Import the settings struct of `service` (one of SERVICES)."""
    module, _, name = SERVICES[service].partition(":")
    return getattr(importlib.import_module(module), name)


def _type_name(tp: object) -> str:
    if typing.get_origin(tp) is typing.Literal:
        return " \\| ".join(f'`"{a}"`' if isinstance(a, str) else f"`{a!r}`" for a in typing.get_args(tp))
    if isinstance(tp, type) and not typing.get_args(tp):
        return f"`{tp.__name__}`"
    return f"`{tp}`".replace("typing.", "")


def _comments(cls: type) -> dict[str, tuple[str, str]]:
    """field -> (comment on its line or the lines just above it, source text of its default)."""
    try:
        source = textwrap.dedent(inspect.getsource(cls))
    except (OSError, TypeError):
        return {}
    line_comments: dict[int, str] = {}
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            line_comments[tok.start[0]] = tok.string.lstrip("#").strip()
    lines = source.splitlines()
    out: dict[str, tuple[str, str]] = {}
    body = ast.parse(source).body[0]
    assert isinstance(body, ast.ClassDef)
    for node in body.body:
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            continue
        above = []
        n = node.lineno - 1
        while n >= 1 and lines[n - 1].strip().startswith("#"):
            above.insert(0, line_comments.get(n, ""))
            n -= 1
        parts = [*above, line_comments.get(node.end_lineno or node.lineno, "")]
        text = " ".join(p for p in parts if p)
        default_src = ast.get_source_segment(source, node.value) if node.value is not None else ""
        out[node.target.id] = (text, default_src or "")
    return out


def _default(field: msgspec.structs.FieldInfo, source: str) -> str:
    if field.default is not msgspec.NODEFAULT:
        value = field.default
    elif field.default_factory is not msgspec.NODEFAULT:
        value = field.default_factory()
    else:
        return "required"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, str):
        return f"`{value}`" if value else '`""`'
    shown = f"`{value!r}`"
    if isinstance(value, (int, float)) and source and source != repr(value):
        shown += f" (`{source}`)"  # 16 * 1024 * 1024 says more than 16777216
    return shown


def fields(cls: type[msgspec.Struct], own_only: bool = False) -> list[Field]:
    """The fields of a settings struct, in declaration order; `own_only` leaves out CommonSettings' fields."""
    info: dict[str, tuple[str, str]] = {}
    for klass in reversed(cls.__mro__):
        if isinstance(klass, type) and issubclass(klass, msgspec.Struct) and klass is not msgspec.Struct:
            info.update(_comments(klass))
    common = set(CommonSettings.__struct_fields__)
    out = []
    for f in msgspec.structs.fields(cls):
        if own_only and f.name in common and cls is not CommonSettings:
            continue
        description, default_src = info.get(f.name, ("", ""))
        description = description or FALLBACK_DESCRIPTIONS.get(f.name, "")
        out.append(Field(f.name, _type_name(f.type), _default(f, default_src), description, file_settable(cls, f.name)))
    return out


def variables(service: str | None = None) -> set[str]:
    """Every `CODERAI_*` name the settings (and OTHER_VARIABLES) read; for one service, only what it reads."""
    services = [service] if service else list(SERVICES)
    names: set[str] = set()
    for svc in services:
        if svc in SERVICES:
            cls = settings_class(svc)
            for name in cls.__struct_fields__:
                ends = ("", "_FILE") if file_settable(cls, name) else ("",)
                names.update(v + end for v in (prefix(svc) + name.upper(), "CODERAI_" + name.upper()) for end in ends)
        names.update(var for var, (readers, _) in OTHER_VARIABLES.items() if svc in readers)
    if service is None:
        names.update(OTHER_VARIABLES)
    return names


def _table(rows: list[tuple[str, Field]]) -> list[str]:
    out = ["| variable | type | default | meaning |", "|---|---|---|---|"]
    for var, f in rows:
        shown = f"`{var}` (or `_FILE`)" if f.from_file else f"`{var}`"
        out.append(f"| {shown} | {f.type} | {f.default} | {f.description.replace('|', chr(92) + '|')} |")
    return out


def render() -> str:
    """The whole of docs/env.md."""
    lines = [
        "# Environment variables",
        "",
        f"<!-- Generated by `{COMMAND}` from the settings structs; do not edit by hand. -->",
        "",
        "Every service reads one settings struct (`runtime/settings.py`). For a field `port` of the gateway the",
        "value comes from `CODERAI_GATEWAY_PORT`, else the shared `CODERAI_PORT`, else the `[gateway]` table of the",
        "TOML file named by `CODERAI_CONFIG`, else that file's top level, else the default below. Command-line flags",
        'win over all of them. Lists take JSON (`["a", "b"]`) or comma-separated text; booleans',
        "`true`/`false`/`1`/`0`. A bad value stops the service at start with the variable's name.",
        "",
        "A shared name serves every service that has the field: `CODERAI_REDIS_URL` sets both the gateway's and the",
        "metrics service's `redis_url`; `CODERAI_SCRAPE_TOKEN` both `scrape_token`s.",
        "",
        'A secret or a URL (marked "or `_FILE`" below) may instead be in a file: `CODERAI_CLUSTER_TOKEN_FILE=/run/secrets/token`',
        "reads the token from that file (its line end dropped), as Docker's and systemd's secrets are handed over, so",
        "the value is not in the environment that `docker inspect` prints. It takes the place of its variable in the",
        "order above; setting both a variable and its `_FILE` is an error, as is a file that cannot be read or is empty.",
        "",
        "## Every service",
        "",
        "These fields are in every struct (`CommonSettings`). Set them shared (`CODERAI_NATS_URL`) or for one service",
        "(`CODERAI_WORKER_NATS_URL`).",
        "",
        *_table([("CODERAI_" + f.name.upper(), f) for f in fields(CommonSettings)]),
    ]
    for svc in SERVICES:
        cls = settings_class(svc)
        lines += ["", f"## {svc} (`coderai {svc}`, `{cls.__name__}`)", ""]
        own = fields(cls, own_only=True)
        lines += _table([(prefix(svc) + f.name.upper(), f) for f in own]) if own else ["No settings of its own."]
    lines += ["", "## Read outside the settings structs", "", "| variable | read by | meaning |", "|---|---|---|"]
    for var, (readers, meaning) in OTHER_VARIABLES.items():
        lines.append(f"| `{var}` | {', '.join(readers)} | {meaning} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog=COMMAND, description=__doc__.splitlines()[0])
    ap.add_argument("--output", type=Path, default=DEFAULT_OUTPUT, help="where to write (default docs/env.md)")
    ap.add_argument("--check", action="store_true", help="do not write; exit 1 when the file differs")
    args = ap.parse_args(argv)
    text = render()
    if args.check:
        current = args.output.read_text() if args.output.exists() else ""
        if current != text:
            print(f"{args.output} is stale: run {COMMAND}", file=sys.stderr)
            return 1
        return 0
    args.output.write_text(text)
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
