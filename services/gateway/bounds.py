"""Bounds on what a request asks an engine to build before it runs: a JSON schema (a `response_format`, a tool's
`parameters`) becomes a grammar in the engine, and its cost grows with its nesting. One schema nested 900 deep took
llama-server past 4 GiB in 15 s, for every tenant of that model; so a schema's depth and size are checked here,
before anything is sent, and a request over them is the client's 400 naming the field."""

from __future__ import annotations

from typing import Any

import msgspec

from coderai.gateway.errors import ApiError

MAX_SCHEMA_DEPTH = 32  # nested objects and arrays in one schema; agents' tools (Claude Code, Codex) use under 12
MAX_SCHEMA_BYTES = 256 * 1024  # one response_format's schema, encoded
MAX_TOOLS_BYTES = 1024 * 1024  # every tool of a request, encoded (Claude Code's ~20 tools are ~60 KB)


def depth(value: object, limit: int) -> int:
    """How deep `value`'s objects and arrays nest, counted without recursion and up to `limit + 1` at most."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        node, d = stack.pop()
        if not isinstance(node, (dict, list)):
            continue
        deepest = max(deepest, d)
        if deepest > limit:
            return deepest
        stack.extend((child, d + 1) for child in (node.values() if isinstance(node, dict) else node))
    return deepest


def _bounded(value: object, param: str, max_bytes: int) -> None:
    size = len(msgspec.json.encode(value))
    if size > max_bytes:
        raise ApiError(
            400, f"'{param}' is {size} bytes; at most {max_bytes} are taken.", param=param, code="schema_too_large"
        )
    if depth(value, MAX_SCHEMA_DEPTH) > MAX_SCHEMA_DEPTH:
        raise ApiError(
            400,
            f"'{param}' nests deeper than {MAX_SCHEMA_DEPTH} levels of objects and arrays, which "
            "no engine is asked to build a grammar for.",
            param=param,
            code="schema_too_complex",
        )


def check_schemas(job: Any) -> None:
    """400 when a chat job's `response_format` or `tools` are too deep or too large to turn into a grammar."""
    rf = getattr(job, "response_format", None)
    if rf:
        _bounded(rf, "response_format", MAX_SCHEMA_BYTES)
    tools = getattr(job, "tools", None)
    if tools:
        _bounded(tools, "tools", MAX_TOOLS_BYTES)


def check_lora_scale(job: Any, cfg: Any) -> None:
    """400 for a `lora_scale` asked of a model that has no adapter to scale: only a fine-tuned model served by
    llama-server (`params.base`) takes one (llama.cpp scales its `--lora` per request)."""
    options = getattr(job, "options", None) or {}
    if options.get("lora_scale") is not None and not (cfg.engine == "llama-server" and cfg.param_str("base")):
        raise ApiError(
            400,
            f"lora_scale applies only to a fine-tuned model served by llama-server; {cfg.name} is not one",
            param="lora_scale",
        )
