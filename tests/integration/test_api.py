"""The OpenAI API end to end with the official SDK: real gateway, router, scheduler, worker, llama.cpp."""

from __future__ import annotations

import json
import os

import httpx
import openai
import pytest

from coderai.testing.procs import wait_until
from tests.integration.conftest import BATCHES_PER_KEY, FILE_COUNT

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def client(api_stack, admin_key) -> openai.OpenAI:
    return openai.OpenAI(base_url=api_stack.base_url, api_key=admin_key, max_retries=0, timeout=30)


@pytest.fixture(scope="module")
def http(api_stack, admin_key):
    with httpx.Client(base_url=api_stack.http_url, headers={"Authorization": f"Bearer {admin_key}"}, timeout=30) as c:
        yield c


def test_models_list_and_retrieve(client):
    ids = {m.id for m in client.models.list()}
    assert {"tiny", "ghost"} <= ids
    assert client.models.retrieve("tiny").owned_by == "coderai"


def test_models_list_says_which_models_are_loaded(client):
    """coderai's `coderai` field rides in the SDK's model_extra; `ghost` is placed nowhere, so never loaded."""

    def residency() -> dict:
        return {m.id: m.model_extra["coderai"] for m in client.models.list()}

    wait_until(lambda: residency()["tiny"]["loaded"], 15, "the gateway to see tiny's heartbeat")
    seen = residency()
    assert seen["tiny"]["copies"] == 1 and seen["tiny"]["nodes"] == ["w1"] and seen["tiny"]["resident"] == "auto"
    assert seen["ghost"] == {"loaded": False, "copies": 0, "loading": False, "resident": "auto", "nodes": []}
    assert client.models.retrieve("tiny").model_extra["coderai"]["loaded"] is True


def test_chat_completion(client):
    r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hello"}], max_tokens=8)
    assert r.id.startswith("chatcmpl-") and r.object == "chat.completion" and r.model == "tiny"
    assert r.choices[0].message.role == "assistant" and isinstance(r.choices[0].message.content, str)
    assert r.choices[0].finish_reason in ("stop", "length")
    u = r.usage
    assert (
        u.prompt_tokens > 0 and 0 < u.completion_tokens <= 8 and u.total_tokens == u.prompt_tokens + u.completion_tokens
    )


def test_chat_stream_with_usage(client):
    chunks = list(
        client.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "Hello"}],
            max_tokens=8,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert len({c.id for c in chunks}) == 1
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes in (["stop"], ["length"])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens > 0


def test_greedy_stream_and_whole_answer_agree(client):
    kw = dict(model="tiny", messages=[{"role": "user", "content": "same"}], max_tokens=10, temperature=0)
    whole = client.chat.completions.create(**kw).choices[0].message.content
    streamed = "".join(
        c.choices[0].delta.content or "" for c in client.chat.completions.create(stream=True, **kw) if c.choices
    )
    assert streamed == whole


def test_sse_framing_is_exactly_openais(http):
    body = {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "max_tokens": 4, "stream": True}
    with http.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        raw = r.read()
    assert b"\r" not in raw
    events = raw.split(b"\n\n")
    assert events[-1] == b"" and events[-2] == b"data: [DONE]"
    for e in events[:-2]:
        assert e.startswith(b"data: {")
        assert json.loads(e[6:])["object"] == "chat.completion.chunk"


def test_what_the_in_process_engine_cannot_do_is_a_clear_400(client):
    # llama-cpp-python streams one choice and takes one prompt (the llama-server engine does both)
    with pytest.raises(openai.BadRequestError) as exc:
        list(
            client.chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": "x"}], n=2, max_tokens=2, stream=True
            )
        )
    assert exc.value.body["param"] == "n" and "streams one choice" in exc.value.body["message"]
    with pytest.raises(openai.BadRequestError) as exc:
        client.completions.create(model="tiny", prompt=["a", "b"], max_tokens=2)
    assert exc.value.body["param"] == "prompt"
    whole = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}], n=2, max_tokens=2)
    assert [c.index for c in whole.choices] == [0, 1]


def test_completions_whole_and_streamed(client):
    r = client.completions.create(model="tiny", prompt="def hello():", max_tokens=5)
    assert r.object == "text_completion" and isinstance(r.choices[0].text, str) and r.usage.completion_tokens <= 5
    parts = list(client.completions.create(model="tiny", prompt="def hello():", max_tokens=5, stream=True))
    assert parts and parts[-1].choices[0].finish_reason in ("stop", "length")


def test_response_format_reaches_the_engine(client):
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    r = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "a number"}],
        max_tokens=40,
        response_format={"type": "json_schema", "json_schema": {"name": "num", "schema": schema}},
    )
    assert isinstance(json.loads(r.choices[0].message.content)["n"], int)


def test_tools_reach_the_engine(client):
    tools = [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "parameters": {
                    "type": "object",
                    "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
                    "required": ["city"],
                },
            },
        }
    ]
    r = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "weather?"}],
        max_tokens=40,
        tools=tools,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    )
    call = r.choices[0].message.tool_calls[0]
    assert r.choices[0].finish_reason == "tool_calls" and call.function.name == "get_weather"
    assert "city" in json.loads(call.function.arguments)


def test_a_streamed_tool_call_accumulates_to_one_call_in_the_sdk_stream_helper(client):
    tools = [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "parameters": {
                    "type": "object",
                    "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
                    "required": ["city"],
                },
            },
        }
    ]
    with client.chat.completions.stream(
        model="tiny",
        messages=[{"role": "user", "content": "weather?"}],
        max_tokens=40,
        tools=tools,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    ) as stream:
        final = stream.get_final_completion()
    [call] = final.choices[0].message.tool_calls  # the helper concatenates what it gets: once, not per chunk
    assert call.function.name == "get_weather" and call.id and call.type == "function"
    assert json.loads(call.function.arguments)["city"] in ("Paris", "Rome")


# --- errors: the OpenAI shape and the right status, never a 5xx for a client mistake ---------------------


def _error(r: httpx.Response) -> dict:
    doc = r.json()
    assert set(doc) == {"error"} and set(doc["error"]) == {"message", "type", "param", "code"}
    return doc["error"]


def test_malformed_json_is_400(http):
    r = http.post(
        "/v1/chat/completions", content=b'{"model": "tiny", "messages": [', headers={"Content-Type": "application/json"}
    )
    assert r.status_code == 400 and _error(r)["code"] == "invalid_json"


def test_schema_error_is_400_naming_the_field(client):
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}], temperature=7)
    assert exc.value.status_code == 400 and exc.value.body["param"] == "temperature"


def test_unknown_model_is_404(client):
    with pytest.raises(openai.NotFoundError) as exc:
        client.chat.completions.create(model="no-such-model", messages=[{"role": "user", "content": "x"}])
    assert exc.value.body["code"] == "model_not_found"


def test_model_without_engine_is_503_with_retry_after(http):
    r = http.post("/v1/chat/completions", json={"model": "ghost", "messages": [{"role": "user", "content": "x"}]})
    assert r.status_code == 503 and int(r.headers["Retry-After"]) > 0
    assert _error(r)["code"] == "no_engine"


def test_body_too_large_is_413(http):
    big = {"model": "tiny", "messages": [{"role": "user", "content": "x" * 100_000}]}
    r = http.post("/v1/chat/completions", json=big)
    assert r.status_code == 413 and _error(r)["code"] == "request_too_large"


def test_prompt_longer_than_context_is_400(client):
    with pytest.raises(openai.BadRequestError) as exc:
        client.completions.create(model="tiny", prompt="word " * 3000, max_tokens=5)
    assert "context" in exc.value.message


def test_missing_and_wrong_keys_are_401(api_stack, user_key):
    for headers in ({}, {"Authorization": "Bearer sk-wrong"}, {"Authorization": "Basic abc"}):
        r = httpx.post(
            f"{api_stack.base_url}/chat/completions", headers=headers, json={"model": "tiny", "messages": []}
        )
        assert r.status_code == 401 and _error(r)["code"] == "invalid_api_key"
    user = openai.OpenAI(base_url=api_stack.base_url, api_key=user_key, max_retries=0)
    assert user.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens=1).choices


def test_health_needs_no_key(api_stack):
    r = httpx.get(f"{api_stack.http_url}/healthz")
    assert r.status_code == 200 and r.json()["bus"] is True


def test_unknown_route_and_wrong_method(http):
    assert http.get("/v1/nope").status_code == 404
    r = http.get("/v1/chat/completions")
    assert r.status_code == 405 and _error(r)["type"] == "invalid_request_error"


HOSTILE = [
    b"null",
    b"[]",
    b'"string"',
    b"1e999999",
    b"{}",
    b'{"model": 5, "messages": []}',
    b'{"model": "tiny", "messages": "hi"}',
    b'{"model": "tiny", "messages": []}',
    b'{"model": "tiny", "messages": [{"role": "wizard", "content": "x"}]}',
    b'{"model": "tiny", "messages": [{"role": "user", "content": 5}]}',
    b'{"model": "tiny", "messages": [{"role": "user"}]}',
    b'{"model": "tiny", "messages": [{"role": "user", "content": "x"}], "max_tokens": -1}',
    b'{"model": "tiny", "messages": [{"role": "user", "content": "x"}], "n": 0}',
    b'{"model": "tiny", "messages": [{"role": "user", "content": "x"}], "stream": true, "n": 2}',
    b'{"model": "tiny", "messages": [{"role": "user", "content": "x"}], "stop": ["a","b","c","d","e"]}',
    b'{"model": "tiny", "messages": [{"role": "user", "content": "x"}], "response_format": {"type": "yaml"}}',
    b'{"model": "tiny", "messages": [{"role": "user", "content": "x"}], "max_tokens": 99999999999999999999999}',
    b"\xff\xfe\x00garbage",
    b'{"model": "tiny", "messages": [' + b"[" * 5000 + b"]" * 5000 + b"]}",
]


@pytest.mark.parametrize("body", HOSTILE, ids=range(len(HOSTILE)))
def test_hostile_chat_bodies_are_4xx(http, body):
    r = http.post("/v1/chat/completions", content=body, headers={"Content-Type": "application/json"})
    assert 400 <= r.status_code < 500, r.text
    assert _error(r)["message"] and "Traceback" not in r.text


def test_hostile_completion_bodies_are_4xx(http):
    for body in (
        b"{}",
        b'{"model": "tiny"}',
        b'{"model": "tiny", "prompt": ["a", "b"]}',
        b'{"model": "tiny", "prompt": 3}',
    ):
        r = http.post("/v1/completions", content=body, headers={"Content-Type": "application/json"})
        assert r.status_code == 400, r.text


# --- the rest of the loop: cancellation, metrics, usage ------------------------------------------------


def test_client_disconnect_stops_generation(api_stack, http):
    worker = api_stack.procs["worker-w1"]
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "go on"}],
        "max_tokens": 1000,
        "stream": True,
        "temperature": 0,
    }
    with http.stream("POST", "/v1/chat/completions", json=body) as r:
        rid = r.headers["Coderai-Request-Id"]
        next(r.iter_bytes())  # the stream has started; now walk away
    wait_until(
        lambda: f'"request_id": "{rid}"' in worker.log_text() and '"msg": "cancel"' in worker.log_text(),
        10,
        "the worker to log the cancel",
    )


def test_client_leaving_a_whole_answer_stops_generation(api_stack, admin_key):
    """Not streamed: nothing reaches the client before the end, and still the engine stops when it leaves."""
    import asyncio
    import socket
    from urllib.parse import urlparse

    import nats

    worker = api_stack.procs["worker-w1"]
    cancels = worker.log_text().count('"msg": "cancel"')
    body = json.dumps({"model": "tiny", "prompt": "go on", "max_tokens": 1000, "temperature": 0}).encode()
    url = urlparse(api_stack.http_url)

    async def leave_once_the_job_is_sent() -> None:
        # the client walks away as soon as its job is on the bus: a client gone before the gateway even read its
        # body (a loaded machine) makes no job at all, which is right, and tests nothing
        nc = await nats.connect(api_stack.nats_url)
        sent = asyncio.Event()

        async def job(_m) -> None:
            sent.set()

        sub = await nc.subscribe("coderai.engine.*.*.complete", cb=job)
        # the server has the subscription before the request is sent: the blocking socket calls below hold this
        # loop, so a SUB left in nats-py's buffer reached the server after the gateway had published the job
        await nc.flush()
        try:
            with socket.create_connection((url.hostname, url.port)) as s:
                s.sendall(
                    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                    b"Authorization: Bearer "
                    + admin_key.encode()
                    + b"\r\nContent-Length: "
                    + str(len(body)).encode()
                    + b"\r\n\r\n"
                    + body
                )
                try:
                    await asyncio.wait_for(sent.wait(), 60)
                except TimeoutError:  # no job came (a stressed run saw it once): what the gateway answered instead
                    s.settimeout(5)
                    try:
                        answered = s.recv(2000)
                    except OSError:
                        answered = b"(nothing within 5 s)"
                    raise AssertionError(f"no job on the bus in 60 s; the gateway answered: {answered!r}") from None
        finally:
            await sub.unsubscribe()
            await nc.close()

    asyncio.run(leave_once_the_job_is_sent())
    # the gateway looks for the disconnect 0.2 s into the answer (1000 tokens take the engine longer), and a cancel
    # that beats its job to the worker is kept for it
    wait_until(lambda: worker.log_text().count('"msg": "cancel"') > cancels, 10, "the worker to log the cancel")


def test_requests_show_in_prometheus_metrics(api_stack, client):
    client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "count me"}], max_tokens=2)
    url = f"http://127.0.0.1:{api_stack.metrics_port}/metrics"

    def counted():
        text = httpx.get(url).text
        return (
            "coderai_requests_total{" in text
            and 'key="admin"' in text
            and 'model="tiny"' in text
            and 'status="ok"' in text
            and "coderai_request_seconds_bucket" in text
        )

    wait_until(counted, 15, "request metrics")
    assert "coderai_engine_in_flight" in httpx.get(url).text


def test_usage_per_key_lands_in_redis(api_stack, user_key):
    import redis

    alice = openai.OpenAI(base_url=api_stack.base_url, api_key=user_key, max_retries=0)
    alice.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "bill me"}], max_tokens=3)
    r = redis.Redis.from_url(api_stack.redis_url)

    def recorded():
        import time

        day = time.strftime("%Y-%m-%d", time.gmtime())
        h = f"coderai:usage:{day}:alice:tiny"
        return (
            r.sismember(f"coderai:usage:index:{day}", "alice\ttiny")
            and int(r.hget(h, "requests") or 0) >= 1
            and int(r.hget(h, "prompt_tokens") or 0) > 0
        )

    wait_until(recorded, 15, "alice's usage in Redis")


def test_files_upload_list_content_and_delete_through_the_sdk(client):
    data = b'{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}\n'
    up = client.files.create(file=("train.jsonl", data), purpose="fine-tune")
    assert up.id.startswith("file-") and up.bytes == len(data) and up.purpose == "fine-tune"
    other = client.files.create(file=("notes.txt", b"not training data"), purpose="user_data")
    listed = [f.id for f in client.files.list()]
    assert up.id in listed and other.id in listed
    assert [f.id for f in client.files.list(purpose="fine-tune")] == [
        f.id for f in client.files.list() if f.purpose == "fine-tune"
    ]
    assert client.files.content(up.id).read() == data
    named = client.files.create(file=("données.txt", b"x"), purpose="user_data")  # a name that is not ASCII
    got = client.files.with_raw_response.content(named.id)
    assert got.content == b"x" and got.headers["content-disposition"] == (
        "attachment; filename=\"donn_es.txt\"; filename*=UTF-8''donn%C3%A9es.txt"
    )
    client.files.delete(named.id)
    # several chunks of the object store, streamed one at a time (never whole in the gateway): the same bytes back,
    # with their length said up front
    big = os.urandom(2 * 128 * 1024 + 17)  # three chunks, within the test quota (FILE_QUOTA)
    large = client.files.create(file=("large.bin", big), purpose="user_data")
    got = client.files.with_raw_response.content(large.id)
    assert got.content == big and got.headers["content-length"] == str(len(big))
    client.files.delete(large.id)
    gone = client.files.delete(other.id)
    assert gone.deleted and gone.id == other.id
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(other.id)
    with pytest.raises(openai.NotFoundError):
        client.files.delete(other.id)
    assert other.id not in [f.id for f in client.files.list()]


def test_a_key_sees_only_its_own_files_and_trains_only_on_them(api_stack, user_key, other_user_key, client):
    def sdk(key: str) -> openai.OpenAI:
        return openai.OpenAI(base_url=api_stack.base_url, api_key=key, max_retries=0, timeout=30)

    alice, bob = sdk(user_key), sdk(other_user_key)
    data = b'{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}\n'
    mine = alice.files.create(file=("alice.jsonl", data), purpose="fine-tune")
    theirs = bob.files.create(file=("bob.jsonl", data), purpose="fine-tune")
    assert mine.id in [f.id for f in alice.files.list()] and theirs.id not in [f.id for f in alice.files.list()]
    assert mine.id not in [f.id for f in bob.files.list()]
    for attempt in (
        lambda: bob.files.retrieve(mine.id),
        lambda: bob.files.content(mine.id),
        lambda: bob.files.delete(mine.id),
    ):
        with pytest.raises(openai.NotFoundError):  # as for an id that never was: no sign that it exists
            attempt()
    with pytest.raises(openai.BadRequestError) as err:  # as OpenAI answers a training_file that is not yours
        bob.fine_tuning.jobs.create(model="coderai-tiny", training_file=mine.id)
    assert err.value.body["param"] == "training_file"
    assert alice.files.content(mine.id).read() == data  # bob's tries changed nothing
    admin_sees = [f.id for f in client.files.list()]  # an admin key sees every tenant's
    assert mine.id in admin_sees and theirs.id in admin_sees
    for c, f in ((alice, mine), (bob, theirs)):
        assert c.files.delete(f.id).deleted


def test_request_ids_in_headers_are_random(client):
    ids = []
    for _ in range(4):
        raw = client.chat.completions.with_raw_response.create(
            model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens=1
        )
        ids.append(raw.headers["coderai-request-id"])
    assert all(len(i) == 24 and int(i, 16) >= 0 for i in ids) and len(set(ids)) == 4
    steps = {int(b, 16) - int(a, 16) for a, b in zip(ids, ids[1:])}
    assert not steps & {1, 2, 3, 4}, "one id must say nothing about the next"
    assert len({i[:12] for i in ids}) == 4, "not one prefix per process and a counter"


def test_a_keys_files_have_a_quota(api_stack, other_user_key):
    bob = openai.OpenAI(base_url=api_stack.base_url, api_key=other_user_key, max_retries=0, timeout=30)
    big = bob.files.create(file=("a.bin", b"x" * 200_000), purpose="user_data")
    with pytest.raises(openai.RateLimitError) as err:  # 429 insufficient_quota: 400 KB would pass the 300 KB quota
        bob.files.create(file=("b.bin", b"y" * 200_000), purpose="user_data")
    assert err.value.body["code"] == "file_quota_exceeded" and err.value.body["param"] == "file"
    assert bob.files.delete(big.id).deleted
    again = bob.files.create(file=("b.bin", b"y" * 200_000), purpose="user_data")  # room again once deleted
    assert bob.files.delete(again.id).deleted


def test_a_key_cannot_keep_files_or_run_batches_without_end(api_stack, other_user_key):
    """Attack: one key uploads small files (each a record and an object) or starts batches until the store or the
    gateways are full. Past its count of files and of running batches it gets a 429; deleting or cancelling makes
    room (a cancel stops the lines in flight: these wait for a model that never comes, and held it 90 s)."""
    bob = openai.OpenAI(base_url=api_stack.base_url, api_key=other_user_key, max_retries=0, timeout=30)
    kept = [
        bob.files.create(file=(f"f{i}.txt", b"x"), purpose="user_data")
        for i in range(FILE_COUNT - len(bob.files.list().data))
    ]
    with pytest.raises(openai.RateLimitError) as err:
        bob.files.create(file=("one-more.txt", b"x"), purpose="user_data")
    assert err.value.body["code"] == "file_quota_exceeded"
    for f in kept[1:]:
        assert bob.files.delete(f.id).deleted
    line = (
        json.dumps(
            {
                "custom_id": "a",
                "method": "POST",
                "url": "/v1/chat/completions",  # ghost: no engine, so
                "body": {"model": "ghost", "messages": [{"role": "user", "content": "hi"}]},
            }
        ).encode()
        + b"\n"
    )
    source = bob.files.create(file=("b.jsonl", line), purpose="batch")  # ... its batches keep running
    running = [
        bob.batches.create(input_file_id=source.id, endpoint="/v1/chat/completions", completion_window="24h")
        for _ in range(BATCHES_PER_KEY)
    ]
    with pytest.raises(openai.RateLimitError) as err:
        bob.batches.create(input_file_id=source.id, endpoint="/v1/chat/completions", completion_window="24h")
    assert err.value.body["code"] == "batch_quota_exceeded"
    print(f"a key past {FILE_COUNT} files and {BATCHES_PER_KEY} running batches: 429 each")
    for b in running:
        bob.batches.cancel(b.id)
    wait_until(
        lambda: all(bob.batches.retrieve(b.id).status == "cancelled" for b in running),
        60,
        "the batches to be cancelled",
    )
    for f in (kept[0], source):
        assert bob.files.delete(f.id).deleted


def test_a_key_sees_only_its_own_video_jobs(api_stack, user_key, other_user_key, admin_key):
    """A video job's record as the gateway keeps it (written straight into its bucket: no video model here),
    asked for by its owner, another key and an admin key."""
    import asyncio
    import time

    import msgspec

    from coderai.contracts.topology import VIDEOS
    from coderai.runtime.bus import Bus
    from coderai.gateway.video.records import VideoRecord

    vid = "video_" + "ab" * 12
    rec = VideoRecord(
        id=vid,
        model="t2v",
        prompt="alice's secret prompt",
        status="queued",
        created_at=int(time.time()),
        updated_at=time.time(),
        size="64x64",
        seconds="1",
        key_name="alice",
    )

    async def put() -> None:
        bus = await Bus.connect(api_stack.nats_url, "test-videos")
        try:
            await (await bus.kv(VIDEOS)).put(vid, msgspec.json.encode(rec))  # the bucket as the gateway makes it
        finally:
            await bus.close()

    asyncio.run(put())

    def get(key: str) -> httpx.Response:
        return httpx.get(f"{api_stack.base_url}/videos/{vid}", headers={"Authorization": f"Bearer {key}"}, timeout=10)

    assert get(user_key).status_code == 200 and get(user_key).json()["id"] == vid
    theirs = get(other_user_key)
    assert theirs.status_code == 404 and "secret" not in theirs.text  # as for an id that never was
    assert get(admin_key).status_code == 200
