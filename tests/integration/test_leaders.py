"""Two schedulers on one bus (two heads' worth): one leads, the other waits; SIGKILL the leader and the standby
takes over and rewrites every assignment under its larger fencing token; an assignment written under the old token
is refused by the worker; `/admin/cluster`, `coderai status` and the `coderai_leader` metric say who leads."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import httpx
import pytest

from coderai.contracts import Assignment, decode, encode
from coderai.contracts.topology import ASSIGNMENTS
from coderai.runtime.bus import Bus
from coderai.runtime.embedded import NatsServer
from coderai.testing.procs import wait_until
from coderai.testing.stack import Stack, write_models_file

pytestmark = pytest.mark.slow


def _assignment(url: str, node: str) -> Assignment:
    async def read() -> Assignment:
        bus = await Bus.connect(url, "test")
        try:
            return decode((await (await bus.kv(ASSIGNMENTS)).get(node)).value, Assignment)
        finally:
            await bus.close()

    return asyncio.run(read())


def _put_assignment(url: str, a: Assignment) -> None:
    async def put() -> None:
        bus = await Bus.connect(url, "test")
        try:
            await (await bus.kv(ASSIGNMENTS)).put(a.node_id, encode(a))
        finally:
            await bus.close()

    asyncio.run(put())


def test_the_standby_scheduler_takes_over_and_the_old_leaders_writes_are_refused(
    tmp_path, tiny_gguf, keys_file, admin_key
):
    models = write_models_file(
        tmp_path / "models.toml",
        [{"name": "tiny", "engine": "llama", "path": str(tiny_gguf), "params": {"n_ctx": 512, "n_threads": 1}}],
    )
    nats = NatsServer(tmp_path / "nats").start()  # last: nothing that can fail runs before the `try` below
    stack = Stack(tmp_path, nats.url)
    headers = {"Authorization": f"Bearer {admin_key}"}
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}

    def cluster() -> dict:
        r = httpx.get(f"{stack.http_url}/admin/cluster", headers=headers, timeout=10)
        assert r.status_code == 200, r.text
        return r.json()

    def leader() -> dict:
        return next(x for x in cluster()["leaders"] if x["role"] == "scheduler")

    try:
        stack.start_core(models)  # its scheduler is head-a's: the stack's data dir names it
        stack.start_worker("w1")
        stack.start_gateway("--api-keys-file", str(keys_file))
        stack.wait_model_ready("tiny", headers=headers)
        first = leader()
        assert first["holder"] and first["token"] > 0
        assert _assignment(nats.url, "w1").fence == first["token"], "assignments carry the leader's token"
        assert cluster()["nodes"][0]["node_id"] == "w1" and cluster()["nodes"][0]["models"] == ["tiny"]

        standby = stack.start(
            "scheduler-b",
            "coderai.scheduler",
            ["--models-file", str(models)],
            env={"CODERAI_SCHEDULER_NODE_ID": "head-b"},
        )
        standby.wait_log("standby")
        assert leader()["holder"] == first["holder"], "the standby does not take a held lease"

        out = subprocess.run(
            [sys.executable, "-m", "coderai.cli", "status", "--url", stack.http_url, "--key", admin_key],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert out.returncode == 0, out.stderr
        assert f"scheduler   {first['holder']}" in out.stdout and "w1: tiny" in out.stdout, out.stdout

        stack.procs["scheduler"].kill()  # the leader's head dies: no step-down, the lease lapses
        standby.wait_log("leading on head-b", 60)
        wait_until(lambda: leader()["holder"] == "head-b", 30, "the cluster page to name the new leader")
        second = leader()
        assert second["token"] > first["token"]
        wait_until(
            lambda: _assignment(nats.url, "w1").fence == second["token"],
            30,
            "the new leader to rewrite w1's assignment under its token",
        )
        assert (
            httpx.post(f"{stack.base_url}/chat/completions", headers=headers, json=chat, timeout=60).status_code == 200
        )

        # the old leader wakes up late and tells w1 to unload everything: refused, w1 keeps serving
        worker = stack.procs["worker-w1"]
        mark = len(worker.log_text())
        _put_assignment(nats.url, Assignment(node_id="w1", models=[], fence=first["token"]))
        worker.wait_log("ignoring an assignment from a former leader", 30, after=mark)
        assert "unloading tiny" not in worker.log_text()[mark:]
        assert (
            httpx.post(f"{stack.base_url}/chat/completions", headers=headers, json=chat, timeout=60).status_code == 200
        )

        def scrape() -> str:
            return httpx.get(f"http://127.0.0.1:{stack.metrics_port}/metrics", timeout=10).text

        wait_until(
            lambda: 'coderai_leader{holder="head-b",role="scheduler"} 1.0' in scrape(),
            30,
            "the metric to name the new leader",
        )
        text = scrape()
        assert f'coderai_leader{{holder="{first["holder"]}",role="scheduler"}} 0.0' in text, (
            "the former leader drops to 0"
        )
        assert f'coderai_leader_token{{role="scheduler"}} {float(second["token"])}' in text
    finally:
        stack.stop()
        nats.stop()
