"""Agent sessions recorded from the real Claude Code and Codex CLIs, replayed over two llama.cpp replicas: how much
of the prompt cache an ideal single cache could have reused do the engines actually reuse?

Fixtures: bench/fixtures/agent_sessions/{claude,codex}.jsonl.gz, the exact requests (bodies and headers, auth
dropped) the CLIs sent, recorded by `--record` (bench/_agent_record.py: the CLIs run against the echo engine's
scripted tool mode, so every prompt is a tool round trip: two requests). Replayed as recorded (the assistant turns
in them are the recorded ones), with the output cut to `--max-tokens` so the bench measures prefill and caching.

Modes, one after another in one run, each over two `llama-server` replicas with the same flags (slots, context per
slot, 1 thread each, `--cache-ram`), on a tiny GGUF whose chat template renders the tools (Hermes style), so the
~64 KB of Claude Code's tool schemas are in the prompt as with a real model:

  coderai             2 workers (llama-server engine), router policy "prefix"; the requests as recorded, to
                      /v1/messages (Claude Code) and /v1/responses (Codex), with the CLIs' session headers
  round_robin         sglang-router `round_robin` in front of two bare replicas
  sglang_cache_aware  sglang-router `cache_aware` in front of two bare replicas

The routers cannot take Anthropic or Responses requests for llama-server, so the baselines get each request as the
chat/completions body coderai's own translation hands its engine (coderai.gateway's Messages and Responses
translations, then the engine client's body): the same prompts token for token (checked: the prompt tokens each
engine reports are compared), so the modes differ only in where requests go. That translation already drops Claude
Code's per-session billing block; a proxy that kept it would give the baselines no cross-session prefix at all.

Prefix-capture ratio = cached prompt tokens the engines reported (llama-server's `cached_tokens`) / the tokens an
ideal single cache could have reused: for each request, the longest token prefix (the rendered prompt, tokenized
by llama-server) it shares with any request that had completed before it was sent, at most its length - 1 (a
request always computes its last token). Sessions run `--concurrency` at a time, both CLIs interleaved; a session
starts only after the previous session's first request completed, so every new session could reuse the shared
system prompt and tools. TTFT of a new session's first turn: the first streamed event with output, at the client.

Usage: python bench/agent_sessions.py [--quick] [--record] [--modes coderai,round_robin,sglang_cache_aware]
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import json
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import msgspec
import numpy as np

import _agent_record
import _setup
from _servers import Proc, start_llama_replica, start_router
from coderai.runtime.embedded import NatsServer, find_llama_server, free_port
from coderai.testing.stack import Stack, write_models_file
from coderai.tiny_models.llm import build_tiny_gguf

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "agent_sessions"
MODEL = "bench"
MODES = ("coderai", "round_robin", "sglang_cache_aware")
ROUTER_POLICY = {"round_robin": "round_robin", "sglang_cache_aware": "cache_aware"}
# ChatML with the tools in the system turn and tool calls in assistant turns, as Hermes-style templates render them
TEMPLATE = (
    "{%- if tools or messages[0]['role'] == 'system' %}<|im_start|>system\n"
    "{%- if messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}{% endif %}"
    "{%- if tools %}\n\n# Tools\n<tools>{% for t in tools %}\n{{ t | tojson }}{% endfor %}\n</tools>{% endif %}"
    "<|im_end|>\n{% endif %}"
    "{%- for m in messages %}{% if not (loop.first and m['role'] == 'system') %}"
    "<|im_start|>{{ m['role'] }}\n{{ m['content'] or '' }}"
    "{%- if m['tool_calls'] is defined and m['tool_calls'] %}{% for c in m['tool_calls'] %}"
    "\n<tool_call>{{ c['function'] | tojson }}</tool_call>{% endfor %}{% endif %}<|im_end|>\n"
    "{%- endif %}{% endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@dataclass
class Req:
    """One recorded request, as each mode sends it."""

    session: str
    index: int  # within its session
    path: str  # coderai's: /v1/messages?beta=true or /v1/responses
    body: dict[str, Any]  # coderai's: the recorded body, output cut
    headers: dict[str, str]
    chat: dict[str, Any]  # the baselines': the chat/completions body coderai hands its engine
    tokens: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))


@dataclass
class Result:
    req: Req
    sent: float
    done: float
    ttft: float
    cached: int
    prompt: int
    route: str = ""


def load_sessions(quick: bool, max_tokens: int) -> list[list[Req]]:
    """The recorded sessions, Claude Code's and Codex's alternating; `quick`: 2 of each, their first prompt."""
    from coderai.engine_worker.engines.openai_wire import chat_request
    from coderai.gateway.anthropic_types import MessagesRequest, chat_job
    from coderai.gateway.openai.responses_types import response_job

    per_cli: list[list[list[Req]]] = []
    for cli in ("claude", "codex"):
        sessions: dict[str, list[Req]] = {}
        for rec in _agent_record.load(FIXTURES / f"{cli}.jsonl.gz"):
            path = rec["path"]
            if rec["method"] != "POST" or not path.split("?")[0] in ("/v1/messages", "/v1/responses"):
                continue  # count_tokens, HEAD probes: nothing to cache
            if quick and rec["prompt"] >= 1:
                continue
            body = {**copy.deepcopy(rec["body"]), "model": MODEL, "stream": True}
            if path.startswith("/v1/messages"):
                body["max_tokens"] = max_tokens
                job = chat_job(msgspec.convert(body, MessagesRequest), "bench")
            else:
                body["max_output_tokens"] = max_tokens
                job, _ = response_job(body, "bench")
            chat = {**chat_request(MODEL, job, True), "stream": True, "stream_options": {"include_usage": True}}
            session = sessions.setdefault(rec["session"], [])
            session.append(Req(rec["session"], len(session), path, body, rec["headers"], chat))
        per_cli.append(list(sessions.values())[: 2 if quick else None])
    out = []
    for i in range(max(len(s) for s in per_cli)):
        out += [s[i] for s in per_cli if i < len(s)]
    return out


def tokenize(binary: str, gguf: Path, root: Path, reqs: list[Req], ctx: int) -> None:
    """Each request's prompt as the engine renders and tokenizes it (llama-server's /apply-template, /tokenize)."""
    port = free_port()
    proc = Proc(
        "tokenizer",
        [
            binary,
            "--model",
            str(gguf),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--jinja",
            "--ctx-size",
            str(ctx),
            "--no-webui",
            "--threads",
            "1",
        ],
        root / "logs",
    )
    try:
        proc.wait_http(f"http://127.0.0.1:{port}/health", 120)
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=120) as c:
            for r in reqs:
                prompt = c.post("/apply-template", json=r.chat).raise_for_status().json()["prompt"]
                toks = c.post("/tokenize", json={"content": prompt, "add_special": True, "parse_special": True})
                r.tokens = np.asarray(toks.raise_for_status().json()["tokens"], np.int32)
    finally:
        proc.stop()


def lcp(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if len(diff) else n


def ideal(results: list[Result]) -> list[int]:
    """Per result: the longest prefix shared with a request that completed before it was sent (at most len - 1)."""
    out = []
    for r in results:
        best = max((lcp(r.req.tokens, q.req.tokens) for q in results if q.done <= r.sent), default=0)
        out.append(min(best, len(r.req.tokens) - 1))
    return out


def _cached(usage: dict[str, Any] | None, timings: dict[str, Any] | None) -> tuple[int, int]:
    """(cached, prompt) tokens from an OpenAI usage object or llama-server's timings."""
    u = usage or {}
    details = u.get("prompt_tokens_details") or u.get("input_tokens_details") or {}
    if "cached_tokens" in details:
        return int(details["cached_tokens"] or 0), int(u.get("prompt_tokens") or u.get("input_tokens") or 0)
    t = timings or {}
    return int(t.get("cache_n") or 0), int(t.get("cache_n") or 0) + int(t.get("prompt_n") or 0)


async def send(client: httpx.AsyncClient, req: Req, coderai: bool) -> Result:
    """Stream one request; when its first output event came, and what the engine said it took from its cache."""
    path, body, headers = (req.path, req.body, req.headers) if coderai else ("/v1/chat/completions", req.chat, {})
    sent = time.perf_counter()
    first = None
    cached = prompt = 0
    async with client.stream("POST", path, json=body, headers=headers) as r:
        if r.status_code != 200:
            await r.aread()
            raise RuntimeError(f"{path} answered {r.status_code}: {r.text[:500]}")
        route = f"{r.headers.get('coderai-engine', '')} {r.headers.get('coderai-route', '')}".strip()
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[6:])
            kind = event.get("type", "")
            if first is None and (
                kind.endswith(".delta")
                or kind == "content_block_delta"
                or any(c.get("delta") for c in event.get("choices") or [])
            ):
                first = time.perf_counter() - sent
            if kind == "message_delta":  # Anthropic: the prompt is input + cache read tokens
                u = event.get("usage") or {}
                cached = int(u.get("cache_read_input_tokens") or 0)
                prompt = cached + int(u.get("input_tokens") or 0)
            elif kind in ("response.completed", "response.incomplete"):
                cached, prompt = _cached(event["response"].get("usage"), None)
            elif event.get("usage") or event.get("timings"):
                cached, prompt = _cached(event.get("usage"), event.get("timings"))
    done = time.perf_counter()
    return Result(req, sent, done, first if first is not None else done - sent, cached, prompt, route)


async def replay(base_url: str, sessions: list[list[Req]], concurrency: int, coderai: bool) -> list[Result]:
    """Sessions `concurrency` at a time, each request after the previous one of its session; a session starts
    once the one before it has had its first request answered."""
    results: list[Result] = []
    gate = asyncio.Semaphore(concurrency)
    started = [asyncio.Event() for _ in sessions]

    async def run(i: int, session: list[Req], client: httpx.AsyncClient) -> None:
        if i:
            await started[i - 1].wait()
        async with gate:
            for req in session:
                results.append(await send(client, req, coderai))
                started[i].set()

    async with httpx.AsyncClient(base_url=base_url.removesuffix("/v1"), timeout=600) as client:
        await asyncio.gather(*(run(i, s, client) for i, s in enumerate(sessions)))
    return sorted(results, key=lambda r: r.sent)


def run_coderai(root: Path, gguf: Path, sessions: list[list[Req]], a: argparse.Namespace) -> list[Result]:
    nats = NatsServer(root / "nats").start()
    params = {
        "n_ctx": a.ctx,
        "n_threads": 1,
        "n_threads_batch": 1,
        "parallel": a.slots,
        "cache_ram_mb": a.cache_mb,
        "queue": 64,
        **({"head_snapshots_mb": a.head_snapshots_mb} if a.head_snapshots_mb is not None else {}),
    }
    stack = Stack(root / "coderai", nats.url, extra_env={"CODERAI_ROUTER_POLICY": "prefix"})
    try:
        stack.start_core(
            write_models_file(
                root / "models.toml",
                [
                    {
                        "name": MODEL,
                        "engine": "llama-server",
                        "path": str(gguf),
                        "max_output_tokens": a.max_tokens,
                        "params": params,
                    }
                ],
            )
        )
        for w in range(2):
            stack.start_worker(f"w{w}")
        stack.start_gateway("--no-auth", env={"CODERAI_GATEWAY_IDLE_TIMEOUT_S": "600"})
        stack.wait_engines_ready([MODEL], timeout_s=120)
        stack.wait_model_ready(MODEL, timeout_s=120)
        results = asyncio.run(replay(stack.base_url, sessions, a.concurrency, True))
        engines = [
            e
            for n in httpx.get(f"{stack.http_url}/admin/nodes", timeout=10).json()["nodes"]
            for e in n["heartbeat"].get("engines", [])
        ]
        print(
            f"[bench] coderai: prompt heads saved {sum(e.get('head_saves', 0) for e in engines)}, restored into a "
            f"slot {sum(e.get('head_restores', 0) for e in engines)} times",
            file=sys.stderr,
        )
        return results
    finally:
        stack.stop()
        nats.stop()


def run_router(
    root: Path, gguf: Path, mode: str, exe: Path, sessions: list[list[Req]], a: argparse.Namespace
) -> list[Result]:
    binary = find_llama_server()
    assert binary is not None
    procs = []
    try:
        replicas = []
        for r in range(2):
            proc, t = start_llama_replica(root / mode, binary, gguf, f"{mode}-r{r}", 1, a.slots, a.ctx, a.cache_mb)
            procs.append(proc)
            replicas.append(t)
        proc, router = start_router(root / mode, exe, f"{mode}-router", ROUTER_POLICY[mode], replicas)
        procs.append(proc)
        return asyncio.run(replay(router.base_url, sessions, a.concurrency, False))
    finally:
        for p in reversed(procs):
            p.stop()


def summarise(mode: str, results: list[Result], sessions: list[list[Req]], verbose: bool) -> dict[str, Any]:
    best = ideal(results)
    if verbose:
        for r, b in zip(results, best):
            print(
                f"  {mode} {r.req.session}#{r.req.index}: {len(r.req.tokens)} tokens (engine: {r.prompt}), "
                f"ideal {b}, cached {r.cached}, ttft {r.ttft * 1000:.0f} ms {r.route}",
                file=sys.stderr,
            )
    cached = sum(min(r.cached, len(r.req.tokens)) for r in results)
    firsts = {s[0].session: s[0] for s in sessions}
    first_results = [r for r in results if r.req.index == 0]
    new = [
        r for r in first_results if r.req.session != sessions[0][0].session and r.req.session != sessions[1][0].session
    ]
    second = {
        r.req.session.split("-")[0]: r.cached
        for r in first_results
        if r.req.session.endswith("-1") and r.req.session in firsts
    }
    mismatch = sum(1 for r in results if r.prompt and r.prompt != len(r.req.tokens))
    return {
        "mode": mode,
        "requests": len(results),
        "cached": cached,
        "ideal": sum(best),
        "ratio": cached / sum(best) if sum(best) else 0.0,
        "prompt": sum(len(r.req.tokens) for r in results),
        "ttft_new": statistics.median(r.ttft for r in (new or first_results)),
        "ttft_all": statistics.median(r.ttft for r in results),
        "second": second,
        "mismatch": mismatch,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="2 sessions per CLI, 1 prompt each (the smoke test)")
    ap.add_argument("--record", action="store_true", help="re-record the fixtures from the real CLIs first")
    ap.add_argument("--record-sessions", type=int, default=4)
    ap.add_argument("--record-prompts", type=int, default=4)
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--concurrency", type=int, default=4, help="sessions at once")
    ap.add_argument("--slots", type=int, default=4, help="slots per replica")
    ap.add_argument("--ctx", type=int, default=40960, help="context per slot")
    ap.add_argument("--cache-mb", type=int, default=1024, help="llama-server --cache-ram per replica")
    ap.add_argument(
        "--head-snapshots-mb",
        type=int,
        default=None,
        help="coderai's llama-server head snapshots (default: the engine's; 0 turns them off)",
    )
    ap.add_argument("--verbose", action="store_true", help="every request's tokens, ideal and cached to stderr")
    a = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="coderai-agents-"))
    if a.record:
        _agent_record.record(root / "record", FIXTURES, a.record_sessions, a.record_prompts)
    binary = find_llama_server()
    if binary is None:
        print("> no llama-server (scripts/setup builds it): nothing to measure")
        return 1
    modes = a.modes.split(",")
    exe = None
    if set(modes) & set(ROUTER_POLICY):
        found = _setup.rust_routers(install=True)
        if isinstance(found, str):
            print(f"> skipping {', '.join(m for m in modes if m in ROUTER_POLICY)}: {found}")
            modes = [m for m in modes if m not in ROUTER_POLICY]
        else:
            exe = found["sglang-router"]
    gguf = Path(
        build_tiny_gguf(root / "bench.gguf", vocab=8192, dim=32, heads=1, layers=1, ctx=a.ctx, chat_template=TEMPLATE)[
            "out"
        ]
    )
    sessions = load_sessions(a.quick, a.max_tokens)
    reqs = [r for s in sessions for r in s]
    t = time.perf_counter()
    tokenize(binary, gguf, root, reqs, a.ctx)
    print(
        f"[bench] {len(sessions)} sessions, {len(reqs)} requests, {sum(len(r.tokens) for r in reqs)} prompt tokens "
        f"(longest {max(len(r.tokens) for r in reqs)}), tokenized in {time.perf_counter() - t:.1f}s",
        file=sys.stderr,
    )
    rows = []
    for mode in modes:
        t = time.perf_counter()
        if mode == "coderai":
            results = run_coderai(root, gguf, sessions, a)
        else:
            assert exe is not None
            results = run_router(root, gguf, mode, exe, sessions, a)
        rows.append(summarise(mode, results, sessions, a.verbose))
        print(f"[bench] {mode}: {len(results)} requests in {time.perf_counter() - t:.1f}s", file=sys.stderr)

    meta = json.loads((FIXTURES / "meta.json").read_text()) if (FIXTURES / "meta.json").exists() else {}
    print(
        f"\n{len(sessions)} sessions ({', '.join(f'{k} {v}' for k, v in meta.get('versions', {}).items())}), "
        f"{len(reqs)} requests, {rows[0]['prompt'] if rows else 0} prompt tokens; {a.concurrency} sessions at once "
        f"over 2 replicas x {a.slots} slots; max_tokens {a.max_tokens}"
    )
    print(
        "| mode | prefix-capture ratio | cached tokens | ideal tokens | new session 1st turn TTFT p50 ms "
        "| all turns TTFT p50 ms | 2nd session's 1st turn cached |"
    )
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        second = ", ".join(f"{k} {v}" for k, v in sorted(r["second"].items()))
        print(
            f"| {r['mode']} | {r['ratio']:.3f} | {r['cached']} | {r['ideal']} | {r['ttft_new'] * 1000:.0f} "
            f"| {r['ttft_all'] * 1000:.0f} | {second} |"
        )
    for r in rows:
        if r["mismatch"]:
            print(
                f"> {r['mode']}: {r['mismatch']} requests whose engine-reported prompt length differs from the "
                "tokenized one"
            )
    if rows and rows[0]["mode"] == "coderai":
        print(
            f"\ncoderai prefix-capture ratio {rows[0]['ratio']:.3f} (goal >= 0.97: "
            f"{'met' if rows[0]['ratio'] >= 0.97 else 'missed'})"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
