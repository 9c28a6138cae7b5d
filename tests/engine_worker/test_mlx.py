"""The mlx engine against a real mlx_lm.server (PyPI `mlx[cpu]` + `mlx-lm`, the `mlx` extra) on the tiny random HF
llama, on the CPU: answers, streams, usage, refusals, cancel, the child's key and pinned model, a crash and a bad
folder. One server for the module (~5-12 s to start on 2 cores)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest

from coderai.contracts import ChatJob, ModelConfig, SamplingParams
from coderai.engine_worker.engines import BadInput, EngineLoadError, available_families, engine_class
from coderai.engine_worker.engines.base import CancelFlag
from coderai.testing.jobs import chat, completion

pytest.importorskip("mlx.core", reason="the mlx extra is not installed")
pytest.importorskip("mlx_lm", reason="the mlx extra is not installed")

from coderai.engine_worker.engines import mlx_serve  # noqa: E402 (needs mlx_lm)
from coderai.engine_worker.engines.mlx import KEY_ENV, model_folder, server_command  # noqa: E402

pytestmark = pytest.mark.slow

EOS = "<|im_end|>"  # the tiny model's end of turn; biased away where a long answer is wanted


def config(path: str, **params) -> ModelConfig:
    return ModelConfig(name="tiny", engine="mlx", path=path, params={"load_timeout_s": 120, **params})


@pytest.fixture(scope="module")
def model_dir() -> str:
    from coderai.testing.tiny_hf_llama import tiny_hf_llama

    return str(tiny_hf_llama())


@pytest.fixture(scope="module")
def engine(model_dir):
    e = engine_class("mlx")(config(model_dir, max_tokens=64))
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


def server_log(engine) -> str:
    with open(engine.log_path, encoding="utf-8", errors="replace") as fh:
        return fh.read()


def eos_id(model_dir: str) -> int:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir).convert_tokens_to_ids(EOS)


def test_mlx_is_offered_where_mlx_lm_imports():
    assert "mlx" in available_families()


def test_every_param_is_a_flag_mlx_lm_server_parses(model_dir):
    """The family's params, each set, through the real argparse of the installed mlx_lm.server (`--help` last:
    every flag before it is parsed and converted first, and nothing is loaded)."""
    params = {
        "max_tokens": 100,
        "chat_template": "{{ messages[0]['content'] }}",
        "use_default_chat_template": True,
        "chat_template_args": {"enable_thinking": False},
        "trust_remote_code": True,
        "adapter_path": "/nonexistent/adapter",
        "draft_model": "/nonexistent/draft",
        "num_draft_tokens": 4,
        "temp": 0.7,
        "top_p": 0.9,
        "top_k": 40,
        "min_p": 0.05,
        "decode_concurrency": 8,
        "prompt_concurrency": 4,
        "prefill_step_size": 512,
        "prompt_cache_size": 4,
        "prompt_cache_bytes": 1 << 30,
        "kv_bits": 8,
        "kv_group_size": 64,
        "quantized_kv_start": 1000,
        "log_level": "WARNING",
        "load_timeout_s": 60,
        "env": {"X": "1"},
        "extra_args": ["--allowed-origins", "http://a.example"],
        "crash_limit": 3,
        "crash_window_s": 60,
    }
    from coderai.contracts.families import FAMILIES

    assert set(params) == set(FAMILIES["mlx"].params)
    cmd = server_command(sys.executable, model_dir, 8080, params) + ["--help"]
    assert "--load-timeout-s" not in cmd and "--env" not in cmd and "--crash-limit" not in cmd
    assert cmd[cmd.index("--chat-template-args") + 1] == '{"enable_thinking": false}'
    run = subprocess.run(cmd, env={**os.environ, KEY_ENV: "k"}, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "MLX Http Server" in run.stdout


def test_a_server_without_its_key_refuses_to_start(model_dir):
    env = {k: v for k, v in os.environ.items() if k != KEY_ENV}
    run = subprocess.run(
        server_command(sys.executable, model_dir, 8080, {}), env=env, capture_output=True, text=True, timeout=120
    )
    assert run.returncode != 0 and KEY_ENV in run.stderr


def test_chat_answers_with_usage(engine):
    choices, usage = engine.chat(chat(), CancelFlag(), None)
    assert len(choices) == 1 and choices[0].message["role"] == "assistant"
    assert isinstance(choices[0].message["content"], str) and choices[0].message["content"]
    assert choices[0].finish_reason in ("stop", "length")
    assert usage.prompt_tokens > 0 and 0 < usage.completion_tokens <= 8
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens


def test_chat_stream_yields_deltas_then_a_finish_reason_and_usage(engine):
    whole, whole_usage = engine.chat(chat(params={"max_tokens": 12}), CancelFlag(), None)
    pieces: list[tuple] = []
    choices, usage = engine.chat(
        chat(stream=True, params={"max_tokens": 12}), CancelFlag(), lambda d, t, f, **_: pieces.append((d, t, f))
    )
    assert choices == []
    assert all(t is None for _, t, _ in pieces)
    assert "".join((d or {}).get("content", "") for d, _, _ in pieces) == whole[0].message["content"]
    assert pieces[-1][2] == whole[0].finish_reason and all(f is None for _, _, f in pieces[:-1])
    # usage arrives only because the engine asks for it (stream_options.include_usage), in a last event of its own
    assert usage.prompt_tokens == whole_usage.prompt_tokens > 0
    assert usage.completion_tokens == whole_usage.completion_tokens > 0


def test_completion_whole_and_streamed(engine):
    choices, usage = engine.complete(completion(), CancelFlag(), None)
    assert choices[0].text and usage.completion_tokens <= 5 and usage.prompt_tokens > 0
    pieces: list[tuple] = []
    _, streamed = engine.complete(completion(stream=True), CancelFlag(), lambda d, t, f, **_: pieces.append((d, t, f)))
    assert all(d is None for d, _, _ in pieces)
    assert "".join(t or "" for _, t, _ in pieces) == choices[0].text
    assert pieces[-1][2] in ("stop", "length")
    assert (streamed.prompt_tokens, streamed.completion_tokens) == (usage.prompt_tokens, usage.completion_tokens)


def test_the_model_default_answer_length_is_the_max_tokens_param(engine, model_dir):
    job = ChatJob(
        request_id="r",
        model="tiny",
        messages=[{"role": "user", "content": "hi"}],
        params=SamplingParams(temperature=0.0, logit_bias={str(eos_id(model_dir)): -100.0}),
    )
    choices, usage = engine.chat(job, CancelFlag(), None)
    assert usage.completion_tokens == 64 and choices[0].finish_reason == "length"


@pytest.mark.parametrize(
    ("job", "param"),
    [
        (chat(params={"n": 2}), "n"),
        (chat(params={"logprobs": True, "top_logprobs": 2}), "logprobs"),
        (chat(response_format={"type": "json_object"}), "response_format"),
        (chat(tool_choice="required"), "tool_choice"),
        (completion(echo=True), "echo"),
        (completion(params={"n": 3}), "n"),
    ],
)
def test_what_it_would_not_honour_is_refused_before_it_runs(engine, job, param):
    run = engine.chat if isinstance(job, ChatJob) else engine.complete
    with pytest.raises(BadInput) as err:
        run(job, CancelFlag(), None)
    assert err.value.param == param


def test_an_image_part_is_refused_and_never_fetched(engine):
    """mlx_lm.server fetches an http(s) image URL itself: the engine refuses the part before a request is sent."""
    job = ChatJob(
        request_id="r",
        model="tiny",
        messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://127.0.0.1:9/x"}}]}],
        params=SamplingParams(max_tokens=4),
    )
    assert engine.media_takes() == frozenset()
    with pytest.raises(BadInput) as err:
        engine.chat(job, CancelFlag(), None)
    assert err.value.param == "messages[0].content[0]"


def test_the_server_itself_never_fetches_an_image_url(engine):
    """mlx_lm.server fetched an http(s) image URL a request named, from the worker's network: mlx_serve turns that
    off, so even a request with the key that names one is refused without a connection to the URL."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    listener.setblocking(False)
    port = listener.getsockname()[1]
    try:
        part = {"type": "image_url", "image_url": {"url": f"http://127.0.0.1:{port}/secret.png"}}
        body = {"messages": [{"role": "user", "content": [part]}], "max_tokens": 4}
        r = httpx.post(engine.base_url + "/v1/chat/completions", json=body, headers=engine.auth_headers(), timeout=60)
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
        with pytest.raises(BlockingIOError):  # the answer came after the fetch would have: nobody connected
            listener.accept()
    finally:
        listener.close()


@pytest.mark.parametrize("stream", [False, True])
def test_a_request_the_server_refuses_is_a_clean_bad_input_and_the_server_lives_on(engine, stream):
    """An empty prompt killed mlx_lm.server's generation thread (every later request then got a 503): mlx_serve
    refuses it with the request, as an OpenAI error object, and the server goes on serving."""
    pid = engine.proc.pid
    emit = (lambda d, t, f, **_: None) if stream else None
    with pytest.raises(BadInput) as err:
        engine.complete(completion(""), CancelFlag(), emit)
    assert str(err.value) == "mlx_lm.server: the prompt is empty: there is nothing to continue"
    with pytest.raises(BadInput) as err:
        engine.chat(
            ChatJob(request_id="r", model="tiny", messages=[], params=SamplingParams(max_tokens=4)), CancelFlag(), emit
        )
    assert "empty conversation" in str(err.value)
    assert engine.proc.pid == pid and engine.restarts == 0
    assert engine.chat(chat(), CancelFlag(), None)[0][0].message["content"]


def test_cancel_stops_a_long_stream_and_the_server_stops_generating(engine, model_dir):
    cancel = CancelFlag()
    pieces: list[str | None] = []

    def emit(delta, text, finish, **_):
        pieces.append(finish)
        if len(pieces) == 3:
            cancel.set()

    job = chat(stream=True, params={"max_tokens": 4000, "logit_bias": {str(eos_id(model_dir)): -100.0}})
    started = time.monotonic()
    engine.chat(job, cancel, emit)
    assert len(pieces) == 3 and pieces[-1] is None
    # the server learns of it at its next write, stops the request's generation and logs that it did
    wait_for(lambda: "the client went away; its generation was stopped" in server_log(engine), 30)
    assert time.monotonic() - started < 30
    assert engine.chat(chat(), CancelFlag(), None)[0][0].message["content"]


def test_the_child_wants_its_key_on_every_route_but_health(engine):
    """A local user who finds the loopback port is not served, and cannot make it load anything."""
    url = engine.base_url
    for method, path in (("POST", "/v1/chat/completions"), ("POST", "/v1/completions"), ("GET", "/v1/models")):
        body = {"messages": [{"role": "user", "content": "hi"}], "prompt": "x", "model": "/etc"}
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": engine.api_key}):
            r = httpx.request(method, url + path, json=body, headers=headers, timeout=30)
            assert r.status_code == 401, (path, headers)
            assert r.json()["error"]["message"] == "a missing or wrong API key"
    assert httpx.get(url + "/health", timeout=30).status_code == 200


def test_with_its_key_a_request_still_gets_only_the_loaded_model(engine):
    """Even with the key, a body naming another model, an adapter or a draft model is served by the command
    line's model (mlx_lm.server would load those paths); the engine never sends those names anyway."""
    url, headers = engine.base_url, engine.auth_headers()
    base = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 6, "temperature": 0.0}
    own = httpx.post(url + "/v1/chat/completions", json=base, headers=headers, timeout=60).json()
    for extra in ({"model": "/etc"}, {"adapters": "/tmp"}, {"draft_model": "/"}, {"model": "default_model"}):
        r = httpx.post(url + "/v1/chat/completions", json={**base, **extra}, headers=headers, timeout=60)
        assert r.status_code == 200, (extra, r.text)
        assert r.json()["choices"][0]["message"] == own["choices"][0]["message"]
    models = httpx.get(url + "/v1/models", headers=headers, timeout=30).json()["data"]
    assert [m["id"] for m in models] == [os.path.realpath(engine.config.path)]


def test_the_body_names_the_folder_and_drops_what_chooses_the_model(engine):
    job = chat(options={"adapters": "/x", "draft_model": "/y", "num_draft_tokens": 9, "chat_template_kwargs": {}})
    body = engine.chat_body(job, stream=False)
    assert body["model"] == model_folder(engine.config) == os.path.abspath(engine.config.path)
    assert not {"adapters", "draft_model", "num_draft_tokens"} & set(body)
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    assert "tools" not in engine.chat_body(chat(tools=tools, tool_choice="none"), stream=False)
    assert engine.chat_body(chat(tools=tools, tool_choice="auto"), stream=False)["tools"] == tools


def test_a_folder_that_is_no_model_fails_the_load_at_once_with_the_log_tail(tmp_path):
    """mlx_lm.server loads in a thread and, when that fails, serves 503s forever: mlx_serve exits instead, so the
    load fails in seconds with why, not after load_timeout_s."""
    (tmp_path / "config.json").write_text("{}")
    e = engine_class("mlx")(config(str(tmp_path), load_timeout_s=300))
    started = time.monotonic()
    with pytest.raises(EngineLoadError) as err:
        e.load()
    assert e.proc is None and e.hub_cache == ""  # nothing of it is left, closed or not
    message = str(err.value)
    assert "exited with code 3" in message and "its log ends" in message
    assert "generation thread died" in message
    assert time.monotonic() - started < 120


def test_a_missing_folder_fails_before_any_server_starts():
    e = engine_class("mlx")(config("/nonexistent/coderai-mlx-model"))
    with pytest.raises(EngineLoadError, match="no such model folder"):
        e.load()
    assert e.proc is None


def test_a_killed_server_is_reported_lost_restarted_and_serves_again(engine):
    lost: list[str] = []
    back = threading.Event()
    engine.on_lost, engine.on_back = lost.append, back.set
    try:
        old = engine.proc.pid
        os.kill(old, signal.SIGKILL)
        wait_for(lambda: lost, 30)
        assert "mlx_lm.server exited with code -9" in lost[0]
        assert back.wait(120) and engine.restarts == 1 and engine.proc.pid != old
        assert engine.chat(chat(), CancelFlag(), None)[0][0].message["content"]
    finally:
        engine.on_lost = engine.on_back = None


def test_close_ends_the_server_and_removes_its_hub_cache(engine):
    # last in the file: it closes the shared engine (close is idempotent, so the fixture's teardown is fine)
    group, hub = engine.proc.pid, engine.hub_cache
    assert os.path.isdir(hub) and os.listdir(hub) == []
    engine.close()

    def group_gone() -> bool:
        try:
            os.killpg(group, 0)
        except ProcessLookupError:
            return True
        return False

    wait_for(group_gone, 60)
    assert engine.proc is None and engine.client is None and not os.path.exists(hub)


def test_the_key_variable_is_the_one_the_server_reads():
    assert KEY_ENV == mlx_serve.KEY_ENV
