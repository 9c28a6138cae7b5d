"""The fake RunPod API: it speaks the runpod SDK's dialect, bills by the second on an injectable clock, boots a
real process per pod after the boot delay, and injects the faults the pod-broker must survive."""

from __future__ import annotations

import os
import time

import httpx
import pytest

from coderai.testing.fake_runpod import NO_CAPACITY_MESSAGE, FakeGpuType, FakeRunPod, python_launcher
from coderai.testing.procs import wait_until

A6000 = "NVIDIA RTX A6000"
SLEEPER = python_launcher(["-c", "import signal; signal.pause()"])  # a pod process that runs until it is killed


class Clock:
    def __init__(self, t: float = 1_000_000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def fake(clock):
    with FakeRunPod(now=clock) as f:
        yield f


@pytest.fixture
def sdk(fake, monkeypatch):
    """The real runpod SDK, pointed at the fake (it reads RUNPOD_API_BASE_URL on every call)."""
    runpod = pytest.importorskip("runpod")
    monkeypatch.setenv("RUNPOD_API_BASE_URL", fake.base_url)
    monkeypatch.setattr(runpod, "api_key", fake.api_key)
    return runpod


def post(fake: FakeRunPod, query: str, key: str | None = None, **kw) -> httpx.Response:
    headers = {"Authorization": f"Bearer {fake.api_key if key is None else key}"}
    return httpx.post(f"{fake.base_url}/graphql", json={"query": query}, headers=headers, **kw)


def create(fake: FakeRunPod, name: str, env: dict[str, str] | None = None) -> str:
    q = "mutation D($input: PodFindAndDeployOnDemandInput) { podFindAndDeployOnDemand(input: $input) { id } }"
    spec = {
        "name": name,
        "imageName": "i",
        "gpuTypeId": A6000,
        "env": [{"key": k, "value": v} for k, v in (env or {}).items()],
    }
    r = httpx.post(
        f"{fake.base_url}/graphql",
        headers={"Authorization": f"Bearer {fake.api_key}"},
        json={"query": q, "variables": {"input": spec}},
    )
    return r.json()["data"]["podFindAndDeployOnDemand"]["id"]


def terminate(fake: FakeRunPod, pod_id: str) -> None:
    r = post(fake, f'mutation {{ podTerminate(input: {{podId: "{pod_id}"}}) }}')
    assert r.json() == {"data": {"podTerminate": None}}


def test_the_runpod_sdk_drives_a_pod_through_its_life(fake, sdk):
    assert {"id": A6000, "displayName": "RTX A6000", "memoryInGb": 48} in sdk.get_gpus()
    gpu = sdk.get_gpu(A6000, 2)
    assert (gpu["lowestPrice"]["uninterruptablePrice"], gpu["lowestPrice"]["minimumBidPrice"]) == (0.79, 0.39)

    created = sdk.create_pod("coderai-t1", "coderai/worker:1", A6000, gpu_count=2, env={"CODERAI_X": "1"})
    pod = sdk.get_pod(created["id"])
    assert pod["name"] == "coderai-t1" and pod["desiredStatus"] == "RUNNING" and pod["env"] == ["CODERAI_X=1"]
    assert pod["costPerHr"] == 0.79 * 2 and pod["gpuCount"] == 2 and pod["machine"]["gpuDisplayName"] == "RTX A6000"
    assert [p["id"] for p in sdk.get_pods()] == [created["id"]]

    assert sdk.stop_pod(created["id"])["desiredStatus"] == "EXITED"
    assert sdk.resume_pod(created["id"], 2)["desiredStatus"] == "RUNNING"
    sdk.terminate_pod(created["id"])
    assert sdk.get_pod(created["id"]) is None and sdk.get_pods() == []
    assert fake.pod(created["id"]).status == "TERMINATED"


def test_no_capacity_answers_runpods_own_words(fake, sdk):
    fake.set_capacity(A6000, 1)
    pod = sdk.create_pod("a", "img", A6000)
    with pytest.raises(sdk.error.QueryError, match="^" + NO_CAPACITY_MESSAGE.replace(".", r"\.") + "$"):
        sdk.create_pod("b", "img", A6000)
    sdk.terminate_pod(pod["id"])  # the GPU comes back
    sdk.create_pod("c", "img", A6000)


def test_the_api_key_is_checked_in_the_header_or_the_query_string(fake, sdk):
    r = post(fake, "{ myself { id } }", key="wrong")
    assert r.status_code == 401 and r.json()["errors"][0]["message"] == "Unauthorized"
    r = httpx.post(f"{fake.base_url}/graphql?api_key={fake.api_key}", json={"query": "{ myself { id } }"})
    assert r.json() == {"data": {"myself": {"id": "fake-user"}}}
    sdk.api_key = "wrong"
    with pytest.raises(sdk.error.AuthenticationError):
        sdk.get_gpus()


def test_bad_graphql_is_a_400_with_errors(fake):
    r = post(fake, "{ myself { nope } }")
    assert r.status_code == 400 and "nope" in r.json()["errors"][0]["message"]


def test_fail_next_fails_exactly_that_many_calls(fake):
    fake.fail_next(2, status=500)
    fake.fail_next(1, status=429)
    codes = [post(fake, "{ myself { id } }") for _ in range(4)]
    assert [r.status_code for r in codes] == [500, 500, 429, 200]
    assert codes[2].headers["Retry-After"] == "1"


def test_billing_is_rate_times_seconds_from_creation_to_termination(fake, sdk, clock):
    a = sdk.create_pod("a", "img", A6000, gpu_count=2)["id"]
    clock.t += 90
    b = sdk.create_pod("b", "img", "NVIDIA GeForce RTX 4090")["id"]
    clock.t += 30
    assert fake.billed_seconds(a) == 120 and fake.billed_seconds(b) == 30
    sdk.stop_pod(a)  # stopped: nothing billed (RunPod would bill storage; the fake does not model it)
    clock.t += 1000
    sdk.resume_pod(a, 2)
    clock.t += 10
    sdk.terminate_pod(a)
    clock.t += 3600  # terminated: nothing more
    assert fake.billed_seconds(a) == 130 and fake.pod(a).rate_hr == 0.79 * 2
    assert fake.billed_usd(a) == pytest.approx(1.58 / 3600 * 130, abs=1e-12)
    assert fake.billed_seconds(b) == 30 + 1000 + 10 + 3600  # b ran throughout
    assert fake.total_billed_usd() == pytest.approx(1.58 / 3600 * 130 + 0.69 / 3600 * 4640, abs=1e-12)
    assert round(fake.total_billed_usd(), 2) == 0.95


def test_launch_gets_the_pods_env_after_the_boot_delay(clock):
    launched: list[dict[str, str]] = []
    with FakeRunPod(now=clock, launch=lambda env: launched.append(env), boot_delay_s=0.3) as fake:
        r = post(
            fake,
            'mutation { podFindAndDeployOnDemand(input: {name: "w", imageName: "i", gpuTypeId: '
            '"NVIDIA RTX A6000", env: [{key: "CODERAI_NODE", value: "n1"}]}) { id runtime { uptimeInSeconds } } }',
        )
        pod = r.json()["data"]["podFindAndDeployOnDemand"]
        assert pod["runtime"] is None and launched == []  # still booting: RunPod shows no runtime yet
        started = time.monotonic()
        fake.wait_booted(pod["id"])
        assert time.monotonic() - started > 0.2
        assert launched == [{"RUNPOD_POD_ID": pod["id"], "RUNPOD_GPU_COUNT": "1", "CODERAI_NODE": "n1"}]
        clock.t += 7
        r = post(fake, f'{{ pod(input: {{podId: "{pod["id"]}"}}) {{ runtime {{ uptimeInSeconds }} }} }}')
        assert r.json()["data"]["pod"]["runtime"] == {"uptimeInSeconds": 7}


def test_never_boot_pods_get_no_process(clock):
    launched: list[str] = []
    with FakeRunPod(now=clock, launch=lambda env: launched.append(env["RUNPOD_POD_ID"])) as fake:
        fake.never_boot(prefix="stuck-")
        fake.never_boot(count=1)
        ids = [create(fake, n) for n in ("stuck-1", "next-1", "ok-1")]
        fake.wait_booted(ids[2])
        assert launched == [ids[2]]
        assert fake.pod(ids[0]).booted_at is None and fake.pod(ids[1]).booted_at is None
        assert all(fake.pod(i).status == "RUNNING" for i in ids)  # RunPod still says RUNNING: it just never comes up


def test_a_launch_that_fails_leaves_its_pod_exited_and_others_booting(clock):
    def launch(env):
        if env["CODERAI_FAIL"] == "1":
            raise OSError("image pull failed")

    with FakeRunPod(now=clock, launch=launch) as fake:
        bad, good = (create(fake, n, {"CODERAI_FAIL": f}) for n, f in (("bad", "1"), ("good", "0")))
        fake.wait_booted(good)
        wait_until(lambda: fake.pod(bad).status == "EXITED", 10, "the failing pod to exit")


def test_custom_gpu_types_and_stock_status(clock):
    with FakeRunPod(now=clock, gpu_types=[FakeGpuType("T", "Tiny", 8, 0.1, 0.05, capacity=2)]) as fake:
        q = "{ gpuTypes { id lowestPrice(input: {gpuCount: 1}) { stockStatus } } }"
        assert post(fake, q).json()["data"]["gpuTypes"] == [{"id": "T", "lowestPrice": {"stockStatus": "Low"}}]
        fake.set_capacity("T", 0)
        assert post(fake, q).json()["data"]["gpuTypes"][0]["lowestPrice"]["stockStatus"] is None


@pytest.mark.slow
def test_a_pods_process_runs_until_terminated(clock):
    with FakeRunPod(now=clock, launch=SLEEPER, boot_delay_s=0.1) as fake:
        pod_id = create(fake, "p")
        proc = fake.wait_booted(pod_id).process
        assert proc is not None and proc.poll() is None
        terminate(fake, pod_id)
        assert proc.poll() is not None
        with pytest.raises(ProcessLookupError):
            os.killpg(proc.pid, 0)


def runtime(fake: FakeRunPod, pod_id: str) -> dict:
    q = f'{{ pod(input: {{podId: "{pod_id}"}}) {{ desiredStatus podType runtime {{ uptimeInSeconds }} }} }}'
    return post(fake, q).json()["data"]["pod"]


@pytest.mark.slow
def test_crash_and_a_dying_process_lose_the_runtime_stay_desired_running_and_keep_billing(clock):
    with FakeRunPod(now=clock, launch=SLEEPER) as fake:
        pod_id = create(fake, "p")
        proc = fake.wait_booted(pod_id).process
        fake.crash(pod_id)
        assert proc.poll() is not None and runtime(fake, pod_id) == {
            "desiredStatus": "RUNNING",
            "podType": "RESERVED",
            "runtime": None,
        }  # nobody stopped it
        clock.t += 5
        assert fake.billed_seconds(pod_id) == 5
    with FakeRunPod(now=clock, launch=python_launcher(["-c", "pass"])) as fake:
        pod_id = create(fake, "q")
        fake.wait_booted(pod_id)
        wait_until(lambda: runtime(fake, pod_id)["runtime"] is None, 10, "the pod's process to exit")


@pytest.mark.slow
def test_a_preempted_spot_pod_is_stopped_after_sigterm_and_billed_until_then(clock, tmp_path):
    ready, got = tmp_path / "ready", tmp_path / "got-sigterm"
    trap = python_launcher(
        [
            "-c",
            f"import pathlib, signal; signal.signal(signal.SIGTERM, lambda *_: "
            f"pathlib.Path({str(got)!r}).touch()); pathlib.Path({str(ready)!r}).touch(); "
            "signal.pause(); signal.pause()",
        ]
    )
    with FakeRunPod(now=clock, launch=trap) as fake:
        q = (
            'mutation { podRentInterruptable(input: {bidPerGpu: 0.39, name: "s", imageName: "i", '
            'gpuTypeId: "NVIDIA RTX A6000"}) { id costPerHr podType } }'
        )
        pod = post(fake, q).json()["data"]["podRentInterruptable"]
        assert (pod["costPerHr"], pod["podType"]) == (0.39, "INTERRUPTABLE")
        proc = fake.wait_booted(pod["id"]).process
        wait_until(ready.exists, 10, "the pod's process to trap SIGTERM")
        clock.t += 60
        fake.preempt(pod["id"], warning_s=0.5)
        assert got.exists() and proc.poll() == -9  # warned with SIGTERM, then killed
        clock.t += 600
        assert runtime(fake, pod["id"]) == {"desiredStatus": "EXITED", "podType": "INTERRUPTABLE", "runtime": None}
        assert fake.billed_seconds(pod["id"]) == 60  # stopped: its GPU is no longer billed
        with pytest.raises(ValueError, match="on demand"):
            fake.preempt(create(fake, "on-demand"))


def test_an_outage_fails_every_call_until_it_is_lifted(fake):
    fake.outage(503)
    assert [post(fake, "{ myself { id } }").status_code for _ in range(3)] == [503] * 3
    fake.outage(None)
    assert post(fake, "{ myself { id } }").status_code == 200


@pytest.mark.slow
def test_close_leaves_no_process_behind(clock):
    fake = FakeRunPod(now=clock, launch=SLEEPER).start()
    ids = [create(fake, f"p{i}") for i in range(2)]
    procs = [fake.wait_booted(i).process for i in ids]
    fake.close()
    assert all(p.poll() is not None for p in procs)
    assert all(fake.pod(i).status == "TERMINATED" for i in ids)
