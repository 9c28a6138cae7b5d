"""The `coderai` command: `coderai up` for one box, or one service per command for a cluster."""

from __future__ import annotations

import importlib
import sys

from coderai import __version__

COMMANDS = {
    "up": (
        "coderai.stack.main",
        "run everything on this machine: NATS, Redis, all services, one worker, a default model",
    ),
    "gateway": ("coderai.gateway.__main__", "the OpenAI-compatible HTTP API"),
    "router": ("coderai.router.__main__", "picks the engine for each request"),
    "scheduler": ("coderai.scheduler.__main__", "places models on nodes, tracks membership"),
    "pod-broker": ("coderai.pod_broker.__main__", "rents RunPod GPUs under caps and budgets"),
    "metrics": ("coderai.metrics.__main__", "Prometheus /metrics and per-key usage"),
    "worker": ("coderai.engine_worker.__main__", "runs this machine's engines"),
    "keys": ("coderai.accounts.cli", "create, list and revoke API keys (in Redis)"),
    "models": ("coderai.catalog.cli", "pull models from the Hugging Face Hub by name; list, rm, info"),
    "nodes": ("coderai.nodes_cli:nodes_main", "the cluster's members; revoke a node's credentials"),
    "token": ("coderai.nodes_cli:token_main", "`coderai token new`: make a cluster token"),
    "status": ("coderai.status_cli", "who leads the scheduler, pod broker and usage counting; the nodes that are up"),
    "heads": (
        "coderai.stack.invite",
        "`coderai heads invite`: a one-time invite that makes another machine a head (HA)",
    ),
    "pods": ("coderai.pods_cli", "`coderai pods check`: does the image a rented pod runs exist in its registry?"),
}


def usage() -> str:
    lines = ["usage: coderai <command> [--help] [options]", "", "commands:"]
    lines += [f"  {name:<11} {desc}" for name, (_, desc) in COMMANDS.items()]
    lines += [f"  {'version':<11} print the version"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(usage())
        return 0
    cmd, rest = argv[0], argv[1:]
    if cmd in ("version", "--version"):
        print(f"coderai {__version__}")
        return 0
    if cmd not in COMMANDS:
        print(f"coderai: unknown command {cmd!r}\n\n{usage()}", file=sys.stderr)
        return 2
    module, _, func = COMMANDS[cmd][0].partition(":")
    return getattr(importlib.import_module(module), func or "main")(rest)


if __name__ == "__main__":
    raise SystemExit(main())
