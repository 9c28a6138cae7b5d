"""Record what Claude Code and Codex send, for bench/agent_sessions.py to replay.

The real CLIs (`.venv/agents`, installed by scripts/setup with the dev extra) run non-interactively, several
sessions each and several prompts per session (`claude -p --session-id` then `--resume`; `codex exec` then
`codex exec resume <thread>`), against a coderai stack serving the echo engine's scripted tool mode: each user
turn the model calls the CLI's file or shell tool, then answers with its result, so every turn is a tool round
trip as an agent's are. A recording reverse proxy sits between the CLIs and the gateway and keeps every request's
method, path, headers (auth dropped) and JSON body, tagged with the CLI, the session and the prompt that sent it.
"""

from __future__ import annotations

import asyncio
import gzip
import json
import os
import threading
import uuid
from pathlib import Path
from typing import Any

import httpx

from coderai.accounts.keyfile import KeyRecord, hash_key, write_keys
from coderai.runtime.embedded import free_port
from coderai.testing.procs import run_interruptible, wait_until
from coderai.testing.stack import running_stack

ROOT = Path(__file__).resolve().parents[1]
AGENTS = ROOT / ".venv" / "agents" / "node_modules" / ".bin"
KEY = "sk-agents-record-0123456789abcdef"
MODEL = "agent-tools"
DROP_HEADERS = {"authorization", "x-api-key", "host", "content-length", "connection", "accept-encoding", "cookie"}
PROMPTS = [
    "What is the secret word in notes.txt?",
    "Read notes.txt again and tell me the second sentence.",
    "Does notes.txt mention a deadline? Check the file.",
    "Summarise notes.txt in one line.",
    "Which bird is named in notes.txt?",
    "Quote the first word of notes.txt.",
]
NOTES = (
    "The secret word is {word}.\nThe release is due on Friday; the pelican guards the build.\n"
    "Remember to rotate the logs before the demo.\n"
)


class Recorder:
    """A reverse proxy on 127.0.0.1 that forwards everything to `upstream` and keeps each request, tagged with
    whatever `tag` holds when it arrives (the CLIs run one at a time)."""

    def __init__(self, upstream: str) -> None:
        self.upstream = upstream.rstrip("/")
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.tag: dict[str, Any] = {}
        self.records: list[dict[str, Any]] = []
        self._server: Any = None
        self._thread: threading.Thread | None = None

    async def _app(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        chunks = []
        while True:
            msg = await receive()
            chunks.append(msg.get("body", b""))
            if not msg.get("more_body"):
                break
        raw = b"".join(chunks)
        path = scope["path"] + (("?" + scope["query_string"].decode()) if scope["query_string"] else "")
        headers = [(k.decode(), v.decode()) for k, v in scope["headers"]]
        try:
            body = json.loads(raw) if raw else None
        except ValueError:
            body = raw.decode(errors="replace")
        self.records.append(
            {
                **self.tag,
                "seq": len(self.records),
                "method": scope["method"],
                "path": path,
                "headers": {k: v for k, v in headers if k.lower() not in DROP_HEADERS},
                "body": body,
            }
        )
        fwd = [(k, v) for k, v in headers if k.lower() not in ("host", "content-length", "accept-encoding")]
        async with httpx.AsyncClient(timeout=300) as client:
            async with client.stream(scope["method"], self.upstream + path, content=raw, headers=fwd) as r:
                out = [
                    (k.encode(), v.encode())
                    for k, v in r.headers.items()
                    if k.lower() not in ("content-length", "transfer-encoding", "content-encoding", "connection")
                ]
                await send({"type": "http.response.start", "status": r.status_code, "headers": out})
                async for piece in r.aiter_raw():
                    await send({"type": "http.response.body", "body": piece, "more_body": True})
        await send({"type": "http.response.body", "body": b""})

    def __enter__(self) -> Recorder:
        import uvicorn

        config = uvicorn.Config(
            self._app, host="127.0.0.1", port=self.port, log_level="warning", lifespan="off", interface="asgi3"
        )
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=lambda: asyncio.run(self._server.serve()), daemon=True)
        self._thread.start()
        wait_until(lambda: self._server.started, 30, "the recording proxy")
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(10)


def _claude(rec: Recorder, folder: Path, home: Path, session: str, prompt: str, first: bool) -> None:
    env = {
        "PATH": os.environ["PATH"],
        "HOME": str(home),
        "ANTHROPIC_BASE_URL": rec.url,
        "ANTHROPIC_AUTH_TOKEN": KEY,
        "ANTHROPIC_MODEL": MODEL,
        "ANTHROPIC_SMALL_FAST_MODEL": MODEL,
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
        "DISABLE_AUTOUPDATER": "1",
    }
    cmd = [
        str(AGENTS / "claude"),
        "-p",
        prompt,
        "--output-format",
        "stream-json",
        "--verbose",
        *(["--session-id", session] if first else ["--resume", session]),
    ]
    r = run_interruptible(cmd, 180, cwd=folder, env=env)
    results = [json.loads(x) for x in r.stdout.splitlines() if x.startswith('{"type":"result"')]
    if not results or results[-1].get("is_error"):
        raise RuntimeError(f"claude failed (exit {r.returncode}): {r.stdout[-2000:]}\n{r.stderr[-2000:]}")


def _codex(rec: Recorder, folder: Path, home: Path, thread: str | None, prompt: str) -> str:
    env = {"PATH": os.environ["PATH"], "HOME": str(home), "CODEX_HOME": str(home / "codex"), "CODERAI_API_KEY": KEY}
    tail = ["--json", "--skip-git-repo-check", prompt]
    cmd = [str(AGENTS / "codex"), "exec", *(["resume", thread] if thread else []), *tail]
    r = run_interruptible(cmd, 180, cwd=folder, env=env)
    events = [json.loads(x) for x in r.stdout.splitlines() if x.startswith("{")]
    if not any(e.get("type") == "turn.completed" for e in events) or any(
        e.get("type") in ("turn.failed", "error") for e in events
    ):
        raise RuntimeError(f"codex failed (exit {r.returncode}): {events[-5:]}\n{r.stderr[-2000:]}")
    return thread or next(e["thread_id"] for e in events if e.get("type") == "thread.started")


def record(root: Path, out_dir: Path, sessions: int, prompts: int) -> dict[str, Path]:
    """Run `sessions` sessions of `prompts` prompts per CLI through the recorder; write one gzip'd JSONL per CLI
    under `out_dir` and return their paths."""
    for cli in ("claude", "codex"):
        if not (AGENTS / cli).exists():
            raise SystemExit(f"no {cli}: scripts/setup installs the agent CLIs into .venv/agents with the dev extra")
    folder = root / "project"
    folder.mkdir(parents=True)
    (folder / "notes.txt").write_text(NOTES.format(word="pelican-42"))
    keys = root / "keys.toml"
    write_keys(str(keys), [KeyRecord("agents", hash_key(KEY), ["inference"])])
    script = {
        "Read": {"file_path": str(folder / "notes.txt")},  # Claude Code's
        "exec_command": {"cmd": "cat notes.txt"},
        "shell": {"command": ["cat", "notes.txt"]},
    }  # Codex's
    models = [
        {"name": MODEL, "engine": "echo", "path": "-", "params": {"reply": "The file says:", "tool_calls": script}}
    ]
    headers = {"Authorization": f"Bearer {KEY}"}
    out_dir.mkdir(parents=True, exist_ok=True)
    written: dict[str, Path] = {}
    with (
        running_stack(
            root / "stack",
            models,
            gateway_args=("--api-keys-file", str(keys)),
            extra_env={"CODERAI_WORKER_FAMILIES": "echo"},
            headers=headers,
        ) as stack,
        Recorder(stack.http_url) as rec,
    ):
        home = root / "home"
        (home / "codex").mkdir(parents=True)
        (home / "codex" / "config.toml").write_text(
            f'model = "{MODEL}"\nmodel_provider = "coderai"\nsandbox_mode = "danger-full-access"\n'
            f'approval_policy = "never"\n\n[model_providers.coderai]\nname = "coderai"\n'
            f'base_url = "{rec.url}/v1"\nenv_key = "CODERAI_API_KEY"\nwire_api = "responses"\n'
        )
        for cli in ("claude", "codex"):
            start = len(rec.records)
            for s in range(sessions):
                session, thread = str(uuid.uuid4()), None
                for p in range(prompts):
                    prompt = PROMPTS[(s + p) % len(PROMPTS)]
                    rec.tag = {"cli": cli, "session": f"{cli}-{s}", "prompt": p}
                    print(f"[record] {cli} session {s} prompt {p}: {prompt}", flush=True)
                    if cli == "claude":
                        _claude(rec, folder, home, session, prompt, first=p == 0)
                    else:
                        thread = _codex(rec, folder, home, thread, prompt)
            path = out_dir / f"{cli}.jsonl.gz"
            with gzip.open(path, "wt", compresslevel=9) as fh:
                for r in rec.records[start:]:
                    fh.write(json.dumps(r, separators=(",", ":")) + "\n")
            written[cli] = path
    versions = {
        cli: run_interruptible([str(AGENTS / cli), "--version"], 60).stdout.strip() for cli in ("claude", "codex")
    }
    (out_dir / "meta.json").write_text(
        json.dumps(
            {
                "versions": versions,
                "sessions": sessions,
                "prompts": prompts,
                "model": "echo engine, scripted tool mode",
            },
            indent=1,
        )
        + "\n"
    )
    return written


def load(path: Path) -> list[dict[str, Any]]:
    """The records of one fixture file, in the order they were sent."""
    with gzip.open(path, "rt") as fh:
        return [json.loads(line) for line in fh if line.strip()]
