"""Remote OpenAI-compatible endpoints as an engine family (`remote`, engines/remote.py), with real servers: a bare
`llama-server` and a second coderai stack are the remotes of a model of a first stack. The OpenAI SDK's chat and
stream through the first reach them with the key kept in the worker's secrets; killing one remote fails over before
the first token; usage and spend appear under the local key; a remote that sends a 50 MB body or a malformed
stream gets a clean error, not a hung gateway."""

from __future__ import annotations

import http.server
import os
import signal
import subprocess
import threading
import time

import httpx
import openai
import pytest

from coderai.accounts.keyfile import KeyRecord, hash_key, write_keys
from coderai.engine_worker.engines.echo import DEFAULT_REPLY
from coderai.runtime.embedded import find_llama_server, free_port
from coderai.testing.procs import wait_until
from coderai.testing.stack import running_stack

pytestmark = pytest.mark.slow

REMOTE_KEY = "sk-remote-0123456789abcdef"  # what both remotes take; the first stack keeps it in a secret file
LOCAL_KEY = "sk-local-admin-0123456789"
PRICE = {"price_prompt_per_mtok": 1000.0, "price_completion_per_mtok": 2000.0}


class Hostile(http.server.BaseHTTPRequestHandler):
    """An endpoint that lists models fine and then answers a chat with 50 MB (under /big) or a stream that is
    not JSON (under /garbled)."""

    def log_message(self, *args) -> None:
        pass

    def do_GET(self) -> None:
        self._send(200, b'{"object": "list", "data": []}')

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        if self.path.startswith("/big"):
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(50 * 2**20))
            self.end_headers()
            chunk = b" " * 2**20
            try:
                for _ in range(50):
                    self.wfile.write(chunk)
            except OSError:
                pass  # the client hung up, as it should
        else:
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            self.wfile.write(b'data: {"choices": [{"delta": {"content": "hi"\n\ndata: [DONE]\n\n')

    def _send(self, status: int, body: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


@pytest.fixture(scope="module")
def remotes(tmp_path_factory, tiny_gguf, redis_server):
    binary = find_llama_server()
    if binary is None:
        pytest.skip("no llama-server binary (scripts/setup builds it)")
    root = tmp_path_factory.mktemp("remote-family")
    port = free_port()
    log = open(root / "llama-server.log", "wb")
    bare = subprocess.Popen(
        [
            binary,
            "--model",
            str(tiny_gguf),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--api-key",
            REMOTE_KEY,
            "--ctx-size",
            "512",
            "--threads",
            "1",
            "--no-webui",
        ],
        stdout=log,
        stderr=log,
        stdin=subprocess.DEVNULL,
        start_new_session=True,
    )
    hostile = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Hostile)
    threading.Thread(target=hostile.serve_forever, daemon=True).start()
    hostile_url = f"http://127.0.0.1:{hostile.server_address[1]}"
    try:
        wait_until(
            lambda: (
                bare.poll() is not None or httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200
            ),
            120,
            "the bare llama-server",
        )
        assert bare.poll() is None, (root / "llama-server.log").read_text()[-2000:]
        # the second remote: a coderai stack serving `tiny` (the echo engine: its answers tell which remote spoke)
        far_keys = root / "far-keys.toml"
        write_keys(str(far_keys), [KeyRecord(name="first-stack", sha256=hash_key(REMOTE_KEY), scopes=["inference"])])
        with running_stack(
            root / "far",
            [{"name": "tiny", "engine": "echo", "path": "-"}],
            gateway_args=("--api-keys-file", str(far_keys)),
            extra_env={"CODERAI_WORKER_FAMILIES": "echo"},
            headers={"Authorization": f"Bearer {REMOTE_KEY}"},
        ) as far:
            keys = root / "keys.toml"
            write_keys(str(keys), [KeyRecord(name="local", sha256=hash_key(LOCAL_KEY), scopes=["inference", "admin"])])
            secrets = root / "near" / "w1" / "secrets"
            secrets.mkdir(parents=True)
            (secrets / "far-key").write_text(REMOTE_KEY + "\n")
            os.chmod(secrets / "far-key", 0o600)
            remote = {"engine": "remote", "path": "-", "params": {"served_model": "tiny", "api_key_secret": "far-key"}}
            models = [
                {
                    "name": "far",
                    **remote,
                    **PRICE,
                    "params": {**remote["params"], "service_urls": [f"http://127.0.0.1:{port}", far.http_url]},
                },
                {
                    "name": "big",
                    "engine": "remote",
                    "path": "-",
                    "params": {"service_url": f"{hostile_url}/big", "max_answer_mb": 4},
                },
                {
                    "name": "garbled",
                    "engine": "remote",
                    "path": "-",
                    "params": {"service_url": f"{hostile_url}/garbled"},
                },
            ]
            with running_stack(
                root / "near",
                models,
                gateway_args=("--api-keys-file", str(keys)),
                redis_url=redis_server.url,
                extra_env={"CODERAI_GATEWAY_REDIS_URL": redis_server.url, "CODERAI_WORKER_FAMILIES": "remote"},
                headers={"Authorization": f"Bearer {LOCAL_KEY}"},
            ) as near:
                near.bare = bare
                yield near
    finally:
        hostile.shutdown()
        if bare.poll() is None:
            os.killpg(bare.pid, signal.SIGKILL)
            bare.wait(10)
        log.close()


def _client(stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.base_url, api_key=LOCAL_KEY, max_retries=0, timeout=60)


def _usage(stack) -> dict:
    rows = httpx.get(
        f"{stack.http_url}/admin/usage",
        params={"key": "local", "model": "far"},
        timeout=10,
        headers={"Authorization": f"Bearer {LOCAL_KEY}"},
    ).json()["rows"]
    return rows[0] if rows else {"requests": 0, "cost_usd": 0.0}


def test_chat_and_stream_reach_the_remotes_fail_over_and_are_billed_here(remotes):
    client = _client(remotes)
    before = _usage(remotes)  # the stack's own readiness check (one chat) may be in it
    first = client.chat.completions.create(model="far", messages=[{"role": "user", "content": "hello"}], max_tokens=8)
    print(f"through the first remote: {first.choices[0].message.content!r}, usage {first.usage}")
    assert first.choices[0].message.content != DEFAULT_REPLY  # the bare llama-server, the least busy and first
    assert first.usage.prompt_tokens > 0 and first.usage.completion_tokens > 0
    stream = client.chat.completions.create(
        model="far", messages=[{"role": "user", "content": "hi"}], max_tokens=8, stream=True
    )
    assert sum(1 for c in stream if c.choices and c.choices[0].delta.content) > 0
    os.killpg(remotes.bare.pid, signal.SIGKILL)  # the first remote dies: each request goes on to the second
    remotes.bare.wait(10)
    after = [
        client.chat.completions.create(model="far", messages=[{"role": "user", "content": "hello"}]) for _ in range(3)
    ]
    streamed = "".join(
        c.choices[0].delta.content or ""
        for c in client.chat.completions.create(
            model="far", messages=[{"role": "user", "content": "hello"}], stream=True
        )
        if c.choices
    )
    print(f"after the first remote died: {[a.choices[0].message.content for a in after]}, streamed {streamed!r}")
    assert [a.choices[0].message.content for a in after] == [DEFAULT_REPLY] * 3 and streamed == DEFAULT_REPLY
    usage = wait_until(
        lambda: (u := _usage(remotes))["requests"] >= before["requests"] + 6 and u, 30, "the local key's usage of `far`"
    )
    print(f"the local key's usage: {before} before, {usage} after")
    assert usage["requests"] == before["requests"] + 6 and usage["cost_usd"] > before["cost_usd"]
    for name, p in remotes.procs.items():  # the remotes' key, kept in a secret file, is in no log of this stack
        assert REMOTE_KEY not in p.log_text(), name


def test_a_remote_that_sends_too_much_or_garbage_gets_a_clean_error(remotes):
    client = _client(remotes)
    t0 = time.monotonic()
    with pytest.raises(openai.APIStatusError) as big:
        client.chat.completions.create(model="big", messages=[{"role": "user", "content": "hello"}])
    took = time.monotonic() - t0
    print(f"a 50 MB answer: {big.value.status_code} {big.value.body} after {took:.1f}s")
    assert big.value.status_code == 502 and "more than 4194304 bytes" in str(big.value.body)
    with pytest.raises(openai.APIStatusError) as garbled:
        list(client.chat.completions.create(model="garbled", messages=[{"role": "user", "content": "hi"}], stream=True))
    print(f"a malformed stream: {garbled.value.status_code} {garbled.value.body}")
    assert garbled.value.status_code == 502 and "malformed answer" in str(garbled.value.body)
    assert "Traceback" not in str(big.value.body) + str(garbled.value.body)
    # the gateway is whole after both
    assert client.chat.completions.create(model="far", messages=[{"role": "user", "content": "x"}]).choices
