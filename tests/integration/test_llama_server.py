"""The `llama-server` engine family: a supervised llama.cpp server child per model, many users at once.

Real worker, real `llama-server` child (the one `scripts/setup` builds into `.venv/bin`), the tiny GGUF."""

from __future__ import annotations

import os
import signal
import threading
from pathlib import Path

import httpx
import openai
import pytest

from coderai.testing.procs import wait_until
from coderai.testing.stack import running_stack

pytestmark = pytest.mark.slow

SLOTS = 4
# a long prompt (~900 tokens of the tiny model): its prefill alone keeps a slot busy for a while, where the tiny
# model's decoding (thousands of tokens a second) can end before a heartbeat sees the slot busy
FILLER = " ".join(f"word{j}" for j in range(250))


@pytest.fixture(scope="module")
def stack(tmp_path_factory, tiny_gguf):
    from coderai.engine_worker.engines.llama_server import find_binary

    if find_binary() is None:
        pytest.skip("no llama-server: scripts/setup builds it into .venv/bin")
    models = [{"name": "tiny-ls", "engine": "llama-server", "path": str(tiny_gguf),
               "params": {"parallel": SLOTS, "n_ctx": 2048, "n_threads": 2}}]  # the tiny model's own context
    # the tiny model makes thousands of tokens a second: heartbeats every 0.2 s see its slots while they are busy
    with running_stack(tmp_path_factory.mktemp("llama-server"), models, gateway_args=("--no-auth",),
                       extra_env={"CODERAI_WORKER_HEARTBEAT_S": "0.2"}) as s:
        yield s


def _children(model_path: str) -> list[int]:
    """Pids of running llama-server processes serving `model_path`."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            argv = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
            state = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z" and argv and argv[0].endswith(b"llama-server") and model_path.encode() in argv:
            out.append(int(entry))
    return out


def _engine(stack) -> dict:
    nodes = httpx.get(f"{stack.http_url}/admin/nodes", timeout=10).json()["nodes"]
    return next(e for n in nodes for e in n["heartbeat"].get("engines", []) if e["model"] == "tiny-ls")


def _client(stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.base_url, api_key="none", max_retries=0, timeout=120)


def test_concurrent_streams_share_the_slots(stack):
    client = _client(stack)
    results: list[str | Exception] = []
    busiest = 0
    done = threading.Event()

    def chat(i: int) -> None:
        try:
            chunks = [c for c in client.chat.completions.create(
                model="tiny-ls", stream=True, max_tokens=1000, messages=[{"role": "user", "content": f"story {i} {FILLER}"}])
                if c.choices]
            results.append(chunks[-1].choices[0].finish_reason)  # random weights may say little: it must end
        except Exception as exc:  # noqa: BLE001 - collected and asserted below
            results.append(exc)

    threads = [threading.Thread(target=chat, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()

    def watch() -> None:
        nonlocal busiest
        while not done.is_set():
            busiest = max(busiest, _engine(stack).get("slots_busy", 0))
            done.wait(0.1)

    watcher = threading.Thread(target=watch)
    watcher.start()
    for t in threads:
        t.join(180)
    done.set()
    watcher.join(10)
    assert len(results) == 8 and not [r for r in results if isinstance(r, Exception)], results
    assert all(r in ("stop", "length") for r in results), results
    e = _engine(stack)
    assert e["engine"] == "llama-server" and e["slots"] == SLOTS
    assert busiest > 1, "the engine never reported more than one busy slot"


def test_beyond_the_bounded_queue_a_request_gets_a_clean_429(stack):
    client = _client(stack)
    answers: list[object] = []
    # long distinct prompts: their prefill keeps every slot and the queue full while all 17 arrive

    def ask(i: int) -> None:
        try:
            answers.append(client.chat.completions.create(
                model="tiny-ls", max_tokens=1000, messages=[{"role": "user", "content": f"q{i} {FILLER}"}]))
        except openai.APIStatusError as exc:
            answers.append(exc)

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(4 * SLOTS + 1)]  # slots + 3 x slots queued
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    refused = [a for a in answers if isinstance(a, openai.APIStatusError)]
    assert len(answers) == 4 * SLOTS + 1 and refused, "no request was refused beyond the queue"
    for exc in refused:
        assert exc.status_code == 429 and exc.code == "busy", exc.body
        assert int(exc.response.headers["retry-after"]) >= 1
    assert all(a.choices[0].finish_reason in ("stop", "length") for a in answers if a not in refused)


def test_a_killed_child_ends_the_stream_with_an_error_and_is_restarted(stack, tiny_gguf):
    def killed_mid_stream() -> list[str] | None:
        """Kill the child after the first streamed token; the rest of the stream, or None when the answer was
        already complete by then (random weights may stop early): then the child is back, and it is tried again."""
        [pid] = wait_until(lambda: _children(str(tiny_gguf)) or None, 60, "one llama-server child")
        wait_until(lambda: _engine(stack)["state"] == "ready", 60, "the engine to be ready")
        with httpx.stream("POST", f"{stack.base_url}/chat/completions", timeout=60, json={
                "model": "tiny-ls", "stream": True, "max_tokens": 1800,
                "messages": [{"role": "user", "content": "long"}]}) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            assert '"choices"' in next(line for line in lines if line.startswith("data:"))
            os.kill(pid, signal.SIGKILL)
            rest = list(lines)
        wait_until(lambda: [p for p in _children(str(tiny_gguf)) if p != pid], 60, "a new llama-server child")
        return rest if not any('"finish_reason":"' in line for line in rest) else None

    rest = next(filter(None, (killed_mid_stream() for _ in range(5))), None)
    assert rest is not None, "five streams finished before their child was killed"
    assert any('"error"' in line for line in rest), rest[-5:]
    # the supervisor started a new child; the engine was failed meanwhile, and serves again
    wait_until(lambda: _engine(stack)["state"] == "ready", 60, "the engine to be ready again")
    r = wait_until(lambda: _client(stack).chat.completions.create(
        model="tiny-ls", max_tokens=8, messages=[{"role": "user", "content": "again"}]), 60, "an answer after the restart")
    assert r.usage.completion_tokens >= 0 and r.choices[0].finish_reason in ("stop", "length")


def test_no_child_outlives_a_sigkilled_worker(stack, tiny_gguf):
    children = _children(str(tiny_gguf))
    assert children
    worker = stack.procs["worker-w1"]
    worker.proc.send_signal(signal.SIGKILL)
    worker.proc.wait(30)
    wait_until(lambda: not _children(str(tiny_gguf)), 30, "the llama-server child to die with its worker")
