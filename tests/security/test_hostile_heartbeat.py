"""A node that lies in its heartbeat and in the usage it reports (issue 40, item 2), on a real stack: NATS with
per-node users, router, scheduler, metrics, Redis, a gateway and a worker `w1`. The evil node logs in with
credentials of its own (as a joined node does) and publishes only on its own subjects; everything it claims is
checked against the scheduler's assignment and the gateway's own counts:

- engines for a model not placed on it (`tiny`, restricted to `w1`, with 100,000 slots) get no request;
- a failed engine's `error` text (a phishing line) never reaches a tenant, only a reference the operator finds
  in the router's log;
- usage it reports for a model it does hold (`evil-model`) is billed only as far as the request allows:
  never negative, never past `max_tokens`, never more prompt than the request could hold.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from typing import Any

import httpx
import msgspec
import nats
import pytest

from coderai.accounts.keyfile import KeyRecord, hash_key, write_keys
from coderai.contracts import ChatJob, Choice, Final, Usage, decode, encode
from coderai.contracts.nodes import EngineStatus, Heartbeat
from coderai.contracts.subjects import HEARTBEAT
from coderai.testing.procs import wait_until
from coderai.testing.stack import running_stack

pytestmark = pytest.mark.slow

ADMIN_KEY = "sk-test-admin-heartbeat-0123456789"
PHISH = "model moved: log in again at https://coderai-login.example/reset to keep your access"
PRICE = {"price_prompt_per_mtok": 1000.0, "price_completion_per_mtok": 2000.0}


class EvilNode:
    """A node with its own NATS user, run on a thread of its own: it heartbeats the engines it claims and answers
    every job sent to it with `pwned` and the usage in `self.usage`."""

    def __init__(self, url: str, template: Heartbeat) -> None:
        self.url, self.template = url, template
        self.engines: list[EngineStatus] = []
        self.jobs: list[tuple[str, str]] = []  # (subject, model) of every job it was sent
        self.usage = Usage(prompt_tokens=5, completion_tokens=1)
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.nc: Any = self.call(nats.connect(url, inbox_prefix="_N.evil"))
        self.call(self.nc.subscribe("coderai.engine.evil.>", cb=self._job))
        self._stop = self.call(_event())
        self._beat = asyncio.run_coroutine_threadsafe(self._beats(), self.loop)

    def call(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(30)

    async def _beats(self) -> None:
        """A heartbeat every 0.3 s (a node's cadence, as CODERAI_WORKER_HEARTBEAT_S) until `close`."""
        seq = 0
        while not self._stop.is_set():
            seq += 1
            hb = msgspec.structs.replace(
                self.template,
                node_id="evil",
                host="evil",
                seq=seq,
                ts=time.time(),
                engines=list(self.engines),
                pod="",
                addrs=[],
                rpc=None,
            )
            await self.nc.publish(HEARTBEAT(node_id="evil"), encode(hb))
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._stop.wait(), 0.3)

    async def _job(self, m: Any) -> None:
        if m.subject.endswith(".cancel") or not m.reply:
            return
        job = decode(m.data, ChatJob)
        self.jobs.append((m.subject, job.model))
        engine = m.subject.split(".")[3]
        await self.nc.publish(
            m.reply,
            encode(
                Final(
                    seq=1,
                    engine_id=engine,
                    usage=self.usage,
                    choices=[Choice(index=0, message={"role": "assistant", "content": "pwned"}, finish_reason="stop")],
                )
            ),
        )

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self._stop.set)
        try:
            self._beat.result(5)
        except Exception:  # the beat loop's own failure does not keep the node open
            self._beat.cancel()
        try:
            self.call(self.nc.close())
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(5)


async def _event() -> asyncio.Event:
    return asyncio.Event()  # made on the node's own loop


async def _one_heartbeat(url: str, node: str) -> Heartbeat:
    nc = await nats.connect(url)
    try:
        sub = await nc.subscribe(HEARTBEAT(node_id=node))
        return decode((await sub.next_msg(timeout=30)).data, Heartbeat)
    finally:
        await nc.close()


def ready(model: str, node: str = "evil") -> EngineStatus:
    return EngineStatus(
        engine_id=f"{node}-{model}", model=model, engine="llama", ops=["chat"], state="ready", slots=100_000
    )


@pytest.fixture(scope="module")
def attacked(tmp_path_factory, redis_server, tiny_gguf):
    root = tmp_path_factory.mktemp("hostile-heartbeat")
    keys = root / "keys.toml"
    write_keys(str(keys), [KeyRecord(name="admin", sha256=hash_key(ADMIN_KEY), scopes=["inference", "admin"])])
    models = [
        {"name": "tiny", "engine": "llama", "path": str(tiny_gguf), "params": {"n_ctx": 256}, "nodes": ["w1"], **PRICE},
        {
            "name": "evil-model",
            "engine": "llama",
            "path": str(tiny_gguf),
            "params": {"n_ctx": 256},
            "nodes": ["evil"],
            **PRICE,
        },
        {"name": "evil-broken", "engine": "llama", "path": str(tiny_gguf), "nodes": ["evil"]},
        {"name": "ghost", "engine": "llama", "path": str(tiny_gguf), "nodes": ["nowhere"]},
    ]
    admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
    with running_stack(
        root,
        models,
        gateway_args=("--api-keys-file", str(keys)),
        redis_url=redis_server.url,
        extra_env={"CODERAI_GATEWAY_REDIS_URL": redis_server.url},
        headers=admin,
    ) as stack:
        template = asyncio.run(_one_heartbeat(stack.nats.service_url, "w1"))
        evil = EvilNode(stack.nats.add_node("evil"), template)
        try:
            # what it was given: evil-model (answered) and evil-broken (failed, with a phishing line); what it
            # claims besides: tiny (w1's alone) with 100,000 slots, and a failed engine for ghost (placed nowhere)
            evil.engines = [
                ready("evil-model"),
                ready("tiny"),
                msgspec.structs.replace(ready("evil-broken"), state="failed", error=PHISH),
                msgspec.structs.replace(ready("ghost"), state="failed", error=PHISH),
            ]
            stack.wait_model_ready("evil-model", headers=admin, timeout_s=60)
            stack.evil = evil
            stack.admin = admin
            yield stack
        finally:
            evil.close()


def _chat(stack, key: str, model: str, max_tokens: int = 4, content: str = "hello") -> httpx.Response:
    return httpx.post(
        f"{stack.base_url}/chat/completions",
        headers={"Authorization": f"Bearer {key}"},
        timeout=60,
        json={"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens},
    )


def _new_key(stack, name: str) -> str:
    r = httpx.post(
        f"{stack.http_url}/admin/keys",
        headers=stack.admin,
        timeout=30,
        json={"name": name, "scopes": ["inference"], "budget_usd": 10.0, "budget_period": "day"},
    )
    assert r.status_code == 201, r.text
    return r.json()["key"]


def _usage(stack, name: str, requests: int) -> dict:
    def row():
        rows = httpx.get(f"{stack.http_url}/admin/usage", params={"key": name}, headers=stack.admin, timeout=10).json()[
            "rows"
        ]
        return rows[0] if rows and rows[0]["requests"] == requests else None

    return wait_until(row, 20, f"{name}'s usage")


def test_an_engine_claimed_for_a_model_not_placed_on_the_node_gets_no_request(attacked):
    evil = attacked.evil
    before = len(evil.jobs)
    one_by_one = [_chat(attacked, ADMIN_KEY, "tiny") for _ in range(8)]

    async def burst() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=60) as c:
            body = {"model": "tiny", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 2}
            return list(
                await asyncio.gather(
                    *(
                        c.post(f"{attacked.base_url}/chat/completions", json=body, headers=attacked.admin)
                        for _ in range(8)
                    )
                )
            )

    under_load = asyncio.run(burst())
    stolen = [model for _, model in evil.jobs[before:]]
    print(f"heartbeat hijack of `tiny` (100,000 claimed slots): {len(stolen)} of 16 requests reached the evil node")
    assert stolen == []
    for r in one_by_one + under_load:
        assert r.status_code == 200, r.text
        assert r.headers["coderai-engine"].startswith("w1-") and "pwned" not in r.text
    log = attacked.procs["router"].log_text()
    # one node fault per claimed engine, however many heartbeats claimed it
    assert log.count("node fault: node evil claims an engine for model 'tiny', which is not placed on it") == 1


def test_a_failed_engines_error_text_never_reaches_a_tenant(attacked):
    for model in ("evil-broken", "ghost"):
        r = _chat(attacked, ADMIN_KEY, model)
        print(f"a failed engine's text for {model}: {r.status_code} {r.json()['error']['message']!r}")
        assert r.status_code == 503, r.text
        assert "coderai-login.example" not in r.text and "log in again" not in r.text
    # the engine it was given failed: the tenant gets a reference, the operator finds the text under it
    message = _chat(attacked, ADMIN_KEY, "evil-broken").json()["error"]["message"]
    assert "fault " in message, message
    ref = message.split("fault ")[1].split()[0].strip(").;,")
    line = next(x for x in attacked.procs["router"].log_text().splitlines() if ref in x and "coderai-login" in x)
    assert "evil" in line


def test_usage_a_node_reports_is_billed_only_as_far_as_the_request_allows(attacked):
    evil = attacked.evil
    key = _new_key(attacked, "carol")
    evil.usage = Usage(prompt_tokens=-150_000_000, completion_tokens=-150_000_000, total_tokens=-300_000_000)
    r = _chat(attacked, key, "evil-model", max_tokens=4)
    assert r.status_code == 200 and "pwned" in r.text, r.text
    row = _usage(attacked, "carol", 1)
    print(
        f"negative usage reported: billed {row['prompt_tokens']} + {row['completion_tokens']} tokens, "
        f"{row['cost_usd']} USD"
    )
    assert row["prompt_tokens"] >= 0 and row["completion_tokens"] >= 0 and row["cost_usd"] >= 0

    evil.usage = Usage(prompt_tokens=10**12, completion_tokens=10**12, total_tokens=2 * 10**12)
    r = _chat(attacked, key, "evil-model", max_tokens=4)
    assert r.status_code == 200, r.text
    row = _usage(attacked, "carol", 2)
    print(
        f"huge usage reported: billed {row['prompt_tokens']} + {row['completion_tokens']} tokens, {row['cost_usd']} USD"
    )
    assert row["completion_tokens"] <= 4  # max_tokens bounds what one answer may bill
    assert row["prompt_tokens"] <= 256  # the model's context (n_ctx) bounds the prompt
    assert row["cost_usd"] <= (256 * 1000 + 4 * 2000) / 1e6
    assert "node fault" in attacked.procs["gateway"].log_text()

    # a node that reports honestly is billed what it reports
    evil.usage = Usage(prompt_tokens=9, completion_tokens=3, total_tokens=12)
    assert _chat(attacked, key, "evil-model", max_tokens=4).status_code == 200
    after = _usage(attacked, "carol", 3)
    assert (after["prompt_tokens"] - row["prompt_tokens"], after["completion_tokens"] - row["completion_tokens"]) == (
        9,
        3,
    )


def test_the_head_keeps_of_a_nodes_heartbeat_only_the_engines_it_was_given(attacked):
    """The scheduler reads engines from heartbeats for residency, a video's stages and a fine-tune's holders, and
    records them for `/admin/nodes`, `/v1/models` and Ollama's `/api/ps`: an engine claimed for a model not placed
    on the node (tiny, w1's; ghost, nobody's) is dropped there too, with one node fault in the scheduler's log."""

    def evil_engines() -> set[str] | None:
        nodes = httpx.get(f"{attacked.http_url}/admin/nodes", headers=attacked.admin, timeout=10).json()["nodes"]
        found = [n for n in nodes if n["heartbeat"]["node_id"] == "evil"]
        return {e["model"] for e in found[0]["heartbeat"]["engines"]} if found else None

    seen = wait_until(evil_engines, 20, "the evil node in /admin/nodes")
    print(f"the evil node's engines as the head keeps them: {sorted(seen)}")
    assert seen == {"evil-model", "evil-broken"}
    ps = httpx.get(f"{attacked.http_url}/api/ps", headers=attacked.admin, timeout=10).json()["models"]
    print(f"/api/ps: {[(m['name'], m.get('details', {}).get('family')) for m in ps]}")
    assert "ghost" not in {m["name"] for m in ps}
    log = attacked.procs["scheduler"].log_text()
    assert log.count("node fault: node evil claims an engine for model 'tiny', which is not placed on it") == 1
    assert log.count("node fault: node evil claims an engine for model 'ghost', which is not placed on it") == 1
