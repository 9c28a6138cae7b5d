"""`coderai up` on one box, as a local user who is not its owner would find it: NATS and Redis on loopback both
want credentials, and no secret (the admin key, the cluster token, the NATS and Redis passwords, a RunPod key)
is in any log line of a run."""

from __future__ import annotations

import asyncio
import json
import socket
import stat
from pathlib import Path

import httpx
import nats
import pytest

from coderai.runtime.cluster import JOIN_USER, join_password, new_token, with_user
from coderai.runtime.embedded import free_port
from coderai.testing.procs import ServiceProcess
from coderai.testing.stack import clean_env

pytestmark = pytest.mark.slow

TOKEN = new_token()
RUNPOD_KEY = "rpa_" + new_token()


@pytest.fixture(scope="module")
def box(tmp_path_factory, tiny_gguf):
    from coderai.testing.stack import write_models_file

    root = tmp_path_factory.mktemp("box")
    models = write_models_file(
        root / "models.toml", [{"name": "tiny", "engine": "llama", "path": str(tiny_gguf), "params": {"n_ctx": 256}}]
    )
    port = free_port()
    env = clean_env(CODERAI_POD_BROKER_RUNPOD_API_KEY=RUNPOD_KEY)
    up = ServiceProcess(
        "up",
        "coderai.cli",
        [
            "up",
            "--data-dir",
            str(root / "data"),
            "--port",
            str(port),
            "--models-file",
            str(models),
            "--cluster-token",
            TOKEN,
            "--nats-host",
            "127.0.0.1",
            "--nats-port",
            str(free_port()),
            "--mdns-interface",
            "127.0.0.1",
        ],
        env,
        root / "logs",
    ).start()
    try:
        up.wait_log("\nready", 180)
        yield root / "data", f"http://127.0.0.1:{port}/v1", up
    finally:
        up.stop(timeout_s=60)


async def _refused(url: str) -> bool:
    async def quiet(_e: Exception) -> None:
        pass

    try:
        nc = await nats.connect(url, connect_timeout=2, allow_reconnect=False, max_reconnect_attempts=0, error_cb=quiet)
    except Exception:  # a refused login is the point
        return True
    await nc.close()
    return False


def test_nats_without_credentials_is_refused(box):
    data, _, _ = box
    url = json.loads((data / "run" / "up.json").read_text())["nats_url"]
    assert asyncio.run(_refused(url))
    assert asyncio.run(_refused(with_user(url, "service", join_password(TOKEN))))
    assert asyncio.run(_refused(with_user(url, "service", TOKEN)))
    # the join user logs in, but may do nothing but ask to join
    assert not asyncio.run(_refused(with_user(url, JOIN_USER, join_password(TOKEN))))


def test_redis_without_the_password_is_refused(box):
    data, _, _ = box
    url = json.loads((data / "run" / "up.json").read_text())["redis_url"]
    host, port = url.split("//")[1].split("/")[0].split(":")
    with socket.create_connection((host, int(port)), timeout=5) as s:
        s.sendall(b"PING\r\nHSET coderai:keys x y\r\n")
        answer = s.recv(256)
    assert answer.startswith(b"-NOAUTH"), answer


def test_secrets_are_files_of_the_owner_only(box):
    data, _, _ = box
    for path in [
        data / "admin.key",
        data / "secrets" / "nats-service.password",
        data / "secrets" / "redis.password",
        data / "nats" / "members.json",
        data / "nats" / "users.conf",
        *(data / "logs").iterdir(),
    ]:
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, path
    for folder in (data / "secrets", data / "logs"):
        assert stat.S_IMODE(folder.stat().st_mode) == 0o700, folder


def test_no_secret_is_in_any_log_line(box):
    data, base, up = box
    key = (data / "admin.key").read_text().strip()
    r = httpx.post(
        f"{base}/chat/completions",
        headers={"Authorization": f"Bearer {key}"},
        timeout=60,
        json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
    )
    assert r.status_code == 200, r.text
    httpx.get(f"{base}/models", headers={"Authorization": "Bearer sk-coderai-wrong"}, timeout=10)
    secrets = {
        "the admin key": key,
        "the cluster token": TOKEN,
        "the RunPod key": RUNPOD_KEY,
        "the NATS service password": (data / "secrets" / "nats-service.password").read_text().strip(),
        "the Redis password": (data / "secrets" / "redis.password").read_text().strip(),
        **{
            f"the {svc}'s NATS password": (data / "secrets" / f"nats-svc-{svc}.password").read_text().strip()
            for svc in ("gateway", "router", "scheduler", "pod-broker", "metrics")
        },
    }
    logs = [*(data / "logs").iterdir(), *Path(up.log_path).parent.glob("*.log")]
    assert len(logs) >= 8
    scanned = 0
    for log in logs:
        text = log.read_text(errors="replace")
        scanned += text.count("\n")
        for what, value in secrets.items():
            assert value not in text, f"{what} is in {log}"
    assert scanned > 50
    # the settings line still says which settings were given (masked, not dropped)
    broker = (data / "logs" / "pod-broker.log").read_text()
    assert '"runpod_api_key": "***"' in broker and "svc-pod-broker:***@" in broker  # its own NATS user


def test_nothing_in_the_data_dir_is_readable_by_another_user(box):
    """Attack: a local user who is not the box's owner reads the data dir: Redis's append-only file (key names and
    hashes, usage, budgets), JetStream's files (responses, batches), logs, models. Every path is its owner's only."""
    data, base, _ = box
    key = (data / "admin.key").read_text().strip()
    r = httpx.post(
        f"{base}/chat/completions",
        headers={"Authorization": f"Bearer {key}"},
        timeout=60,
        json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
    )
    assert r.status_code == 200, r.text  # usage reaches Redis's append-only file
    aof = [p for p in data.rglob("*") if ".aof" in p.name]
    assert aof, sorted(str(p.relative_to(data)) for p in data.rglob("*"))[:50]
    open_to_others = []
    checked = 0
    for path in [data, *data.rglob("*")]:
        if path.is_symlink():
            continue
        checked += 1
        if stat.S_IMODE(path.lstat().st_mode) & 0o077:
            open_to_others.append(f"{oct(stat.S_IMODE(path.lstat().st_mode))} {path.relative_to(data)}")
    print(
        f"looked at {checked} paths under the data dir as another user would ({len(aof)} of Redis's AOF files): "
        f"{len(open_to_others)} readable or writable by them"
    )
    assert not open_to_others, open_to_others[:20]
