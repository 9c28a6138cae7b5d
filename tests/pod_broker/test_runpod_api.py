"""The pod-broker's RunPod client against the fake RunPod API: escaped variables, typed errors, bounded retries,
and no blind retry of a create that may have happened."""

from __future__ import annotations

import httpx
import pytest

from coderai.pod_broker.runpod_api import AuthError, CreateUncertain, NoCapacity, RunPodClient, RunPodError, with_retry
from coderai.runtime.embedded import free_port
from coderai.testing.fake_runpod import NO_CAPACITY_MESSAGE, FakeRunPod

A6000 = "NVIDIA RTX A6000"
HOSTILE_ENV = {
    "QUOTE": 'say "hi" }) { podTerminate',
    "BACKSLASH": "C:\\new\\table\\",
    "NEWLINES": "line1\nline2\r\n\ttabbed",
    "UNICODE": "héllo ✓ 日本語 🚀",
    "EQUALS": "a=b==c",
    "EMPTY": "",
}


class Sleeps(list):
    async def __call__(self, s: float) -> None:
        self.append(s)


@pytest.fixture
def fake():
    with FakeRunPod() as f:
        yield f


@pytest.fixture
def sleeps() -> Sleeps:
    return Sleeps()


def client(fake: FakeRunPod, sleeps: Sleeps, **kw) -> RunPodClient:
    return RunPodClient(fake.api_key, fake.base_url, sleep=sleeps, **kw)


async def test_gpu_types_list_prices_and_stock(fake, sleeps):
    fake.set_capacity(A6000, 0)
    async with client(fake, sleeps) as rp:
        types = {g.id: g for g in await rp.gpu_types()}
        assert types[A6000].price_hr == 0.79 and types[A6000].spot_price_hr == 0.39
        assert types[A6000].memory_gb == 48 and types[A6000].name == "RTX A6000"
        assert types[A6000].available is False and types["NVIDIA GeForce RTX 4090"].available is True
        assert [g.id for g in await rp.gpu_types(gpu_type_id=A6000)] == [A6000]


async def test_names_and_env_with_quotes_backslashes_newlines_unicode_round_trip(fake, sleeps):
    name = 'coderai-pod "q" \\ ü'
    async with client(fake, sleeps) as rp:
        pod = await rp.create_pod(name, "coderai/worker:1", A6000, gpu_count=2, env=HOSTILE_ENV)
        assert pod.env == HOSTILE_ENV and pod.name == name and pod.cost_per_hr == 0.79 * 2
        assert fake.pod(pod.id).env == HOSTILE_ENV  # what the pod's process would be started with
        again = await rp.get_pod(pod.id)
        assert again.env == HOSTILE_ENV and again.name == name and again.gpu_type_id == A6000
        assert (await rp.find_by_name(name)).id == pod.id


def test_the_runpod_sdk_cannot_carry_such_values(fake, monkeypatch):
    """Why the broker does not use the SDK's create_pod: it pastes values into the query unescaped."""
    runpod = pytest.importorskip("runpod")
    monkeypatch.setenv("RUNPOD_API_BASE_URL", fake.base_url)
    monkeypatch.setattr(runpod, "api_key", fake.api_key)
    with pytest.raises(runpod.error.QueryError, match="Syntax Error"):  # a quote ends the string early
        runpod.create_pod("p", "img", A6000, env={"TOKEN": 'abc"def'})
    assert fake.pods() == []
    pod = runpod.create_pod("p", "img", A6000, env={"DIR": "C:\\new"})  # a backslash is silently reinterpreted
    assert fake.pod(pod["id"]).env == {"DIR": "C:\new"} != {"DIR": "C:\\new"}


async def test_spot_pods_bid_the_current_minimum_by_default(fake, sleeps):
    async with client(fake, sleeps) as rp:
        pod = await rp.create_pod("spot-1", "img", A6000, spot=True, gpu_count=2)
        assert pod.spot and pod.cost_per_hr == 0.39 * 2
        with pytest.raises(RunPodError, match="below the current spot price"):
            await rp.create_pod("spot-2", "img", A6000, spot=True, bid_per_gpu=0.1)


async def test_no_capacity_is_typed_and_not_retried(fake, sleeps):
    fake.set_capacity(A6000, 0)
    async with client(fake, sleeps) as rp:
        before = fake.request_count
        with pytest.raises(NoCapacity) as err:
            await rp.create_pod("p", "img", A6000)
        assert err.value.message == NO_CAPACITY_MESSAGE and not err.value.retryable
        assert fake.request_count - before == 1 and sleeps == []


async def test_server_errors_and_rate_limits_are_retried_with_backoff(fake, sleeps):
    async with client(fake, sleeps, base_delay_s=0.5) as rp:
        fake.fail_next(2, status=500)
        fake.fail_next(1, status=429)
        assert len(await rp.gpu_types()) == 4
        assert fake.request_count == 4
        assert 0.25 <= sleeps[0] <= 0.5 and 0.5 <= sleeps[1] <= 1.0 and sleeps[2] >= 1.0  # 429: Retry-After: 1
        fake.fail_next(4, status=503)
        with pytest.raises(RunPodError) as err:
            await rp.list_pods()
        assert err.value.retryable and err.value.status == 503 and fake.request_count == 8


async def test_a_bad_key_is_an_auth_error_without_retries(fake, sleeps):
    async with RunPodClient("wrong", fake.base_url, sleep=sleeps) as rp:
        with pytest.raises(AuthError):
            await rp.list_pods()
    assert fake.request_count == 1


async def test_create_is_not_retried_once_runpod_may_have_acted(fake, sleeps):
    async with client(fake, sleeps) as rp:
        fake.fail_next(1, status=502)
        with pytest.raises(CreateUncertain) as err:
            await rp.create_pod("maybe-1", "img", A6000)
        assert err.value.name == "maybe-1" and fake.request_count == 1
        assert await rp.find_by_name("maybe-1") is None  # this time it was not created: safe to create again

        fake.fail_next(1, status=429)  # a rate-limited create was not acted on: retried
        assert (await rp.create_pod("limited-1", "img", A6000)).name == "limited-1"
        assert len(sleeps) == 1


class LoseCreateReply(httpx.AsyncBaseTransport):
    """Delivers every request, then loses the reply to a create, as a read timeout would."""

    def __init__(self) -> None:
        self.inner = httpx.AsyncHTTPTransport()

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        response = await self.inner.handle_async_request(request)
        if b"podFindAndDeployOnDemand" in request.content:
            await response.aread()
            raise httpx.ReadTimeout("reply lost", request=request)
        return response

    async def aclose(self) -> None:
        await self.inner.aclose()


async def test_a_create_whose_reply_is_lost_is_found_by_name(fake, sleeps):
    async with client(fake, sleeps, transport=LoseCreateReply()) as rp:
        with pytest.raises(CreateUncertain):
            await rp.create_pod("lost-1", "img", A6000, env={"K": "v"})
        assert len(fake.pods()) == 1 and sleeps == []  # created once, billed once, never repeated
        found = await rp.find_by_name("lost-1")
        assert found.id == fake.pods()[0].id and found.env == {"K": "v"}


async def test_a_create_that_never_reached_runpod_is_retried(sleeps):
    async with RunPodClient("k", f"http://127.0.0.1:{free_port()}", sleep=sleeps, attempts=3) as rp:
        with pytest.raises(RunPodError) as err:
            await rp.create_pod("p", "img", A6000)
    assert err.value.retryable and not err.value.maybe_applied and len(sleeps) == 2


async def test_stop_resume_terminate_and_list(fake, sleeps):
    async with client(fake, sleeps) as rp:
        pod = await rp.create_pod("life-1", "img", A6000)
        other = await rp.create_pod("life-2", "img", A6000)
        assert (await rp.stop_pod(pod.id)).status == "EXITED"
        fake.set_capacity(A6000, 0)  # its GPU was taken while it was stopped
        with pytest.raises(NoCapacity):
            await rp.resume_pod(pod.id, 1)
        fake.set_capacity(A6000, 1)
        assert (await rp.resume_pod(pod.id, 1)).status == "RUNNING"
        await rp.terminate_pod(pod.id)
        await rp.terminate_pod(pod.id)  # idempotent: a lost reply's retry must not fail
        assert await rp.get_pod(pod.id) is None
        assert [p.id for p in await rp.list_pods()] == [other.id]
        with pytest.raises(RunPodError, match="not found"):
            await rp.stop_pod(pod.id)


async def test_with_retry_backoff_is_exponential_jittered_and_capped():
    calls, sleeps = [], Sleeps()

    async def flaky():
        calls.append(1)
        raise RunPodError("busy", retryable=True)

    for rand, expected in ((lambda: 1.0, [1.0, 2.0, 4.0, 5.0, 5.0]), (lambda: 0.0, [0.5, 1.0, 2.0, 2.5, 2.5])):
        sleeps.clear()
        with pytest.raises(RunPodError):
            await with_retry(flaky, attempts=6, base_delay_s=1.0, max_delay_s=5.0, sleep=sleeps, rand=rand)
        assert sleeps == expected
    assert len(calls) == 12


async def test_a_network_volume_is_attached_only_when_named(fake, sleeps):
    async with client(fake, sleeps) as rp:
        with_volume = await rp.create_pod("v-1", "img", A6000, network_volume_id="vol-weights")
        plain = await rp.create_pod("v-2", "img", A6000)
    assert fake.pod(with_volume.id).spec["networkVolumeId"] == "vol-weights"
    assert "networkVolumeId" not in fake.pod(plain.id).spec
