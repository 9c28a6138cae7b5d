"""More models than memory on a real stack: one worker whose memory budget holds two of its four models. Each is
served in turn with the `openai` SDK, the least recently used idle one evicted for it, while requests to a loaded
model keep answering; a streamed request to an unloaded model gets SSE comments while it loads; keep-alive (the
model's, and Ollama's per request) unloads an idle model. Nothing is restarted."""

from __future__ import annotations

import threading
import time

import httpx
import openai
import pytest

from coderai.testing.procs import wait_until
from coderai.testing.stack import running_stack

pytestmark = pytest.mark.slow

HEARTBEAT_S = 0.5
BUDGET_MB = 250  # each model is placed for 100 MB: two fit, three do not


@pytest.fixture(scope="module")
def stack(tmp_path_factory, tiny_gguf, keys_file, admin_key):
    def tiny(name: str, **kw) -> dict:
        return {
            "name": name,
            "engine": "llama",
            "path": str(tiny_gguf),
            "params": {"n_ctx": 256},
            "memory_mb": 100,
            "replicas": 1,
            **kw,
        }

    models = [
        tiny("busy"),
        tiny("b"),
        tiny("c", resident="on_demand"),
        tiny("brief", resident="on_demand", keep_alive_s=2),
        tiny("huge", memory_mb=BUDGET_MB + 50),
    ]
    with running_stack(
        tmp_path_factory.mktemp("residency"),
        models,
        gateway_args=("--api-keys-file", str(keys_file)),
        ready_model="busy",
        extra_env={"CODERAI_WORKER_MEMORY_BUDGET_MB": str(BUDGET_MB), "CODERAI_WORKER_HEARTBEAT_S": str(HEARTBEAT_S)},
        headers={"Authorization": f"Bearer {admin_key}"},
    ) as s:
        yield s


@pytest.fixture
def client(stack, admin_key):
    return openai.OpenAI(base_url=stack.base_url, api_key=admin_key, max_retries=0, timeout=120)


def loaded(admin: httpx.Client) -> set[str]:
    """The models with an engine on the worker now (any state: a copy being unloaded has left its heartbeat)."""
    nodes = admin.get("/admin/nodes").json()["nodes"]
    return {e["model"] for n in nodes for e in n["heartbeat"].get("engines", [])}


def ask(client: openai.OpenAI, model: str) -> str:
    r = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    return r.choices[0].message.content or ""


class Traffic:
    """Requests to one loaded model, back to back on a thread, until stopped: every status they got."""

    def __init__(self, client: openai.OpenAI, model: str) -> None:
        self.client, self.model = client, model
        self.ok = 0
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                ask(self.client, self.model)
                self.ok += 1
            except openai.APIError as exc:
                self.errors.append(f"{type(exc).__name__}: {exc}")

    def __enter__(self) -> Traffic:
        self._thread.start()
        return self

    def __exit__(self, *_exc) -> None:
        self._stop.set()
        self._thread.join(60)


def test_each_model_is_served_in_turn_evicting_the_least_recently_used_idle_one(stack, admin, client):
    wait_until(lambda: loaded(admin) == {"busy", "b"}, 60, "the two models that fit to load")
    listed = {m.id: m.model_extra["coderai"] for m in client.models.list().data}
    assert listed["busy"]["loaded"] and not listed["c"]["loaded"] and listed["c"]["resident"] == "on_demand"
    with Traffic(client, "busy") as traffic:
        ask(client, "c")  # not loaded: placed now, b (idle) evicted for it, busy kept (it has requests in flight)
        assert loaded(admin) >= {"busy", "c"}
        wait_until(lambda: loaded(admin) == {"busy", "c"}, 30, "b to be unloaded")
        ask(client, "b")  # back, in place of c, the idle one
        wait_until(lambda: loaded(admin) == {"busy", "b"}, 30, "c to be unloaded")
        ask(client, "c")
        wait_until(lambda: traffic.ok >= 3, 60, "requests to the busy model")
    assert traffic.errors == [], "a request to a loaded model failed while others loaded"
    assert loaded(admin) == {"busy", "c"}
    scrape = httpx.get(f"http://127.0.0.1:{stack.metrics_port}/metrics", timeout=10).text
    evictions = [
        line
        for line in scrape.splitlines()
        if line.startswith("coderai_model_unloads_total{") and 'reason="evicted"' in line
    ]
    assert sum(float(line.rsplit(" ", 1)[1]) for line in evictions) >= 2, scrape
    assert not any('model="busy"' in line for line in evictions), "the model in use was evicted"


def test_a_streamed_request_gets_comments_while_its_model_loads(stack, admin, client, admin_key):
    wait_until(lambda: "c" in loaded(admin) or "b" in loaded(admin), 30, "a model to evict")
    target = "b" if "b" not in loaded(admin) else "c"
    body = {"model": target, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "stream": True}
    with httpx.stream(
        "POST",
        f"{stack.base_url}/chat/completions",
        json=body,
        timeout=120,
        headers={"Authorization": f"Bearer {admin_key}"},
    ) as r:
        assert r.status_code == 200
        lines = [line for line in r.iter_lines() if line]
    assert lines[0] == ": loading the model", lines[:3]
    data = [line for line in lines if line.startswith("data: ")]
    assert data[-1] == "data: [DONE]" and len(data) >= 2
    # the SDK reads the same stream (the comments are not events to it)
    target = "b" if target == "c" else "c"
    text = "".join(
        c.choices[0].delta.content or ""
        for c in client.chat.completions.create(
            model=target, messages=[{"role": "user", "content": "hi"}], max_tokens=2, stream=True
        )
        if c.choices
    )
    assert isinstance(text, str) and target in loaded(admin)


def unloads(stack, model: str, reason: str) -> int:
    """How many times the scheduler took `model` off the worker for `reason`, by its log."""
    log = (stack.root / "logs" / "scheduler.log").read_text()
    return log.count(f"unloading {model} from w1 ({reason})")


def test_keep_alive_unloads_an_idle_model_within_its_time_and_a_heartbeat(stack, admin, client):
    ask(client, "brief")  # keep_alive_s = 2
    done = time.monotonic()
    assert "brief" in loaded(admin) and unloads(stack, "brief", "idle") == 0
    # the scheduler decides within its keep-alive plus a heartbeat (slack for a loaded machine); the unload follows
    wait_until(lambda: unloads(stack, "brief", "idle") == 1, 2 + HEARTBEAT_S + 3, "the idle unload of brief")
    assert time.monotonic() - done >= 2, "unloaded before its keep-alive ran out"
    wait_until(lambda: "brief" not in loaded(admin), 30, "brief to be unloaded")


def test_ollama_keep_alive_zero_unloads_right_after_the_answer(stack, admin, admin_key):
    import ollama

    o = ollama.Client(host=stack.http_url, headers={"Authorization": f"Bearer {admin_key}"}, timeout=120)
    r = o.chat(model="b", messages=[{"role": "user", "content": "hi"}], options={"num_predict": 2}, keep_alive=0)
    assert r.done
    wait_until(lambda: "b" not in loaded(admin), HEARTBEAT_S + 15, "b to be unloaded (keep_alive=0)")
    with pytest.raises(ollama.ResponseError) as exc:
        o.chat(model="b", messages=[{"role": "user", "content": "hi"}], keep_alive="soon")
    assert exc.value.status_code == 400 and "keep_alive" in str(exc.value)


def _engine_status(admin: httpx.Client, model: str) -> dict:
    nodes = admin.get("/admin/nodes").json()["nodes"]
    return next((e for n in nodes for e in n["heartbeat"].get("engines", []) if e["model"] == model), {})


def test_a_tenants_keep_alive_never_unloads_nor_pins_a_shared_model(stack, admin, user_key):
    """Attack: a tenant's Ollama `keep_alive: 0` would unload a model every other tenant is using, and `-1` pin an
    on-demand one for good. A key without the admin scope may only keep a model a while (within an hour)."""
    import ollama

    o = ollama.Client(host=stack.http_url, headers={"Authorization": f"Bearer {user_key}"}, timeout=120)
    for asked, want in ((0, None), (-1, None), ("10m", 600.0), (10**9, 3600.0)):
        before = _engine_status(admin, "busy").get("served", 0)
        r = o.chat(
            model="busy", messages=[{"role": "user", "content": "hi"}], options={"num_predict": 2}, keep_alive=asked
        )
        assert r.done
        # the heartbeat after this request was counted says what keep-alive the engine now holds
        status = wait_until(
            lambda: (e := _engine_status(admin, "busy")).get("served", 0) > before and e,
            30,
            "the tenant's request in the heartbeat",
        )
        print(f"a tenant asked keep_alive={asked!r} of a shared model: the engine holds {status.get('keep_alive_s')}")
        assert status.get("keep_alive_s") in (want, None) if want is None else status.get("keep_alive_s") == want
    r = o.generate(model="busy", prompt="", keep_alive=0)  # Ollama's unload idiom, from a tenant: a load
    assert r.done_reason == "load"
    assert "busy" in loaded(admin)


def test_a_model_no_eviction_makes_room_for_is_a_clear_503(stack, client):
    with pytest.raises(openai.APIStatusError) as exc:
        ask(client, "huge")  # 300 MB on a 250 MB budget; it may not burst to pods (the default)
    assert exc.value.status_code == 503 and exc.value.response.headers.get("retry-after")
    assert "'huge' cannot be loaded now: 0 of 1 copies fit" in exc.value.message
    assert "no idle model can be unloaded to make room" in exc.value.message
