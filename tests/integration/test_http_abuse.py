"""Abuse at the HTTP edge (issue #25): malformed and wrong-typed JSON made by hypothesis, wrong content types, huge
headers, slowloris clients and 10,000 idle connections against a real stack. Every answer is a clean 4xx (OpenAI
error JSON, Ollama's on /api), never a 5xx or a traceback, and the gateway keeps answering everyone else.
Each test prints how many inputs or connections it tried (shown without -s too)."""

from __future__ import annotations

import collections
import json
import resource
import select
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from coderai.runtime.embedded import free_port
from coderai.testing.fuzz import FIELDS, JSON_VALUES, dumps
from coderai.testing.procs import ServiceProcess, deadline_scale, wait_until
from coderai.testing.sockets import close_all, connect_many, open_fds, raw_request, status_of
from coderai.testing.stack import Stack, running_stack

pytestmark = pytest.mark.slow

EXAMPLES = 1200
"""Hypothesis bodies in all (about 10 ms each on the stack, 2 cores)."""
SLOW_TIMEOUT_S = 2.0
"""CODERAI_GATEWAY_HEADER_TIMEOUT_S of the second gateway, the one the slowloris clients are sent to."""
IDLE = 10_000
SLOWLORIS, SILENT, SLOW_BODY = 200, 100, 50

HI = [{"role": "user", "content": "hi"}]
BASES: dict[str, dict] = {  # one small valid body per JSON endpoint: one token at most, so a valid mutant is cheap
    "/v1/chat/completions": {"model": "tiny", "messages": HI, "max_tokens": 1},
    "/v1/completions": {"model": "tiny", "prompt": "hi", "max_tokens": 1},
    "/v1/embeddings": {"model": "tiny", "input": "hi"},
    "/v1/rerank": {"model": "tiny", "query": "hi", "documents": ["a", "b"]},
    "/v1/responses": {"model": "tiny", "input": "hi", "max_output_tokens": 1, "store": False},
    "/v1/messages": {"model": "tiny", "max_tokens": 1, "messages": HI},
    "/v1/messages/count_tokens": {"model": "tiny", "messages": HI},
    "/v1/images/generations": {"model": "tiny", "prompt": "a cat"},
    "/v1/audio/speech": {"model": "tiny", "input": "hi", "voice": "alloy"},
    "/api/chat": {"model": "tiny", "messages": HI, "options": {"num_predict": 1}, "stream": False},
    "/api/generate": {"model": "tiny", "prompt": "hi", "options": {"num_predict": 1}, "stream": False},
    "/api/embed": {"model": "tiny", "input": "hi"},
    "/api/show": {"model": "tiny"},
}
UPLOADS = ["/v1/audio/transcriptions", "/v1/audio/translations", "/v1/images/edits", "/v1/files"]
"""Endpoints that take multipart/form-data."""


@st.composite
def bodies(draw) -> tuple[str, str, bytes]:
    path = draw(st.sampled_from(sorted(BASES)))
    base = BASES[path]
    kind = draw(st.sampled_from(["bytes", "truncated", "field", "document"]))
    if kind == "bytes":
        body = draw(st.binary(max_size=300))
    elif kind == "truncated":
        whole = dumps(base)
        body = whole[: draw(st.integers(0, len(whole) - 1))]
    elif kind == "field":
        mutant = dict(base)
        mutant[draw(st.sampled_from(FIELDS))] = draw(JSON_VALUES)
        body = dumps(mutant)
    else:
        body = dumps(draw(JSON_VALUES))
    return path, kind, body


def clean_error(path: str, r: httpx.Response) -> str | None:
    """What is wrong with an error answer, or None: a 4xx with an `error` object (a string in Ollama's API)."""
    if r.status_code >= 500:
        return f"a {r.status_code}"
    if "Traceback" in r.text:
        return "a traceback in the body"
    if r.status_code < 400:
        return None
    try:
        err = r.json()["error"]
    except (ValueError, KeyError, TypeError):
        return f"no error JSON: {r.text[:200]!r}"
    if path.startswith("/api/"):
        return None if isinstance(err, str) and err else f"an Ollama error that is not a message: {err!r}"
    return None if isinstance(err, dict) and err.get("message") else f"an error without a message: {err!r}"


def report(capsys, line: str) -> None:
    with capsys.disabled():
        print(f"\nhttp abuse: {line}")


@pytest.fixture(scope="module")
def nofile():
    """Room for 10,000 sockets in this process and in the gateways it starts (they inherit the limit)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = IDLE + 2_000
    if hard != resource.RLIM_INFINITY and hard < want:
        pytest.skip(f"RLIMIT_NOFILE's hard limit is {hard}: {IDLE} idle connections need about {want}")
    if soft != resource.RLIM_INFINITY and soft < want:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    yield
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


@pytest.fixture(scope="module")
def stack(nofile, tmp_path_factory, tiny_gguf, keys_file, admin_key):
    """The gateway with the production defaults (a 30 s header timeout), a small body limit."""
    models = [{"name": "tiny", "engine": "llama", "path": str(tiny_gguf), "params": {"n_ctx": 256}}]
    with running_stack(
        tmp_path_factory.mktemp("abuse"),
        models,
        gateway_args=("--api-keys-file", str(keys_file)),
        extra_env={"CODERAI_GATEWAY_MAX_BODY_BYTES": "65536"},
        headers={"Authorization": f"Bearer {admin_key}"},
    ) as s:
        yield s


@pytest.fixture(scope="module")
def quick_gateway(stack: Stack, keys_file) -> tuple[str, ServiceProcess]:
    """A second gateway on the same stack whose header timeout is SLOW_TIMEOUT_S, so slow clients end in seconds."""
    port = free_port()
    p = stack.start(
        "gateway-quick",
        "coderai.gateway",
        ["--port", str(port), "--api-keys-file", str(keys_file)],
        env={"CODERAI_GATEWAY_HEADER_TIMEOUT_S": str(SLOW_TIMEOUT_S)},
        ready=None,
    )
    url = f"http://127.0.0.1:{port}"
    wait_until(lambda: httpx.get(f"{url}/healthz", timeout=1).status_code == 200, 60, "the second gateway")
    return url, p


@pytest.fixture(scope="module")
def http(stack, admin_key):
    with httpx.Client(base_url=stack.http_url, headers={"Authorization": f"Bearer {admin_key}"}, timeout=30) as c:
        yield c


def chat_ok(url: str, admin_key: str, timeout_s: float = 30) -> bool:
    body = {"model": "tiny", "messages": HI, "max_tokens": 1}
    r = httpx.post(
        f"{url}/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {admin_key}"}, timeout=timeout_s
    )
    return r.status_code == 200 and r.json()["choices"][0]["message"]["role"] == "assistant"


def test_malformed_json_bodies_are_clean_4xx(stack, http, admin_key, capsys):
    statuses: collections.Counter = collections.Counter()
    kinds: collections.Counter = collections.Counter()

    @settings(
        max_examples=EXAMPLES,
        deadline=None,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    @given(bodies())
    def check(case: tuple[str, str, bytes]) -> None:
        path, kind, body = case
        r = http.post(path, content=body, headers={"Content-Type": "application/json"})
        statuses[r.status_code] += 1
        kinds[kind] += 1
        assert (what := clean_error(path, r)) is None, f"POST {path} {body[:300]!r}: {what}"

    check()
    tried = sum(statuses.values())
    report(
        capsys,
        f"{tried} malformed bodies on {len(BASES)} endpoints ({dict(kinds)}), statuses "
        f"{dict(sorted(statuses.items()))}, {sum(n for s, n in statuses.items() if s >= 500)} 5xx",
    )
    assert sum(n for s, n in statuses.items() if 400 <= s < 500) > tried // 2  # most inputs are refused
    assert chat_ok(stack.http_url, admin_key)


CONTENT_TYPES = [
    None,
    "text/plain",
    "application/x-www-form-urlencoded",
    "application/xml",
    "application/jsonx",
    "multipart/form-data; boundary=xyz",
    "multipart/form-data",
]


def test_wrong_content_types_are_clean_4xx(http, capsys):
    tried, bad = 0, []
    cases: list[tuple[str, dict[str, str], bytes]] = []
    ollama_served = []
    for path, base in BASES.items():
        body = dumps(base)
        for ctype in CONTENT_TYPES:
            if path.startswith("/api/"):  # Ollama's routes read JSON whatever the type says, as Ollama does
                ollama_served.append(
                    (path, ctype, http.post(path, content=body, headers={"Content-Type": ctype} if ctype else {}))
                )
                continue
            cases.append((path, {"Content-Type": ctype} if ctype else {}, body))
        # a real multipart body where JSON is expected
        req = http.build_request("POST", path, files={"file": ("a.json", body, "application/json")})
        cases.append((path, {"Content-Type": req.headers["Content-Type"]}, req.read()))
    for path in UPLOADS:
        for ctype in [
            None,
            "application/json",
            "text/plain",
            "multipart/form-data",
            "multipart/form-data; boundary=xyz",
            "application/x-www-form-urlencoded",
        ]:
            cases.append((path, {"Content-Type": ctype} if ctype else {}, b'{"model": "tiny", "purpose": "batch"}'))
        cases.append((path, {"Content-Type": "multipart/form-data; boundary=xyz"}, b"--xyz\r\nbroken"))
    statuses: collections.Counter = collections.Counter()
    for path, headers, body in cases:
        r = http.post(path, content=body, headers=headers)
        tried += 1
        statuses[r.status_code] += 1
        if (what := clean_error(path, r)) or r.status_code < 400:
            bad.append(f"POST {path} {headers}: {what or r.status_code}")
    report(
        capsys,
        f"{tried} requests with a wrong content type, statuses {dict(sorted(statuses.items()))}, "
        f"{len(bad)} not a clean 4xx",
    )
    assert not bad, "\n".join(bad)
    # ... and answered as the same body sent as application/json is
    as_json = {
        p: http.post(p, content=dumps(BASES[p]), headers={"Content-Type": "application/json"}).status_code
        for p in BASES
        if p.startswith("/api/")
    }
    assert as_json and all(r.status_code == as_json[p] for p, _, r in ollama_served), [
        (p, c, r.status_code, as_json[p]) for p, c, r in ollama_served if r.status_code != as_json[p]
    ]


def test_huge_headers_are_refused_and_the_gateway_keeps_serving(stack, admin_key, capsys):
    port = stack.gateway_port
    auth = f"Authorization: Bearer {admin_key}\r\n".encode()

    def get(headers: bytes) -> bytes:
        return b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\n" + headers + b"Connection: close\r\n\r\n"

    cases = {  # what each may get: the answer (a 64 KiB header fits granian's buffer), a 431, a 401 or a close
        "a 64 KiB header": (get(auth + b"X-Big: " + b"a" * 65536 + b"\r\n"), {200}),
        "500 headers": (get(auth + b"".join(b"X-H%d: v\r\n" % i for i in range(500))), {431}),
        "a 1 MiB header": (get(auth + b"X-Big: " + b"a" * (1 << 20) + b"\r\n"), {431, None}),
        "a 64 KiB Authorization": (get(b"Authorization: Bearer " + b"k" * 65536 + b"\r\n"), {401}),
        "a non-ASCII Authorization": (get(b"Authorization: Bearer \xff\xfe\x80\r\n"), {401}),
        "a 100 KiB URL": (b"GET /" + b"a" * 102400 + b" HTTP/1.1\r\nHost: x\r\n\r\n", {414, 431, None}),
        "a 4 MiB head never ended": (b"GET / HTTP/1.1\r\nX-Big: " + b"a" * (4 << 20), {431, None}),
        "a bad Content-Length": (
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
            + auth
            + b"Content-Type: application/json\r\nContent-Length: -1\r\n\r\n{}",
            {400},
        ),
        "a broken chunked body": (
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
            + auth
            + b"Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n"
            b"Connection: close\r\n\r\nzz\r\n{}\r\n0\r\n\r\n",
            {400},
        ),
        "binary noise": (bytes(range(256)) * 64, {400, None}),
    }
    bad = []
    for name, (data, allowed) in cases.items():
        answer = raw_request(port, data)
        status = status_of(answer)
        if status not in allowed:
            bad.append(f"{name}: {answer[:200]!r}")
        elif status and status >= 400 and b"content-type: application/json" in answer.lower():
            body = answer.split(b"\r\n\r\n", 1)[1]
            if "error" not in json.loads(body):
                bad.append(f"{name}: {body[:200]!r}")
        assert httpx.get(f"{stack.http_url}/healthz", timeout=10).status_code == 200, f"no /healthz after {name}"
    report(capsys, f"{len(cases)} oversized or broken request heads, {len(bad)} answered otherwise than allowed")
    assert not bad, "\n".join(bad)
    assert chat_ok(stack.http_url, admin_key)


def test_slowloris_clients_are_closed_and_others_answered(quick_gateway, admin_key, capsys):
    """SLOWLORIS sockets drip a request head a byte at a time, SILENT ones send nothing: the gateway closes both
    after its header timeout, answering a normal client all the while. SLOW_BODY ones send a whole head and then
    hold their body back: granian has no body timeout, so those stay open until they leave (docs/testing.md)."""
    url, proc = quick_gateway
    port = int(url.rsplit(":", 1)[1])
    baseline = open_fds(proc)
    head = b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: " + b"a" * 4096  # never ends
    started = time.monotonic()
    slow = connect_many(port, SLOWLORIS)
    silent = connect_many(port, SILENT)
    held = connect_many(port, SLOW_BODY)
    for s in held:
        s.setblocking(True)
        s.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer "
            + admin_key.encode()
            + b"\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n{"
        )
    answers: list[bool | str] = []
    stop = threading.Event()

    def normal_client() -> None:
        while not stop.is_set():
            try:
                answers.append(chat_ok(url, admin_key))
            except httpx.HTTPError as exc:
                answers.append(repr(exc))

    client = threading.Thread(target=normal_client)
    client.start()
    open_slow = {s.fileno(): s for s in slow + silent}
    sent = collections.Counter()
    deadline = started + 10 * SLOW_TIMEOUT_S * deadline_scale()  # bounds the drip: the attack, not a wait
    try:
        while open_slow and time.monotonic() < deadline:
            for fd, s in list(open_slow.items()):
                try:
                    if s in slow and sent[fd] < len(head):
                        s.send(head[sent[fd] : sent[fd] + 1])
                        sent[fd] += 1
                    if s.recv(1024) == b"":
                        del open_slow[fd]
                except BlockingIOError:
                    pass
                except OSError:  # reset by the gateway
                    del open_slow[fd]
            # the drip's pace, woken early by a socket the gateway closes (readable at EOF); poll, not select: this
            # process may hold more than 1,024 files by now, and select() refuses a descriptor past that (a run did)
            poller = select.poll()
            for fd in open_slow:
                poller.register(fd, select.POLLIN)
            poller.poll(50)
        closed_after = time.monotonic() - started
    finally:
        stop.set()
        client.join(30)
    try:
        assert not open_slow, (
            f"{len(open_slow)} of {SLOWLORIS + SILENT} slow sockets still open after {closed_after:.1f}s"
        )
        assert closed_after >= SLOW_TIMEOUT_S * 0.8, f"closed after {closed_after:.1f}s, before the header timeout"
        assert answers and all(a is True for a in answers), f"the normal client's answers: {answers}"
        for s in held:  # still held, unanswered: the gateway waits for their bodies
            s.settimeout(0)
            with pytest.raises(BlockingIOError):
                s.recv(1)
    finally:
        close_all(slow + silent + held)
    wait_until(lambda: open_fds(proc) <= baseline + 10, 15, f"the gateway's open files back to about {baseline}")
    report(
        capsys,
        f"{SLOWLORIS} slowloris sockets ({sum(sent.values())} bytes dripped) and {SILENT} silent ones "
        f"closed by the gateway after {closed_after:.1f}s, {SLOW_BODY} slow bodies held, "
        f"{len(answers)} normal answers meanwhile, all 200",
    )
    assert chat_ok(url, admin_key)


def test_ten_thousand_idle_connections_do_not_stop_answers(stack, admin_key, capsys):
    proc = stack.procs["gateway"]
    limit = next(
        int(line.split()[3])
        for line in Path(f"/proc/{proc.proc.pid}/limits").read_text().splitlines()
        if line.startswith("Max open files")
    )
    if limit < IDLE + 500:
        pytest.skip(f"the gateway may open {limit} files, too few for {IDLE} idle connections")
    baseline = open_fds(proc)
    started = time.monotonic()
    socks = connect_many(stack.gateway_port, IDLE)
    try:
        opened_s = time.monotonic() - started
        wait_until(lambda: open_fds(proc) >= baseline + IDLE, 30, f"the gateway to accept {IDLE} connections")
        t0 = time.monotonic()
        assert chat_ok(stack.http_url, admin_key, timeout_s=30)
        answer_s = time.monotonic() - t0
        assert httpx.get(f"{stack.http_url}/healthz", timeout=10).status_code == 200
    finally:
        close_all(socks)
    wait_until(lambda: open_fds(proc) <= baseline + 10, 30, f"the gateway's open files back to about {baseline}")
    report(
        capsys,
        f"{IDLE} idle connections (opened in {opened_s:.1f}s): a chat answered 200 in {answer_s:.2f}s; "
        f"the gateway's open files back to {open_fds(proc)} (baseline {baseline}) once they closed",
    )


def _nested(levels: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


def test_a_deeply_nested_schema_is_refused_before_any_engine_builds_it(stack, admin_key, capsys):
    """Attack: one `json_schema` nested 900 deep took llama-server past 4 GiB in 15 s, shared by every tenant of
    the model. Through the OpenAI, Anthropic and Ollama SDKs, as a response format and as a tool, it is a 400."""
    import anthropic
    import ollama

    deep = _nested(400)  # 800 nested objects: as deep as a Python client can encode
    oa = openai.OpenAI(base_url=stack.base_url, api_key=admin_key, max_retries=0, timeout=30)
    tried = []
    with pytest.raises(openai.BadRequestError) as exc:
        oa.chat.completions.create(
            model="tiny",
            messages=HI,
            max_tokens=1,
            response_format={"type": "json_schema", "json_schema": {"name": "deep", "schema": deep}},
        )
    assert exc.value.body["code"] == "schema_too_complex" and exc.value.body["param"] == "response_format"
    tried.append("openai response_format")
    with pytest.raises(openai.BadRequestError):
        oa.chat.completions.create(
            model="tiny",
            messages=HI,
            max_tokens=1,
            tools=[{"type": "function", "function": {"name": "f", "parameters": deep}}],
        )
    tried.append("openai tools")
    an = anthropic.Anthropic(base_url=stack.http_url, api_key=admin_key, max_retries=0, timeout=30)
    with pytest.raises(anthropic.BadRequestError):
        an.messages.create(model="tiny", max_tokens=1, messages=HI, tools=[{"name": "f", "input_schema": deep}])
    tried.append("anthropic tools")
    ol = ollama.Client(host=stack.http_url, headers={"Authorization": f"Bearer {admin_key}"}, timeout=30)
    with pytest.raises(ollama.ResponseError) as oexc:
        ol.chat(model="tiny", messages=HI, format=deep, options={"num_predict": 1})
    assert oexc.value.status_code == 400
    tried.append("ollama format")
    # what agents send stays well inside the bound: a schema 10 deep is answered
    r = oa.chat.completions.create(
        model="tiny",
        messages=HI,
        max_tokens=1,
        tools=[{"type": "function", "function": {"name": "f", "parameters": _nested(10)}}],
    )
    assert r.choices
    report(
        capsys,
        f"a schema of 800 nested objects, sent as {', '.join(tried)}: all refused with a 400; one 10 deep answered",
    )


def test_the_sdk_still_answers_after_all_of_it(stack, admin_key):
    client = openai.OpenAI(base_url=stack.base_url, api_key=admin_key, max_retries=0, timeout=30)
    r = client.chat.completions.create(model="tiny", messages=HI, max_tokens=2)
    assert r.choices[0].message.role == "assistant"
    assert httpx.get(f"{stack.http_url}/healthz", timeout=10).json()["status"] == "ok"
