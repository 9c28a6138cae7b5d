"""A gateway picks engines from its own copy of the router's view (gateway/picker.py): on a real stack (secured
NATS, the gateway under its own service user, two llama-server workers of the tiny GGUF), chats through the OpenAI
SDK send no `coderai.route.pick` once the copy is whole, keep a conversation on one engine, and still reach the
router from a gateway that has the copy turned off. A spy with the service's rights counts the picks on the bus."""

from __future__ import annotations

import asyncio
import threading
import time

import nats
import openai
import pytest

from coderai.contracts.subjects import ROUTE_PICK
from coderai.contracts.topology import HDR_REQUEST_ID
from coderai.runtime.embedded import free_port
from coderai.testing.procs import wait_until
from coderai.testing.stack import affinity, running_stack

pytestmark = pytest.mark.slow


class PickSpy:
    """The request ids of the `coderai.route.pick` requests on the bus, heard from a thread of its own. `sync()`
    returns once every pick the server took before the call has reached the spy: a pick is sent before its
    request is answered, and the server queues it to the spy before the PONG of a later ping."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.ids: list[str] = []
        self._ready = threading.Event()
        self._stop: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._nc = None
        self._thread = threading.Thread(target=asyncio.run, args=(self._run(),), daemon=True)

    async def _run(self) -> None:
        self._loop, self._stop = asyncio.get_running_loop(), asyncio.Event()
        self._nc = nc = await nats.connect(self.url)

        async def on_pick(m) -> None:
            self.ids.append(ROUTE_PICK.decode(m.data).request_id)

        await nc.subscribe("coderai.route.pick", cb=on_pick)
        await nc.flush()
        self._ready.set()
        await self._stop.wait()
        await nc.close()

    def sync(self) -> list[str]:
        assert self._loop is not None and self._nc is not None
        asyncio.run_coroutine_threadsafe(self._nc.flush(), self._loop).result(10)
        return list(self.ids)

    def __enter__(self) -> PickSpy:
        self._thread.start()
        assert self._ready.wait(10)
        return self

    def __exit__(self, *_exc) -> None:
        assert self._loop is not None and self._stop is not None
        self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(10)


@pytest.fixture(scope="module")
def stack(tmp_path_factory, tiny_gguf):
    root = tmp_path_factory.mktemp("local-pick")
    models = [{"name": "tiny", "engine": "llama", "path": str(tiny_gguf), "params": {"n_ctx": 256}}]
    with running_stack(root, models, workers=("w1", "w2"), gateway_args=("--no-auth",)) as s:
        yield s


def _chat(client: openai.OpenAI, user: str, text: str = "hi") -> str:
    """A chat through the SDK; its request id."""
    raw = client.chat.completions.with_raw_response.create(
        model="tiny", messages=[{"role": "user", "content": text}], max_tokens=2, user=user
    )
    raw.parse()
    return raw.headers[HDR_REQUEST_ID]


def test_chats_send_no_route_pick_once_the_gateways_copy_is_whole(stack):
    client = openai.OpenAI(base_url=stack.base_url, api_key="unused", max_retries=0)
    with PickSpy(stack.nats.service_url) as spy:
        # the copy is whole within a heartbeat or two of the gateway's start: until then the router answers
        wait_until(lambda: _chat(client, "warm-up") not in spy.sync(), 30, "a chat picked without the router")
        ids = [_chat(client, "alice", f"turn {i}") for i in range(10)]
        asked = set(ids) & set(spy.sync())
    assert not asked, f"{len(asked)} of 10 chats asked the router"


def _affinity(stack) -> dict[str, str]:
    return affinity(stack.nats.service_url)


def test_the_copy_writes_where_a_conversation_went_and_keeps_it_there(stack):
    """The copy writes where a conversation went to the affinity bucket, as the router does (every gateway and the
    router then send its next turns there), with no pick asked of the router."""
    client = openai.OpenAI(base_url=stack.base_url, api_key="unused", max_retries=0)
    _chat(client, "warm-up")
    before = _affinity(stack)
    user = f"bob-{time.monotonic_ns()}"
    with PickSpy(stack.nats.service_url) as spy:
        ids = [_chat(client, user, f"turn {i}") for i in range(5)]
        assert not set(ids) & set(spy.sync())
    new = wait_until(
        lambda: {k: e for k, e in _affinity(stack).items() if k not in before} or None, 10, "affinity written"
    )
    # the conversation's keys (its user, its prefix chain's first and last elements) all name one engine
    assert len(set(new.values())) == 1, new


def test_a_gateway_with_the_copy_turned_off_asks_the_router_for_every_pick(stack):
    port = free_port()
    stack.start(
        "gateway-no-copy",
        "coderai.gateway",
        ["--port", str(port), "--no-auth"],
        env={"CODERAI_GATEWAY_LOCAL_PICK": "false"},
        ready="gateway listening",
    )
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
    wait_until(lambda: _chat(client, "carol"), 30, "the second gateway answering")
    with PickSpy(stack.nats.service_url) as spy:
        ids = [_chat(client, "carol", f"turn {i}") for i in range(5)]
        assert set(ids) <= set(spy.sync())
