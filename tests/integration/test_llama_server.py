"""The `llama-server` engine family: a supervised llama.cpp server child per model, many users at once.

Real worker, real `llama-server` child (the one `scripts/setup` builds into `.venv/bin`), the tiny GGUF."""

from __future__ import annotations

import os
import shutil
import signal
import threading
from pathlib import Path

import json

import httpx
import openai
import pytest

from coderai.testing.procs import deadline_scale, wait_until
from coderai.testing.stack import running_stack

pytestmark = pytest.mark.slow

SLOTS = 4
# a long prompt (~900 tokens of the tiny model): its prefill alone keeps a slot busy for a while, where the tiny
# model's decoding (thousands of tokens a second) can end before a heartbeat sees the slot busy
FILLER = " ".join(f"word{j}" for j in range(250))


@pytest.fixture(scope="module")
def stack(tmp_path_factory, tiny_gguf, tool_gguf):
    from coderai.engine_worker.engines.llama_server import find_binary

    if find_binary() is None:
        pytest.skip("no llama-server: scripts/setup builds it into .venv/bin")
    models = [
        {
            "name": "tiny-ls",
            "engine": "llama-server",
            "path": str(tiny_gguf),
            # the tiny model's own context; a queue bound of its own (the default bounds only memory, 256)
            "params": {"parallel": SLOTS, "n_ctx": 2048, "n_threads": 2, "queue": 3 * SLOTS},
        },
        # overfitted to call get_weather when asked about the weather (coderai.testing.tool_gguf)
        {
            "name": "tools-ls",
            "engine": "llama-server",
            "path": str(tool_gguf),
            "params": {"parallel": 2, "n_ctx": 1024, "n_threads": 2},
        },
        # the tiny model again (a copy: the child-counting tests look for the first one) in embedding mode
        {
            "name": "embed-ls",
            "engine": "llama-server",
            "path": str(shutil.copy(tiny_gguf, tmp_path_factory.mktemp("e") / "e.gguf")),
            "ops": ["embed"],
            "params": {"parallel": 1, "n_ctx": 512, "n_threads": 1},
        },
    ]
    # the tiny model makes thousands of tokens a second: heartbeats every 0.2 s see its slots while they are busy
    with running_stack(
        tmp_path_factory.mktemp("llama-server"),
        models,
        gateway_args=("--no-auth",),
        extra_env={"CODERAI_WORKER_HEARTBEAT_S": "0.2"},
    ) as s:
        s.wait_engines_ready([m["name"] for m in models], timeout_s=300)
        yield s


def _children(model_path: str) -> list[int]:
    """Pids of running llama-server processes serving `model_path`."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            argv = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
            state = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z" and argv and argv[0].endswith(b"llama-server") and model_path.encode() in argv:
            out.append(int(entry))
    return out


def _engine_of(stack, model: str) -> dict:
    nodes = httpx.get(f"{stack.http_url}/admin/nodes", timeout=10).json()["nodes"]
    return next(e for n in nodes for e in n["heartbeat"].get("engines", []) if e["model"] == model)


def _engine(stack) -> dict:
    nodes = httpx.get(f"{stack.http_url}/admin/nodes", timeout=10).json()["nodes"]
    return next(e for n in nodes for e in n["heartbeat"].get("engines", []) if e["model"] == "tiny-ls")


def _client(stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.base_url, api_key="none", max_retries=0, timeout=120)


def test_concurrent_streams_share_the_slots(stack):
    client = _client(stack)
    results: list[str | Exception] = []
    busiest = 0
    done = threading.Event()

    def chat(i: int) -> None:
        try:
            chunks = [
                c
                for c in client.chat.completions.create(
                    model="tiny-ls",
                    stream=True,
                    max_tokens=1000,
                    messages=[{"role": "user", "content": f"story {i} {FILLER}"}],
                )
                if c.choices
            ]
            results.append(chunks[-1].choices[0].finish_reason)  # random weights may say little: it must end
        except Exception as exc:  # collected and asserted below
            results.append(exc)

    threads = [threading.Thread(target=chat, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()

    def watch() -> None:
        nonlocal busiest
        while not done.is_set():
            busiest = max(busiest, _engine(stack).get("slots_busy", 0))
            done.wait(0.1)

    watcher = threading.Thread(target=watch)
    watcher.start()
    for t in threads:
        t.join(180)
    done.set()
    watcher.join(10)
    assert len(results) == 8 and not [r for r in results if isinstance(r, Exception)], results
    assert all(r in ("stop", "length") for r in results), results
    e = _engine(stack)
    assert e["engine"] == "llama-server" and e["slots"] == SLOTS
    assert e["backend"] == "cpu" and e.get("gpu_layers", 0) == 0  # the portable CPU build here
    assert busiest > 1, "the engine never reported more than one busy slot"


def test_beyond_the_bounded_queue_a_request_gets_a_clean_429(stack):
    """17 requests at once on 4 slots with a queue of 12: the one beyond gets a 429 `busy` with Retry-After, the
    others their answers. All 17 must be in at once, which a loaded machine may not manage (its client threads
    start more slowly than the tiny model answers): a burst answered whole is tried again, at most 3 times."""
    client = _client(stack)

    def burst(round_: int) -> list[object]:
        answers: list[object] = []
        # long distinct prompts: their prefill keeps every slot and the queue full while all 17 arrive

        def ask(i: int) -> None:
            try:
                answers.append(
                    client.chat.completions.create(  # short answers: 16 accepted jobs are 4 rounds of 4 slots
                        model="tiny-ls",
                        max_tokens=200,
                        messages=[{"role": "user", "content": f"r{round_} q{i} {FILLER}"}],
                    )
                )
            except openai.APIStatusError as exc:
                answers.append(exc)

        threads = [threading.Thread(target=ask, args=(i,)) for i in range(4 * SLOTS + 1)]  # slots + 3 x slots queued
        for t in threads:
            t.start()
        for t in threads:
            t.join(180 * deadline_scale())
        assert len(answers) == 4 * SLOTS + 1, "a request got no answer"
        return answers

    answers = next(
        (a for a in (burst(r) for r in range(3)) if any(isinstance(x, openai.APIStatusError) for x in a)), None
    )
    assert answers is not None, "no request was refused beyond the queue in 3 bursts"
    refused = [a for a in answers if isinstance(a, openai.APIStatusError)]
    for exc in refused:
        assert exc.status_code == 429 and exc.code == "busy", exc.body
        assert int(exc.response.headers["retry-after"]) >= 1
    assert all(a.choices[0].finish_reason in ("stop", "length") for a in answers if a not in refused)


WEATHER = [{"role": "user", "content": "what is the weather in Paris"}]
HELLO = [{"role": "user", "content": "hello there"}]


def _tools():
    from coderai.testing.tool_gguf import TOOL

    return [TOOL]


def _the_weather_call(calls) -> None:
    assert calls is not None and len(calls) == 1, calls
    call = calls[0]
    assert call.type == "function" and call.id and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}


def test_auto_tool_choice_calls_the_tool_by_itself_and_answers_text_otherwise(stack):
    client = _client(stack)
    r = client.chat.completions.create(model="tools-ls", messages=WEATHER, tools=_tools(), temperature=0)
    assert r.choices[0].finish_reason == "tool_calls"
    _the_weather_call(r.choices[0].message.tool_calls)
    r = client.chat.completions.create(
        model="tools-ls", messages=HELLO, tools=_tools(), tool_choice="auto", temperature=0
    )
    assert r.choices[0].finish_reason == "stop" and not r.choices[0].message.tool_calls
    assert r.choices[0].message.content == "Hello! How can I help?"


def test_a_streamed_tool_call_accumulates_to_exactly_one_call(stack):
    client = _client(stack)
    with client.chat.completions.stream(model="tools-ls", messages=WEATHER, tools=_tools(), temperature=0) as s:
        final = s.get_final_completion()
    assert final.choices[0].finish_reason == "tool_calls"
    _the_weather_call(final.choices[0].message.tool_calls)
    # the raw deltas: the id and the name come once, then only argument pieces
    chunks = list(
        client.chat.completions.create(model="tools-ls", messages=WEATHER, tools=_tools(), temperature=0, stream=True)
    )
    deltas = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert len([d for d in deltas if d.id]) == 1 and len([d for d in deltas if d.function and d.function.name]) == 1
    assert json.loads("".join(d.function.arguments or "" for d in deltas if d.function)) == {"city": "Paris"}


def test_langchain_streams_one_tool_call(stack):
    langchain_openai = pytest.importorskip("langchain_openai")
    llm = langchain_openai.ChatOpenAI(
        model="tools-ls", base_url=stack.base_url, api_key="none", temperature=0, max_retries=0
    ).bind_tools(_tools())
    total = None
    for chunk in llm.stream("what is the weather in Paris"):
        total = chunk if total is None else total + chunk
    assert total is not None and len(total.tool_calls) == 1, total
    call = total.tool_calls[0]
    assert call["name"] == "get_weather" and call["args"] == {"city": "Paris"} and call["id"]


def test_ollama_streams_a_tool_call_whole_before_its_last_line(stack):
    """Open WebUI sends `tools` on every Ollama chat: the answer still streams, and a call comes whole, as Ollama's."""
    import ollama

    client = ollama.Client(host=stack.http_url)
    parts = list(
        client.chat(model="tools-ls", messages=WEATHER, tools=_tools(), stream=True, options={"temperature": 0})
    )
    calls = [c for p in parts for c in (p.message.tool_calls or [])]
    assert len(parts) >= 2 and parts[-1].done and not any(p.done for p in parts[:-1])
    assert [(c.function.name, dict(c.function.arguments)) for c in calls] == [("get_weather", {"city": "Paris"})]
    text = list(client.chat(model="tools-ls", messages=HELLO, tools=_tools(), stream=True, options={"temperature": 0}))
    assert len(text) > 2 and "".join(p.message.content for p in text).startswith("Hello!")  # text, as it comes


def test_ollama_timings_are_the_engines_own(stack):
    """llama-server's timings, not the gateway's clock: a whole answer's eval time is not ~0 (shown as 254,913
    tok/s by Open WebUI), and prompt and eval durations add up to no more than the total."""
    r = httpx.post(
        f"{stack.http_url}/api/generate",
        timeout=60,
        headers={"Content-Type": "application/x-www-form-urlencoded"},
        content=json.dumps(
            {
                "model": "tiny-ls",
                "prompt": "once upon a time",
                "stream": False,
                "options": {"num_predict": 16, "temperature": 0},
            }
        ),
    )  # curl -d's content type
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["eval_count"] == 16 and body["eval_duration"] > 0 and body["prompt_eval_duration"] > 0
    assert body["prompt_eval_duration"] + body["eval_duration"] <= body["total_duration"]
    assert body["eval_count"] / (body["eval_duration"] / 1e9) < 100_000  # a rate a CPU makes, not a clock's artefact


def test_required_and_named_tool_choice_yield_a_tool_call(stack):
    client = _client(stack)
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        r = client.chat.completions.create(
            model="tools-ls", messages=WEATHER, tools=_tools(), tool_choice=choice, temperature=0
        )
        _the_weather_call(r.choices[0].message.tool_calls)


def test_logprobs_are_filled_when_asked(stack):
    client = _client(stack)
    r = client.chat.completions.create(model="tools-ls", messages=HELLO, temperature=0, logprobs=True, top_logprobs=2)
    content = r.choices[0].logprobs.content
    assert content and all(len(t.top_logprobs) == 2 and t.logprob <= 0 for t in content)
    assert "".join(t.token for t in content).startswith("Hello")
    assert (
        "refusal" in r.choices[0].logprobs.model_fields_set
    )  # OpenAI's schema requires it (null); llama-server omits it
    chunks = list(
        client.chat.completions.create(model="tools-ls", messages=HELLO, temperature=0, logprobs=True, stream=True)
    )
    assert all(
        "refusal" in c.choices[0].logprobs.model_fields_set for c in chunks if c.choices and c.choices[0].logprobs
    )
    streamed = [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content or []]
    # llama-server lists the end-of-generation token ('') whole, not streamed
    assert [t.token for t in streamed] == [t.token for t in content if t.token]
    plain = client.chat.completions.create(model="tools-ls", messages=HELLO, temperature=0)
    assert plain.choices[0].logprobs is None


def test_n_choices_streamed_and_whole_each_counted(stack):
    client = _client(stack)
    kw = dict(model="tiny-ls", messages=HELLO, max_tokens=4, temperature=0, n=2)
    whole = client.chat.completions.create(**kw)
    assert [c.index for c in whole.choices] == [0, 1] and all(c.finish_reason == "length" for c in whole.choices)
    assert whole.usage.completion_tokens == 8  # both choices' tokens (llama-server's own whole answer counts one)
    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    text = {0: "", 1: ""}
    finishes = {}
    for c in chunks:
        for ch in c.choices:
            text[ch.index] += ch.delta.content or ""
            if ch.finish_reason:
                finishes[ch.index] = ch.finish_reason
    assert finishes == {0: "length", 1: "length"}
    assert text == {c.index: c.message.content for c in whole.choices}  # greedy: the same tokens both ways
    assert chunks[-1].usage.completion_tokens == 8 and chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens


def test_a_list_of_prompts_is_answered_choice_by_choice(stack):
    client = _client(stack)
    prompts = ["once upon", "the weather in"]
    alone = [client.completions.create(model="tiny-ls", prompt=p, max_tokens=3, temperature=0) for p in prompts]
    both = client.completions.create(model="tiny-ls", prompt=prompts, max_tokens=3, temperature=0)
    assert [c.index for c in both.choices] == [0, 1]
    assert [c.text for c in both.choices] == [a.choices[0].text for a in alone]
    assert both.usage.completion_tokens == sum(a.usage.completion_tokens for a in alone)
    assert both.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone)
    streamed = {0: "", 1: ""}
    for c in client.completions.create(model="tiny-ls", prompt=prompts, max_tokens=3, temperature=0, stream=True):
        for ch in c.choices:
            streamed[ch.index] += ch.text
    assert [streamed[0], streamed[1]] == [c.text for c in both.choices]


def test_an_empty_prompt_with_n_choices_is_a_400_and_the_engine_goes_on(stack):
    """llama-server never ends a completion whose prompts hold "" with n > 1 (the empty prompt's slot is let go
    without a result): the worker refuses it at once, and the engine still answers the next request (before,
    the request hung and took every slot with it)."""
    client = _client(stack).with_options(max_retries=0, timeout=60)
    for prompt in (["", "once upon"], ""):
        with pytest.raises(openai.BadRequestError) as refused:
            client.completions.create(model="tiny-ls", prompt=prompt, n=2, max_tokens=3)
        assert refused.value.body["param"] == "prompt" and "n = 1" in refused.value.body["message"]
    alone = client.completions.create(model="tiny-ls", prompt=["", "once upon"], max_tokens=3, temperature=0)
    assert [c.index for c in alone.choices] == [0, 1]
    two = client.completions.create(model="tiny-ls", prompt="once upon", n=2, max_tokens=3)
    assert len(two.choices) == 2


def test_a_conversation_said_again_reads_its_prompt_from_the_cache(stack):
    client = _client(stack)
    talk = [{"role": "user", "content": "a long first turn that the engine keeps in its slot " * 4}]
    first = client.chat.completions.create(model="tiny-ls", messages=talk, max_tokens=2, temperature=0, user="cache-me")
    again = client.chat.completions.create(model="tiny-ls", messages=talk, max_tokens=2, temperature=0, user="cache-me")
    assert first.usage.prompt_tokens == again.usage.prompt_tokens > 0
    cached = again.usage.prompt_tokens_details.cached_tokens  # the same engine (user affinity), the same slot
    assert 0 < cached < again.usage.prompt_tokens  # llama-server evaluates at least the last prompt token again
    r = client.responses.create(
        model="tiny-ls", input=talk, max_output_tokens=2, temperature=0, user="cache-me", store=False
    )
    assert r.usage.input_tokens_details.cached_tokens > 0


def test_logit_bias_steers_the_tokens(stack):
    client = _client(stack)
    plain = client.chat.completions.create(model="tiny-ls", messages=HELLO, max_tokens=3, temperature=0, logprobs=True)
    first = plain.choices[0].logprobs.content[0].token
    r = client.chat.completions.create(
        model="tiny-ls", messages=HELLO, max_tokens=3, temperature=0, logprobs=True, logit_bias={"100": 100}
    )
    tokens = [t.token for t in r.choices[0].logprobs.content]
    assert len(tokens) == 3 and len(set(tokens)) == 1 and tokens[0] != first  # token 100, every time
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="tiny-ls", messages=HELLO, max_tokens=3, logit_bias={"x": 1})


def test_a_json_schema_response_format_constrains_the_answer(stack):
    client = _client(stack)
    schema = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}},
        "required": ["ok"],
        "additionalProperties": False,
    }
    r = client.chat.completions.create(
        model="tiny-ls",
        messages=HELLO,
        max_tokens=64,
        response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}},
    )
    assert set(json.loads(r.choices[0].message.content)) == {"ok"}  # a random model, held to the schema


def test_embeddings_from_a_model_in_embedding_mode(stack):
    client = _client(stack)
    wait_until(lambda: _engine_of(stack, "embed-ls")["state"] == "ready", 60, "the embedding engine")
    r = client.embeddings.create(model="embed-ls", input=["hello world", "a second text"])
    assert [d.index for d in r.data] == [0, 1] and len(r.data[0].embedding) == 64  # the tiny model's width
    for d in r.data:
        assert abs(sum(x * x for x in d.embedding) - 1.0) < 1e-3
    assert r.data[0].embedding != r.data[1].embedding and r.usage.prompt_tokens > 0
    short = client.embeddings.create(model="embed-ls", input="hello world", dimensions=16)
    assert len(short.data[0].embedding) == 16


def test_an_image_part_is_a_400_on_a_model_without_a_projector(stack):
    client = _client(stack)
    png = "data:image/png;base64,iVBORw0KGgo="
    for url, param in (
        (png, "messages[0].content[1]"),
        ("http://127.0.0.1:9/cat.png", "messages[0].content[1].image_url"),
    ):
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(
                model="tiny-ls",
                messages=[
                    {
                        "role": "user",
                        "content": [
                            {"type": "text", "text": "what is it"},
                            {"type": "image_url", "image_url": {"url": url}},
                        ],
                    }
                ],
            )
        assert err.value.body["param"] == param, err.value.body


def test_a_local_user_cannot_chat_with_the_child_directly(stack, tiny_gguf):
    """Attack: a local user reads the child's loopback port from `ps` and asks it for an answer, unbilled. The
    child wants a key only its worker knows, and the key is in neither its argv nor its log."""
    pid = _children(str(tiny_gguf))[0]
    argv = [a.decode() for a in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")]
    port = argv[argv.index("--port") + 1]
    assert not any("api-key" in a for a in argv), argv
    body = {"model": "tiny-ls", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    for path in ("/v1/chat/completions", "/completion", "/metrics", "/slots"):
        r = (
            httpx.post(f"http://127.0.0.1:{port}{path}", json=body, timeout=30)
            if path != "/metrics" and path != "/slots"
            else httpx.get(f"http://127.0.0.1:{port}{path}", timeout=30)
        )
        print(f"tried {path} on the child's port {port} without its key: {r.status_code}")
        assert r.status_code == 401, (path, r.status_code, r.text[:200])
    # through coderai it still answers, and the worker still reads the child's slots (its /metrics wants the key)
    out = _client(stack).chat.completions.create(
        model="tiny-ls", messages=[{"role": "user", "content": "hi"}], max_tokens=4
    )
    assert out.choices[0].message.content is not None
    assert _engine(stack)["state"] == "ready"


def test_a_killed_child_ends_the_stream_with_an_error_and_is_restarted(stack, tiny_gguf):
    def killed_mid_stream() -> list[str] | None:
        """Kill the child after the first streamed token; the rest of the stream, or None when the answer was
        already complete by then (random weights may stop early): then the child is back, and it is tried again."""
        [pid] = wait_until(lambda: _children(str(tiny_gguf)) or None, 60, "one llama-server child")
        wait_until(lambda: _engine(stack)["state"] == "ready", 60, "the engine to be ready")
        with httpx.stream(
            "POST",
            f"{stack.base_url}/chat/completions",
            timeout=60,
            json={
                "model": "tiny-ls",
                "stream": True,
                "max_tokens": 1800,
                "messages": [{"role": "user", "content": "long"}],
            },
        ) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            assert '"choices"' in next(line for line in lines if line.startswith("data:"))
            os.kill(pid, signal.SIGKILL)
            rest = list(lines)
        wait_until(lambda: [p for p in _children(str(tiny_gguf)) if p != pid], 60, "a new llama-server child")
        return rest if not any('"finish_reason":"' in line for line in rest) else None

    rest = next(filter(None, (killed_mid_stream() for _ in range(5))), None)
    # the worker and its other engine stayed up meanwhile
    r = _client(stack).chat.completions.create(model="tools-ls", messages=HELLO, temperature=0)
    assert r.choices[0].message.content == "Hello! How can I help?"
    assert rest is not None, "five streams finished before their child was killed"
    assert any('"error"' in line for line in rest), rest[-5:]
    # the supervisor started a new child; the engine was failed meanwhile, and serves again
    wait_until(lambda: _engine(stack)["state"] == "ready", 60, "the engine to be ready again")
    r = wait_until(
        lambda: _client(stack).chat.completions.create(
            model="tiny-ls", max_tokens=8, messages=[{"role": "user", "content": "again"}]
        ),
        60,
        "an answer after the restart",
    )
    assert r.usage.completion_tokens >= 0 and r.choices[0].finish_reason in ("stop", "length")


def test_no_child_outlives_a_sigkilled_worker(stack, tiny_gguf):
    children = _children(str(tiny_gguf))
    assert children
    worker = stack.procs["worker-w1"]
    worker.proc.send_signal(signal.SIGKILL)
    worker.proc.wait(30)
    wait_until(lambda: not _children(str(tiny_gguf)), 30, "the llama-server child to die with its worker")
