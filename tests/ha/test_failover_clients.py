"""What clients see while a head fails: real SDK clients (openai chat, streamed chat and embeddings; anthropic
messages) busy on every surviving gateway of three heads, while the leading head is SIGKILLed whole, or only its
nats-server, or only the Redis master. Every HTTP answer is counted, the SDKs' own retries included: each is a
success, or a 429/503 with `Retry-After` that the SDK's retry turns into a success. Never a 404 for a model that
exists, never a 5xx other than 503, never an error the SDK hands to its caller (but a stream already cut after its
first token by the head that died under it). Clients are served normally again within 10 s.

Each fault runs several times (a race that load exposes shows up in one run of five), and once more with both CPUs
kept busy by `stress-ng`. Each run must recover within 30 s, and four runs of each fault's five within 10 s: that
last bound is the cluster's own, so it is judged on the runs during which nothing outside this test run took over
a quarter of the machine (`coderai.testing.cpu.OutsideLoad`: a fresh-machine run with `stress-ng` beside the suite, or
another build); runs on a shared machine are printed, not judged. The recovery times are printed (`-s`): they are
the figures in docs/reliability.md."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time

import httpx
import pytest

from coderai.heads import REDIS_PORT
from coderai.testing.cpu import OutsideLoad
from coderai.testing.ha import HEADS, Cluster, SdkLoad, three_heads
from coderai.testing.netns import NetnsUnavailable
from coderai.testing.procs import wait_until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

RECOVERY_S = 10.0
# A single run may take longer (a Sentinel vote nobody won is tried again 4 s later; on a busy machine a RAFT
# election does too): each run is bounded by LATE_S, and four of each fault's five by RECOVERY_S.
LATE_S = 30.0
ROUNDS = 5
RECOVERED: dict[str, list[float]] = {}  # fault -> each run's recovery, for the last test
SHARED: dict[str, list[float]] = {}  # the same, of runs during which others took over a quarter of the machine
SHARED_OVER = 0.25


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, tiny_gguf):
    pytest.importorskip("graphql")
    try:
        with three_heads(tmp_path_factory.mktemp("ha-clients"), tiny_gguf) as c:
            yield c
    except NetnsUnavailable as exc:
        pytest.skip(str(exc))


@pytest.fixture(scope="module")
def key(cluster: Cluster) -> str:
    def make() -> httpx.Response | None:  # a cluster just formed may still elect its buckets' leaders: a 503
        r = httpx.post(
            f"{cluster.base('h2')}/admin/keys",
            headers={"Authorization": f"Bearer {cluster.admin}"},
            timeout=30,
            json={"name": "clients"},
        )
        assert r.status_code in (201, 503) and (r.status_code == 201 or r.headers.get("retry-after")), r.text
        return r if r.status_code == 201 else None

    return wait_until(make, 60, "the clients' key made").json()["key"]


@pytest.fixture
def whole(cluster: Cluster, key: str):
    """Every head, worker and gateway up before the test and after it, whatever it did."""
    cluster.restore(key)
    yield cluster
    cluster.restore(key)


def _target(c: Cluster, fault: str) -> str:
    """The head `fault` hits: the leading one, or the one with the Redis master."""
    return c.redis_master() if fault == "redis" else c.leader()


def _kill(c: Cluster, fault: str, head: str) -> str:
    """Break `head` as `fault` says; what was killed."""
    if fault == "head":
        assert c.lab.kill_all(head) >= 8  # nats-server, Redis, its sentinel, the services, granian's worker
        return "the whole head"
    needle = "nats-server" if fault == "nats" else f":{REDIS_PORT}"
    pid = c.pid_of(head, needle)
    assert pid, f"no {needle} on {head}"
    # its `coderai up` starts it again: the head's services reconnect meanwhile (NATS), the sentinels promote a
    # replica and the restarted server becomes one (Redis)
    os.kill(pid, signal.SIGKILL)
    return "its nats-server" if fault == "nats" else "the Redis master"


def _judge(load: SdkLoad, fault: str, head: str, at: float) -> float:
    """Assert what the clients saw; the recovery time: from the fault to the last answer that was not a success,
    or to the end of the last call started after the fault that was slow without being refused (a call the SDK
    retried after a 503 waits out the `Retry-After` it was given: that wait is the SDK's, not the cluster's)."""
    # a dead head's own clients lose what was in flight there, and are refused until the balancer takes it out
    gone = head if fault == "head" else None
    bad = [
        a
        for a in load.answers
        if a.head != gone and not (a.status == 200 or (a.status in (429, 503) and a.retry_after))
    ]
    assert not bad, f"answers other than a success or a 429/503 with Retry-After: {bad[:8]}"
    failed = [
        c
        for c in load.calls
        if not c.ok
        and c.head != gone
        and not (c.kind == "stream" and c.first_token is not None and c.start <= at <= c.end)
    ]
    assert not failed, f"calls whose SDK raised: {failed[:8]}"
    assert load.ok(since=at + RECOVERY_S) >= 8, "too few calls answered after the failover to judge it"
    refused = [a.at for a in load.answers if a.head != gone and a.status != 200 and a.at >= at]
    slow = [
        c.end
        for c in load.calls
        if c.start >= at and c.ok and not c.refused and c.head != gone and c.end - c.start > _slow_s(load, at)
    ]
    return max([at, *refused, *slow]) - at


def _slow_s(load: SdkLoad, at: float) -> float:
    """A call slower than this waited on the failover: 2 s, or 2.5 times the 90th percentile of the calls answered
    before the fault on a machine so busy that ordinary calls take that long."""
    before = sorted(c.end - c.start for c in load.calls if c.ok and c.end < at)
    return max(2.0, 2.5 * before[int(len(before) * 0.9)]) if before else 2.0


def _round(c: Cluster, key: str, fault: str) -> float:
    with SdkLoad(c, key) as load:
        wait_until(
            lambda: load.hopeless() or all(load.ok(head=h) >= 4 for h in HEADS),
            120,
            "every gateway answering the clients",
        )
        head = _target(c, fault)
        at = time.monotonic()
        what = _kill(c, fault, head)
        if fault == "head":
            load.avoid.add(head)  # as a load balancer would, once its health check fails
        wait_until(lambda: load.ok(since=at + RECOVERY_S) >= 8, 120, "calls answered after the failover")
    recovery = _judge(load, fault, head, at)
    retries = sum(1 for a in load.answers if a.status != 200)
    print(
        f"\n{fault}: killed {what} ({head}); {len(load.calls)} calls, {retries} answered 429/503 and retried by "
        f"the SDK, none failed; served normally again {recovery:.1f} s after the kill"
    )
    for a in sorted((a for a in load.answers if a.status != 200), key=lambda a: a.at):
        print(f"  +{a.at - at:5.1f} s {a.head} {a.kind} {a.status} {a.said}")
    for c in sorted(
        (c for c in load.calls if c.start >= at and c.end - c.start > _slow_s(load, at)), key=lambda c: c.start
    ):
        print(
            f"  slow: started +{c.start - at:4.1f} s, {c.end - c.start:4.1f} s, {c.head} {c.kind}, "
            f"{c.refused} refused first"
        )
    assert recovery <= LATE_S, f"clients were served normally again only {recovery:.1f} s after the kill"
    return recovery


@pytest.mark.parametrize("fault", ["head", "nats", "redis"])
@pytest.mark.parametrize("run", range(1, ROUNDS + 1))
def test_clients_see_only_successes_or_retried_503s_while_a_head_fails(whole, key, fault, run):
    with OutsideLoad() as outside:
        recovery = _round(whole, key, fault)
    print(f"  (outside this test run, the machine was {outside.share:.0%} busy)")
    (SHARED if outside.share > SHARED_OVER else RECOVERED).setdefault(fault, []).append(recovery)


@pytest.mark.parametrize("fault", ["head", "nats", "redis"])
def test_the_same_with_both_cpus_kept_busy(whole, key, fault):
    stress = shutil.which("stress-ng")
    if stress is None:
        pytest.skip("no stress-ng (scripts/setup installs it with the dev extra)")
    busy = subprocess.Popen(
        [stress, "--cpu", "2", "--quiet"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )
    try:  # what clients see is judged as strictly; how long the failover takes is printed
        _round(whole, key, fault)
    finally:
        os.killpg(busy.pid, signal.SIGKILL)
        busy.wait()


def test_clients_are_served_normally_again_within_10_s_in_four_runs_of_five():
    """What the runs above measured (this module's tests run in order): each fault's recovery, its runs sorted."""
    for fault, times in SHARED.items():
        print(f"{fault}: recovered in {sorted(times)} s on a machine others kept over a quarter busy (not judged)")
    if not RECOVERED:
        pytest.skip("no run above had the machine to itself" if SHARED else "the runs above did not run")
    for fault, times in RECOVERED.items():
        late = [t for t in times if t > RECOVERY_S]
        assert len(late) <= max(1, len(times) // 5), f"{fault}: recovered in {sorted(times)} s"
