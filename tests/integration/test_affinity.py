"""Prefix routing end to end with two workers: conversations stick, survive an engine's death by moving once,
and survive a router restart; two routers agree through the shared `coderai_affinity` bucket."""

from __future__ import annotations

import httpx
import pytest

from coderai.runtime.embedded import NatsServer
from coderai.testing.procs import wait_until
from coderai.testing.stack import Stack, write_models_file

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def duo(tmp_path_factory, tiny_gguf, keys_file, admin_key):
    root = tmp_path_factory.mktemp("affinity")
    models = write_models_file(
        root / "models.toml",
        [
            {"name": "tiny", "engine": "llama", "path": str(tiny_gguf), "params": {"n_ctx": 2048, "n_threads": 1}},
        ],
    )
    nats = NatsServer(root / "nats").start()  # last: nothing that can fail runs before the `try` below
    # the gateway asks the routers for every pick: this module is about them (their restart, two of them agreeing
    # through the bucket); a gateway's own copy of their view picks with the same code (tests/integration/test_local_pick.py)
    env = {"CODERAI_ROUTER_LOG_LEVEL": "DEBUG", "CODERAI_GATEWAY_LOCAL_PICK": "false"}
    stack = Stack(root, nats.url, extra_env=env)
    try:
        stack.start_core(models)
        stack.start_worker("w1")
        stack.start_worker("w2")
        stack.start_gateway("--api-keys-file", str(keys_file))
        headers = {"Authorization": f"Bearer {admin_key}"}
        stack.wait_model_ready("tiny", headers=headers)
        wait_until(lambda: _engines_ready(stack, headers) == 2, 30, "both engines")
        yield stack
    finally:
        stack.stop()
        nats.stop()


class Conversation:
    """A growing chat; each turn returns (engine id, route reason) from the gateway's response headers."""

    def __init__(self, stack: Stack, headers: dict, system: str) -> None:
        self.url = f"{stack.base_url}/chat/completions"
        self.headers = headers
        self.messages = [{"role": "system", "content": f"You are assistant {system}. " * 20}]
        self.n = 0

    def turn(self) -> tuple[str, str]:
        self.n += 1
        self.messages.append({"role": "user", "content": f"question {self.n}"})
        r = httpx.post(
            self.url,
            headers=self.headers,
            timeout=60,
            json={"model": "tiny", "messages": self.messages, "max_tokens": 4, "temperature": 0},
        )
        assert r.status_code == 200, r.text
        self.messages.append({"role": "assistant", "content": r.json()["choices"][0]["message"]["content"] or "ok"})
        return r.headers["Coderai-Engine"], r.headers["Coderai-Route"]


@pytest.fixture
def headers(admin_key):
    return {"Authorization": f"Bearer {admin_key}"}


def test_a_conversation_sticks_to_one_engine(duo, headers):
    for name in ("alpha", "beta", "gamma"):
        conv = Conversation(duo, headers, name)
        first, reason = conv.turn()
        assert reason in ("least_busy", "fallback")
        for _ in range(4):
            assert conv.turn() == (first, "prefix")


@pytest.mark.parametrize("name", ["X-Session-Id", "X-OpenWebUI-Chat-Id", "session-id"])  # ours, Open WebUI's, Codex's
def test_session_header_beats_content(duo, headers, name):
    url = f"{duo.base_url}/chat/completions"
    engines = set()
    for i in range(4):  # unrelated content every time, one session
        r = httpx.post(
            url,
            headers={**headers, name: f"sess-42-{name}"},
            timeout=60,
            json={"model": "tiny", "messages": [{"role": "user", "content": f"topic {i}"}], "max_tokens": 2},
        )
        engines.add(r.headers["Coderai-Engine"])
        if i:
            assert r.headers["Coderai-Route"] == "session"
    assert len(engines) == 1


def test_pin_header_needs_admin_and_wins(duo, headers, user_key):
    url = f"{duo.base_url}/chat/completions"
    body = {"model": "tiny", "messages": [{"role": "user", "content": "pinned"}], "max_tokens": 2}
    r = httpx.post(url, headers={"Authorization": f"Bearer {user_key}", "X-Coderai-Pin": "w2"}, json=body, timeout=60)
    assert r.status_code == 403
    for _ in range(3):
        r = httpx.post(url, headers={**headers, "X-Coderai-Pin": "w2"}, json=body, timeout=60)
        assert (
            r.status_code == 200
            and r.headers["Coderai-Engine"].startswith("w2-")
            and r.headers["Coderai-Route"] == "pin"
        )
    r = httpx.post(url, headers={**headers, "X-Coderai-Pin": "w9"}, json=body, timeout=60)
    assert r.status_code == 503


def test_engine_death_moves_the_conversation_once_then_it_sticks(duo, headers, admin_key):
    conv = Conversation(duo, headers, "phoenix")
    home, _ = conv.turn()
    assert conv.turn() == (home, "prefix")
    victim = "w1" if home.startswith("w1-") else "w2"
    duo.procs[f"worker-{victim}"].kill()
    moved, reason = conv.turn()  # fails over before the first token: the dead engine is excluded
    assert moved != home and reason == "fallback"
    assert conv.turn() == (moved, "prefix")
    assert conv.turn() == (moved, "prefix")
    duo.start_worker(victim)
    wait_until(lambda: _engines_ready(duo, headers) == 2, 30, f"{victim} back")
    assert conv.turn() == (moved, "prefix")  # the healthy new home keeps it


def test_router_restart_keeps_affinity(duo, headers):
    conv = Conversation(duo, headers, "elephant")
    home, _ = conv.turn()
    duo.procs["router"].stop()
    duo.start("router", "coderai.router")
    assert conv.turn() == (home, "prefix")


def test_two_routers_agree(duo, headers):
    duo.start("router2", "coderai.router")
    marks = {name: len(duo.procs[name].log_text()) for name in ("router", "router2")}
    convs = [Conversation(duo, headers, f"pair{i}") for i in range(4)]
    homes = [c.turn()[0] for c in convs]
    for _ in range(5):
        for conv, home in zip(convs, homes):
            assert conv.turn() == (home, "prefix")
    picks = {name: duo.procs[name].log_text()[mark:].count('"msg": "picked ') for name, mark in marks.items()}
    assert picks["router"] > 0 and picks["router2"] > 0, picks  # both answered, and they agreed


def test_engines_report_real_prefix_reuse(duo, headers):
    conv = Conversation(duo, headers, "cache")
    for _ in range(3):
        conv.turn()
    url = f"http://127.0.0.1:{duo.metrics_port}/metrics"

    def reused() -> bool:
        text = httpx.get(url).text
        values = [
            float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line.startswith("coderai_engine_cached_prompt_tokens{")
        ]
        return any(v > 0 for v in values) and 'coderai_route_decisions_total{reason="prefix"}' in text

    wait_until(reused, 15, "cached prompt tokens in the heartbeat metrics")


def _engines_ready(stack: Stack, headers: dict) -> int:
    """Distinct engines reachable, probed by pinning each node in turn."""
    ok = 0
    for node in ("w1", "w2"):
        r = httpx.post(
            f"{stack.base_url}/chat/completions",
            headers={**headers, "X-Coderai-Pin": node},
            timeout=30,
            json={"model": "tiny", "messages": [{"role": "user", "content": "ready?"}], "max_tokens": 1},
        )
        ok += r.status_code == 200
    return ok


def test_a_tenant_sees_an_opaque_engine_handle_not_a_node_id(duo, headers, user_key):
    """Node ids (often host names) are the operator's: a tenant's `Coderai-Engine` is an opaque handle, the same for
    every turn that reaches the same engine (a session still shows it returned to its cache); an admin sees ids."""
    url = f"{duo.base_url}/chat/completions"
    body = {"model": "tiny", "messages": [{"role": "user", "content": "who answers"}], "max_tokens": 2}
    tenant = {"Authorization": f"Bearer {user_key}", "X-Session-Id": "handle-check"}
    seen = {httpx.post(url, headers=tenant, json=body, timeout=60).headers["Coderai-Engine"] for _ in range(3)}
    assert len(seen) == 1 and not any(n in h for h in seen for n in ("w1", "w2")), seen
    handle = seen.pop()
    assert handle.startswith("e-") and len(handle) == 18
    admin = httpx.post(url, headers={**headers, "X-Session-Id": "handle-check-admin"}, json=body, timeout=60)
    assert admin.headers["Coderai-Engine"].split("-")[0] in ("w1", "w2")
    print(f"a tenant sees engine {handle}; an admin sees {admin.headers['Coderai-Engine']}")
