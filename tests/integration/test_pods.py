"""Escalation to rented pods against the fake RunPod API, whose pods are real engine-worker processes that join
this stack's NATS (auth on, each pod with a user of its own that ends with it) with their model.

One stack: `home` lives on node w1 and bursts when busy; `big` fits no node and bursts when it does not fit;
`stay` never bursts; `capped` has a budget too small for any pod; `spot` (the echo engine, paced like a model)
fits no node and bursts to spot pods; `quick` (echo, paced) lives on w1 and bursts when busy. The pod-broker
reconciles every half second, reaps idle pods after 3 s and scans for orphans every 2 s; pods heartbeat every
half second."""

from __future__ import annotations

import asyncio
import json
import threading
import time
import uuid

import httpx
import pytest

from coderai.runtime.embedded import NatsServer
from coderai.testing.procs import wait_until
from coderai.testing.stack import Stack, write_models_file

pytestmark = pytest.mark.slow
pytest.importorskip("graphql")
pytest.importorskip("llama_cpp")

from coderai.testing.browser import full_page_png, open_signed_out, sign_in, text, wait
from coderai.testing.fake_runpod import FakeRunPod, worker_pods

ADMIN = "sk-pods-admin-0123456789"


@pytest.fixture(scope="module")
def env(tmp_path_factory, tiny_gguf, redis_server):
    from coderai.accounts.keyfile import KeyRecord, hash_key, write_keys

    root = tmp_path_factory.mktemp("pods")
    keys = root / "keys.toml"
    write_keys(str(keys), [KeyRecord(name="admin", sha256=hash_key(ADMIN), scopes=["inference", "admin"])])
    gguf = str(tiny_gguf)
    chat = {"n_ctx": 4096}
    models = [
        {
            "name": "home",
            "engine": "llama",
            "path": gguf,
            "params": chat,
            "nodes": ["w1"],
            "pod": {
                "burst": "when_busy",
                "busy_in_flight": 1,
                "max_pods": 1,
                "idle_timeout_s": 3,
                "max_hourly_usd": 1.0,
            },
        },
        {
            "name": "big",
            "engine": "llama",
            "path": gguf,
            "params": chat,
            "memory_mb": 100_000,
            "pod": {"burst": "when_no_fit", "gpu_count": 2, "idle_timeout_s": 600, "budget_usd": 50},
        },
        {"name": "stay", "engine": "llama", "path": gguf, "nodes": ["nowhere"]},
        {
            "name": "capped",
            "engine": "llama",
            "path": gguf,
            "nodes": ["nowhere"],
            "pod": {"burst": "when_no_fit", "budget_usd": 0.0001, "period": "day"},
        },
        {
            "name": "spot",
            "engine": "echo",
            "path": "-",
            "params": {"token_delay_s": 0.05},
            "nodes": ["nowhere"],
            "pod": {"burst": "when_no_fit", "spot": True, "idle_timeout_s": 600, "max_hourly_usd": 1.0},
        },
        {
            "name": "quick",
            "engine": "echo",
            "path": "-",
            "params": {"token_delay_s": 0.05},
            "nodes": ["w1"],
            "pod": {"burst": "when_busy", "busy_in_flight": 1, "max_hourly_usd": 1.0},
        },
    ]
    deployment = "t" + uuid.uuid4().hex[:6]
    pod = worker_pods(root / "pods")
    fake = FakeRunPod(
        launch=lambda env: pod({**env, "CODERAI_WORKER_FAMILIES": "llama,echo", "CODERAI_WORKER_HEARTBEAT_S": "0.5"})
    ).start()
    nats = None
    stack = None
    try:  # each is stopped whatever happens, however far the set-up got
        nats = NatsServer.secured(root / "nats").start()  # pods log in with users of their own, made for each pod
        prefix = f"coderai:pods:{deployment}"  # one setting for the broker (writes), the gateway and metrics (read)
        stack = Stack(
            root,
            nats.service_url,
            redis_server.url,
            {
                "CODERAI_WORKER_MDNS": "false",
                "CODERAI_WORKER_FAMILIES": "llama,echo",
                "CODERAI_POD_LEDGER_PREFIX": prefix,
            },
        )
        stack.nats = nats
        stack.start_core(write_models_file(root / "models.toml", models))
        stack.start(
            "pod-broker",
            "coderai.pod_broker",
            env={
                "CODERAI_POD_BROKER_RUNPOD_API_KEY": fake.api_key,
                "CODERAI_POD_BROKER_RUNPOD_API_BASE": fake.base_url,
                "CODERAI_POD_BROKER_REDIS_URL": redis_server.url,
                "CODERAI_POD_BROKER_POD_NATS_URL": nats.url,
                "CODERAI_POD_BROKER_DEPLOYMENT": deployment,
                "CODERAI_POD_BROKER_MAX_HOURLY_USD": "20",
                "CODERAI_POD_BROKER_BOOT_TIMEOUT_S": "25",
                "CODERAI_POD_BROKER_RECONCILE_S": "0.5",
                "CODERAI_POD_BROKER_ORPHAN_SCAN_S": "2",
            },
        )
        stack.start_worker("w1")
        stack.start_gateway(
            "--api-keys-file",
            str(keys),
            env={"CODERAI_GATEWAY_REDIS_URL": redis_server.url, "CODERAI_GATEWAY_ESCALATE_WAIT_S": "40"},
        )
        stack.wait_model_ready("home", headers=auth())
        yield stack, fake, deployment
    finally:
        if stack is not None:
            stack.stop()
        fake.close()
        if nats is not None:
            nats.stop()


def auth() -> dict[str, str]:
    return {"Authorization": f"Bearer {ADMIN}"}


def chat(stack, model: str, max_tokens: int = 4, **kw) -> httpx.Response:
    body = {"model": model, "messages": [{"role": "user", "content": "hello"}], "max_tokens": max_tokens, **kw}
    return httpx.post(f"{stack.base_url}/chat/completions", json=body, headers=auth(), timeout=90)


def pods(stack) -> list[dict]:
    r = httpx.get(f"{stack.http_url}/admin/pods", headers=auth(), timeout=10)
    assert r.status_code == 200, r.text
    return r.json()["pods"]


def live(stack, model: str) -> list[dict]:
    return [p for p in pods(stack) if p["model"] == model and p["state"] in ("creating", "booting", "ready")]


def over(stack, fake, pod: dict) -> dict | None:
    """The broker's record of `pod` once it is over: billed (terminated, failed or preempted) and terminated at
    RunPod; None before. Out of `live` is not over: a `stopping` pod holds its GPU until the broker's terminate
    lands, and that gives the GPU back to RunPod's stock (undoing a capacity set in between)."""
    rec = next((p for p in pods(stack) if p["name"] == pod["name"]), None)
    done = rec is not None and rec["state"] in ("terminated", "failed", "preempted")
    return rec if done and fake.pod(pod["pod_id"]).status == "TERMINATED" else None


def end_pods(stack, fake, model: str) -> None:
    """End the model's pods by hand: crash each (RunPod keeps billing it), and wait until the broker has noticed,
    terminated it at RunPod and billed it."""
    ended = live(stack, model)
    for p in ended:
        fake.crash(p["pod_id"])
    wait_until(
        lambda: not live(stack, model) and all(over(stack, fake, p) for p in ended),
        60,
        f"{model}'s pods to be terminated and billed",
    )


def test_never_is_503_and_nothing_is_rented(env):
    stack, fake, _ = env
    r = chat(stack, "stay")
    assert r.status_code == 503, r.text
    assert "burst" in r.json()["error"]["message"] and not [p for p in pods(stack) if p["model"] == "stay"]


def test_a_spent_budget_is_429_naming_the_model_budget_and_reset(env):
    stack, fake, _ = env
    r = chat(stack, "capped")
    assert r.status_code == 429, r.text
    msg = r.json()["error"]["message"]
    assert "'capped'" in msg and "day budget" in msg and "resets at" in msg
    assert not any(p.name.startswith("coderai-") and "capped" in p.name for p in fake.pods())


def test_when_no_fit_a_pod_serves_the_model(env):
    stack, fake, _ = env
    r = chat(stack, "big")
    assert r.status_code == 200, r.text
    # the router may see the pod's engine a moment before the broker's next round marks the pod ready
    [pod] = wait_until(lambda: [p for p in live(stack, "big") if p["state"] == "ready"], 10, "the pod to be ready")
    assert r.headers["coderai-engine"].startswith(pod["name"])
    assert pod["gpu_count"] == 2 and pod["gpu_type"] == "NVIDIA A100 80GB PCIe"  # cheapest with 2 x 80 GB >= 98 GB
    assert pod["cost_usd"] > 0  # live cost while it runs
    # it logged in as a user of its own, made for this pod alone, with an end
    from coderai.runtime.members import load

    member = load(stack.nats.members_file).members[pod["name"]]
    assert member.kind == "pod" and member.expires_at > 0


def test_the_cluster_page_shows_the_rented_pod_and_the_spend(env, browser, artifacts):
    stack, fake, _ = env
    [pod] = wait_until(
        lambda: [p for p in live(stack, "big") if p["state"] == "ready"], 30, "big's pod"
    )  # the test above
    open_signed_out(browser, stack.http_url)
    sign_in(browser, ADMIN)
    row = f'#pods tr[data-pod="{pod["name"]}"]'
    wait(
        browser,
        "big's pod with its GPUs and live cost",
        lambda d: "ready" in text(d, row) and "2 × NVIDIA A100 80GB PCIe" in text(d, row) and "$" in text(d, row),
    )
    wait(
        browser,
        "big's pod spend against its budget",
        lambda d: "$50.00 / day" in text(d, '#spend tr[data-model="big"]'),
    )
    (artifacts / "ui-pods.png").write_bytes(full_page_png(browser))


def test_when_busy_the_extra_request_is_served_by_a_pod(env):
    stack, fake, _ = env
    stop = threading.Event()

    def hold() -> None:  # pinned to w1: keeps the local engine busy however fast it is, and never escalates
        while not stop.is_set():
            body = {"model": "home", "messages": [{"role": "user", "content": "busy"}], "max_tokens": 300}
            httpx.post(
                f"{stack.base_url}/chat/completions", json=body, timeout=90, headers={**auth(), "X-Coderai-Pin": "w1"}
            )

    holders = [threading.Thread(target=hold) for _ in range(2)]
    for t in holders:
        t.start()
    try:
        wait_until(
            lambda: any(
                e["model"] == "home" and e["in_flight"]
                for n in _nodes(stack)
                for e in n["heartbeat"].get("engines", [])
            ),
            30,
            "the local engine to be busy",
        )
        extra = chat(stack, "home")
        # read before the holders are joined: under load that takes long enough for the idle pod to be reaped,
        # so the pod is looked up among every pod rented for the model, whatever its state now
        rented = [p["name"] for p in pods(stack) if p["model"] == "home"]
    finally:
        stop.set()
        for t in holders:
            t.join(90)
    assert extra.status_code == 200, extra.text
    assert any(extra.headers["coderai-engine"].startswith(name) for name in rented), (rented, extra.headers)


def _nodes(stack) -> list[dict]:
    return httpx.get(f"{stack.http_url}/admin/nodes", headers=auth(), timeout=10).json()["nodes"]


def test_an_idle_pod_is_reaped_and_billed(env):
    stack, fake, _ = env
    wait_until(
        lambda: (
            not live(stack, "home") and any(p["model"] == "home" and p["state"] == "terminated" for p in pods(stack))
        ),
        60,
        "the idle pod to be reaped",
    )
    [pod] = [p for p in pods(stack) if p["model"] == "home"]
    fp = next(p for p in fake.pods() if p.name == pod["name"])
    assert fp.status == "TERMINATED" and pod["cost_usd"] == pytest.approx(fake.billed_usd(fp.id), abs=0.01)
    from coderai.runtime.members import load

    assert pod["name"] not in load(stack.nats.members_file).members  # its credentials ended with it


def test_a_crashed_pod_is_billed_and_the_next_request_rents_another(env):
    stack, fake, _ = env
    [before] = live(stack, "big")
    fake.crash(before["pod_id"])
    failed = wait_until(lambda: over(stack, fake, before), 60, "the crash to be noticed and billed")
    assert failed["state"] == "failed" and "heartbeat" in failed["error"]
    r = chat(stack, "big")
    assert r.status_code == 200, r.text
    [after] = live(stack, "big")
    assert after["name"] != before["name"]


def test_capacity_falls_back_to_the_next_type(env):
    stack, fake, _ = env
    end_pods(stack, fake, "big")  # its A100 is back in stock before the capacity is set
    fake.set_capacity("NVIDIA A100 80GB PCIe", 0)
    r = chat(stack, "big")
    assert r.status_code == 200, r.text
    [pod] = live(stack, "big")
    assert pod["gpu_type"] == "NVIDIA H100 80GB HBM3"


def test_runpod_errors_are_retried_and_leave_no_untracked_pod(env):
    stack, fake, _ = env
    end_pods(stack, fake, "big")
    before = {p.id for p in fake.pods()}
    fake.fail_next(3, status=503)  # the GPU list, then the create itself, fail first
    r = chat(stack, "big")
    assert r.status_code == 200, r.text
    new = [p for p in fake.pods() if p.id not in before]
    assert len(new) == 1 and new[0].name == live(stack, "big")[0]["name"]


def test_a_pod_that_never_boots_is_terminated_billed_and_the_request_fails_clearly(env):
    stack, fake, _ = env
    end_pods(stack, fake, "big")
    fake.never_boot(count=1)
    r = chat(stack, "big")
    assert r.status_code == 503 and "starting" in r.json()["error"]["message"], r.text
    assert r.headers.get("retry-after")
    wait_until(lambda: not live(stack, "big"), 60, "the broker to give up on the pod")
    dead = max((p for p in pods(stack) if p["model"] == "big"), key=lambda p: p["created_at"])
    assert dead["state"] == "failed" and "never became ready" in dead["error"] and dead["cost_usd"] > 0
    assert fake.pod(dead["pod_id"]).status == "TERMINATED"


def test_an_orphan_named_for_this_deployment_is_terminated(env):
    stack, fake, deployment = env
    from coderai.pod_broker.runpod_api import RunPodClient

    async def rent() -> str:
        async with RunPodClient(fake.api_key, fake.base_url) as api:
            rec = await api.create_pod(f"coderai-{deployment}-stray-abc123", "img", "NVIDIA GeForce RTX 4090")
            other = await api.create_pod("someone-elses-pod", "img", "NVIDIA GeForce RTX 4090")
            return rec.id, other.id

    mine, theirs = asyncio.run(rent())
    wait_until(lambda: fake.pod(mine).status == "TERMINATED", 30, "the orphan to be terminated")
    assert fake.pod(theirs).status != "TERMINATED"


def test_a_spot_pod_preempted_mid_stream_ends_the_stream_with_an_error_and_both_pods_are_billed_exactly(env):
    stack, fake, deployment = env
    body = {"model": "spot", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 1000, "stream": True}
    with httpx.stream("POST", f"{stack.base_url}/chat/completions", json=body, headers=auth(), timeout=90) as r:
        assert r.status_code == 200
        events = (json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {"))
        next(e for e in events if e["choices"] and e["choices"][0]["delta"].get("content"))  # the stream is on
        [first] = live(stack, "spot")
        assert first["spot"] and first["hourly_usd"] == 0.35 and fake.pod(first["pod_id"]).spot  # the 4090's bid
        fake.preempt(first["pod_id"])  # RunPod's 5 s warning (SIGTERM), then SIGKILL
        rest = list(events)  # a read timeout here would be a hang
    assert "error" in rest[-1] and rest[-1]["error"]["message"], rest[-1]
    assert sum(1 for e in rest if "choices" in e) < 1000  # cut mid-way, not finished
    preempted = wait_until(lambda: over(stack, fake, first), 60, "the preemption to be noticed and billed")
    assert preempted["state"] == "preempted" and "preempted" in preempted["error"]

    # nothing rented a replacement in between: this request does (the router dropped the pod's engine as soon as
    # its worker said it was leaving, before the broker gave the pod up: 8 s without a heartbeat)
    r = chat(stack, "spot")
    assert r.status_code == 200, r.text
    [second] = live(stack, "spot")
    assert second["name"] != first["name"] and r.headers["coderai-engine"].startswith(second["name"])
    end_pods(stack, fake, "spot")  # a crash this time: billed to its termination
    names = (first["name"], second["name"])
    booked = {e.pod_id: e for e in asyncio.run(_ledger(stack, deployment)) if e.pod_id in names}
    assert len(booked) == 2  # each booked, once (the ledger has one entry per pod)
    for p in (first, second):
        # RunPod stopped billing the preempted pod when it took it back (its SIGTERM), to which it is booked (its
        # worker's first `leaving` heartbeat); the crashed one is billed to the middle of its terminate call
        entry, billed = booked[p["name"]], fake.pod(p["pod_id"]).intervals
        assert entry.usd == pytest.approx(fake.billed_usd(p["pod_id"]), abs=p["hourly_usd"] / 3600), (
            p["name"],
            (entry.start, entry.end),
            billed,
        )


async def _ledger(stack, deployment: str) -> list:
    import redis.asyncio as aioredis

    from coderai.accounts.pod_money import PodMoney

    r = aioredis.from_url(stack.redis_url)
    try:
        return await PodMoney(r, prefix=f"coderai:pods:{deployment}").ledger()
    finally:
        await r.aclose()


def test_a_runpod_outage_never_slows_local_serving_and_is_said_once(env):
    stack, fake, _ = env
    stack.wait_model_ready("quick", headers=auth())
    pinned = {**auth(), "X-Coderai-Pin": "w1"}  # a pinned request never escalates
    body = {"model": "quick", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    url, log = f"{stack.base_url}/chat/completions", stack.procs["pod-broker"]
    offset = len(log.log_text())
    holder = threading.Thread(
        target=lambda: httpx.post(url, json={**body, "max_tokens": 600}, headers=pinned, timeout=90)
    )
    holder.start()  # keeps quick busy for 30 s: an unpinned request escalates, and would rent a pod
    try:
        wait_until(
            lambda: any(
                e["model"] == "quick" and e["in_flight"]
                for n in _nodes(stack)
                for e in n["heartbeat"].get("engines", [])
            ),
            30,
            "quick to be busy",
        )
        fake.outage(503)
        wait_until(
            lambda: httpx.get(f"{stack.http_url}/admin/pods", headers=auth(), timeout=10).json()["outage"],
            30,
            "the broker to notice RunPod is down",
        )
        status = httpx.get(f"{stack.http_url}/admin/pods", headers=auth(), timeout=10).json()
        assert "RunPod's API has been failing since" in status["outage"] and "503" in status["outage"]

        def took(headers: dict[str, str]) -> float:
            started = time.monotonic()
            r = httpx.post(url, json=body, headers=headers, timeout=60)
            assert r.status_code == 200 and r.headers["coderai-engine"].startswith("w1"), r.text
            return time.monotonic() - started

        for _ in range(3):  # escalated, refused at once (RunPod is down), served by the busy engine: as fast as pinned
            assert took(auth()) < took(pinned) + 1.0
        assert not live(stack, "quick")
        said = log.log_text()[offset:]
        assert said.count("RunPod's API is failing") == 1, said[-3000:]  # once, for every request and scan
    finally:
        fake.outage(None)
        holder.join(90)
    wait_until(
        lambda: not httpx.get(f"{stack.http_url}/admin/pods", headers=auth(), timeout=10).json()["outage"],
        30,
        "the broker to notice RunPod answers again",
    )
    assert "RunPod's API answers again" in log.log_text()[offset:]


def test_the_ledger_equals_what_runpod_billed_to_the_cent(env):
    stack, fake, _ = env
    for p in live(stack, "big"):
        fake.crash(p["pod_id"])
    wait_until(
        lambda: all(p["state"] in ("terminated", "failed", "preempted") for p in pods(stack)),
        60,
        "every pod to be billed",
    )
    ours = [p for p in fake.pods() if not p.name.startswith("someone")]
    wait_until(lambda: all(p.status == "TERMINATED" for p in ours), 30, "RunPod to have terminated them")
    spend = httpx.get(f"{stack.http_url}/admin/spend", headers=auth(), timeout=10).json()
    assert abs(spend["ledger_total_usd"] - sum(fake.billed_usd(p.id) for p in ours)) < 0.005  # to the cent
    assert spend["ledger_total_usd"] > 0
