"""An async client for RunPod's GraphQL API, as the pod-broker uses it.

It sends the same operations as the `runpod` SDK (gpuTypes, pod, myself.pods, podFindAndDeployOnDemand,
podRentInterruptable, podStop, podResume, podTerminate) but with GraphQL *variables*. The SDK (1.12) builds its
queries by string formatting without escaping, so an env value, pod name or credential holding a double quote
breaks the request and a backslash is silently reinterpreted (`\\n` arrives as a newline); the pod-broker puts
the cluster token and NATS credentials into pod env, so it cannot use those mutations. Nor does it need the SDK's
dependencies (fastapi[all]) or its 1.5 s import.

Errors are `RunPodError(message, retryable)`; `NoCapacity` is recognized from RunPod's error text. HTTP 429, 5xx,
timeouts and connection failures are retryable, and `with_retry` retries them with exponential backoff and
jitter. A create is different: once the request may have reached RunPod (a read timeout, a 5xx, a dropped
connection) the pod may exist and be billing, so `create_pod` never retries past that point and raises
`CreateUncertain` instead. The caller then looks for the pod with `find_by_name(name)` (use unique names) and
either adopts it or creates again.

A call that still fails retryably after its retries means RunPod's API is down for us: the client keeps that as
`outage` (since when, the last failure, the first error), logged once when it starts and once when RunPod answers
again, so its user can stop asking and say why (the broker refuses to rent at once while it lasts).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import random
import time
from dataclasses import dataclass
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import httpx

DEFAULT_BASE_URL = "https://api.runpod.io"
log = logging.getLogger("coderai.pod_broker.runpod")
T = TypeVar("T")
Sleep = Callable[[float], Awaitable[None]]

_NO_CAPACITY_MARKERS = ("no longer any instances available", "not enough free gpus")
_POD_FIELDS = """fragment PodFields on Pod { id name desiredStatus imageName env machineId costPerHr gpuCount podType
  runtime { uptimeInSeconds } machine { podHostId gpuDisplayName gpuTypeId } }"""
_Q_GPU_TYPES = """query GpuTypes($filter: GpuTypeFilter, $price: GpuLowestPriceInput) { gpuTypes(input: $filter) {
  id displayName memoryInGb lowestPrice(input: $price) { minimumBidPrice uninterruptablePrice stockStatus } } }"""
_Q_POD = "query Pod($podId: String!) { pod(input: {podId: $podId}) { ...PodFields } }\n" + _POD_FIELDS
_Q_PODS = "query Pods { myself { pods { ...PodFields } } }\n" + _POD_FIELDS
_M_ON_DEMAND = (
    "mutation Deploy($input: PodFindAndDeployOnDemandInput!) { podFindAndDeployOnDemand(input: $input) "
    "{ ...PodFields } }\n" + _POD_FIELDS
)
_M_SPOT = (
    "mutation Rent($input: PodRentInterruptableInput!) { podRentInterruptable(input: $input) "
    "{ ...PodFields } }\n" + _POD_FIELDS
)
_M_STOP = "mutation Stop($podId: String!) { podStop(input: {podId: $podId}) { ...PodFields } }\n" + _POD_FIELDS
_M_RESUME = (
    "mutation Resume($podId: String!, $gpuCount: Int!) { podResume(input: {podId: $podId, gpuCount: "
    "$gpuCount}) { ...PodFields } }\n" + _POD_FIELDS
)
_M_TERMINATE = "mutation Terminate($podId: String!) { podTerminate(input: {podId: $podId}) }"


class RunPodError(Exception):
    """A failed RunPod call. `retryable`: the same call may succeed soon; `maybe_applied`: the request may have
    taken effect before it failed (the reply was lost), so repeating a mutation could do it twice."""

    def __init__(
        self,
        message: str,
        *,
        retryable: bool = False,
        maybe_applied: bool = False,
        status: int | None = None,
        retry_after_s: float | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.retryable = retryable
        self.maybe_applied = maybe_applied
        self.status = status
        self.retry_after_s = retry_after_s


class AuthError(RunPodError):
    """The API key was refused."""


class NoCapacity(RunPodError):
    """RunPod has no machine for this GPU type and count now: try another type, or later (not retried here)."""


class CreateUncertain(RunPodError):
    """A create request may have reached RunPod before it failed: the pod may exist. Look for it with
    `RunPodClient.find_by_name(name)` before creating again."""

    def __init__(self, message: str, *, name: str) -> None:
        super().__init__(message, retryable=False, maybe_applied=True)
        self.name = name


@dataclass(frozen=True, kw_only=True)
class Outage:
    """RunPod's API failing every call (unreachable, timing out, 5xx, rate limiting) after its retries: `since` the
    first such call, `last` the latest, `error` the first one's message."""

    since: float
    last: float
    error: str


@dataclass(frozen=True, kw_only=True)
class GpuType:
    """A card type on offer. Prices are per GPU-hour (None when RunPod offers none now); `available` comes from
    RunPod's stock status (None when it does not say)."""

    id: str
    name: str
    memory_gb: int
    price_hr: float | None
    spot_price_hr: float | None
    available: bool | None


@dataclass(frozen=True, kw_only=True)
class PodRecord:
    """A pod as RunPod reports it. `cost_per_hr` is for the whole pod (price x GPU count); `uptime_s` is None
    until its container runs."""

    id: str
    name: str
    status: str
    image: str
    gpu_type_id: str | None
    gpu_name: str | None
    gpu_count: int
    cost_per_hr: float
    spot: bool
    env: dict[str, str]
    uptime_s: int | None
    machine_id: str | None

    @property
    def running(self) -> bool:
        """Desired RUNNING and its container is up."""
        return self.status == "RUNNING" and self.uptime_s is not None


def _pod(d: dict[str, Any]) -> PodRecord:
    machine = d.get("machine") or {}
    env: dict[str, str] = {}
    for item in d.get("env") or []:  # "KEY=value" (a bare "KEY": empty)
        key, _, value = item.partition("=")
        env[key] = value
    return PodRecord(
        id=d["id"],
        name=d.get("name") or "",
        status=d.get("desiredStatus") or "",
        image=d.get("imageName") or "",
        gpu_type_id=machine.get("gpuTypeId"),
        gpu_name=machine.get("gpuDisplayName"),
        gpu_count=d.get("gpuCount") or 0,
        cost_per_hr=float(d.get("costPerHr") or 0.0),
        spot=d.get("podType") == "INTERRUPTABLE",
        env=env,
        uptime_s=(d.get("runtime") or {}).get("uptimeInSeconds"),
        machine_id=d.get("machineId"),
    )


async def with_retry(
    call: Callable[[], Awaitable[T]],
    *,
    attempts: int = 4,
    base_delay_s: float = 0.5,
    max_delay_s: float = 8.0,
    sleep: Sleep = asyncio.sleep,
    rand: Callable[[], float] = random.random,
    retry_if: Callable[[RunPodError], bool] = lambda e: e.retryable,
) -> T:
    """Run `call`, retrying a `RunPodError` that `retry_if` accepts up to `attempts` tries in all. The n-th wait is
    uniform in [d/2, d] with d = min(max_delay_s, base_delay_s * 2**n), at least a 429's Retry-After (capped)."""
    for attempt in range(attempts):
        try:
            return await call()
        except RunPodError as exc:
            if attempt == attempts - 1 or not retry_if(exc):
                raise
            delay = min(max_delay_s, base_delay_s * 2**attempt)
            delay = delay / 2 + rand() * delay / 2
            if exc.retry_after_s is not None:
                delay = max(delay, min(exc.retry_after_s, max_delay_s))
            await sleep(delay)
    raise AssertionError("unreachable")


class RunPodClient:
    """RunPod's GraphQL API at `{base_url}/graphql`, authenticated by a Bearer API key."""

    def __init__(
        self,
        api_key: str,
        base_url: str = DEFAULT_BASE_URL,
        *,
        timeout_s: float = 30.0,
        attempts: int = 4,
        base_delay_s: float = 0.5,
        sleep: Sleep = asyncio.sleep,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self.url = base_url.rstrip("/") + "/graphql"
        self.attempts = attempts
        self.base_delay_s = base_delay_s
        self.sleep = sleep
        self.outage: Outage | None = None  # RunPod failing for us now; None while it answers
        self._http = httpx.AsyncClient(
            timeout=httpx.Timeout(timeout_s),
            transport=transport,
            headers={"Authorization": f"Bearer {api_key}", "User-Agent": "coderai-pod-broker"},
        )

    async def aclose(self) -> None:
        """Close the HTTP connections."""
        await self._http.aclose()

    async def __aenter__(self) -> RunPodClient:
        return self

    async def __aexit__(self, *_exc) -> None:
        await self.aclose()

    async def execute(self, query: str, variables: dict[str, Any] | None = None) -> dict[str, Any]:
        """One GraphQL call, no retries: its `data`, or a typed `RunPodError`."""
        try:
            r = await self._http.post(self.url, json={"query": query, "variables": variables or {}})
        except (httpx.ConnectError, httpx.ConnectTimeout) as exc:  # never reached RunPod
            raise RunPodError(f"cannot reach RunPod: {exc!r}", retryable=True) from exc
        except httpx.TransportError as exc:  # sent, reply lost: it may have been applied
            raise RunPodError(f"RunPod call failed: {exc!r}", retryable=True, maybe_applied=True) from exc
        try:
            body = r.json()
        except ValueError:
            body = {}
        errors = body.get("errors") if isinstance(body, dict) else None
        message = (errors[0].get("message") if errors else None) or f"HTTP {r.status_code}"
        if r.status_code in (401, 403):
            raise AuthError(message, status=r.status_code)
        if r.status_code == 429:
            raise RunPodError(message, retryable=True, status=429, retry_after_s=_retry_after(r))
        if r.status_code >= 500:
            raise RunPodError(message, retryable=True, maybe_applied=True, status=r.status_code)
        if errors:
            kind = NoCapacity if any(m in message.lower() for m in _NO_CAPACITY_MARKERS) else RunPodError
            raise kind(message, status=r.status_code)
        if r.status_code != 200 or not isinstance(body, dict) or not isinstance(body.get("data"), dict):
            raise RunPodError(f"unexpected reply: HTTP {r.status_code}", status=r.status_code)
        return body["data"]

    async def _call(self, query: str, variables: dict[str, Any] | None = None, **retry: Any) -> dict[str, Any]:
        try:
            data = await with_retry(
                lambda: self.execute(query, variables),
                attempts=self.attempts,
                base_delay_s=self.base_delay_s,
                sleep=self.sleep,
                **retry,
            )
        except RunPodError as exc:
            if exc.retryable:
                self._failing(exc)
            else:  # RunPod answered (a GraphQL error, a refused key): it is up
                self._answered()
            raise
        self._answered()
        return data

    def _failing(self, exc: RunPodError) -> None:
        now = time.time()
        if self.outage is None:
            log.warning("RunPod's API is failing: %s; said once, until it answers again", exc.message)
            self.outage = Outage(since=now, last=now, error=exc.message)
        else:
            self.outage = dataclasses.replace(self.outage, last=now)

    def _answered(self) -> None:
        if self.outage is not None:
            log.warning("RunPod's API answers again, after %.0f s of failures", time.time() - self.outage.since)
            self.outage = None

    async def gpu_types(self, gpu_count: int = 1, gpu_type_id: str | None = None) -> list[GpuType]:
        """Card types (or the one named) with their lowest on-demand and spot prices per GPU-hour, and whether
        `gpu_count` of them are in stock."""
        data = await self._call(
            _Q_GPU_TYPES, {"filter": {"id": gpu_type_id} if gpu_type_id else None, "price": {"gpuCount": gpu_count}}
        )
        out = []
        for g in data.get("gpuTypes") or []:
            low = g.get("lowestPrice")
            out.append(
                GpuType(
                    id=g["id"],
                    name=g.get("displayName") or g["id"],
                    memory_gb=g.get("memoryInGb") or 0,
                    price_hr=(low or {}).get("uninterruptablePrice"),
                    spot_price_hr=(low or {}).get("minimumBidPrice"),
                    available=None if low is None or "stockStatus" not in low else low["stockStatus"] is not None,
                )
            )
        return out

    async def create_pod(
        self,
        name: str,
        image: str,
        gpu_type_id: str,
        *,
        gpu_count: int = 1,
        env: dict[str, str] | None = None,
        spot: bool = False,
        bid_per_gpu: float | None = None,
        cloud_type: str = "ALL",
        volume_gb: int = 0,
        container_disk_gb: int = 20,
        volume_mount_path: str = "/workspace",
        ports: str = "",
        docker_args: str = "",
        min_vcpu_count: int = 1,
        min_memory_gb: int = 1,
        start_ssh: bool = False,
        support_public_ip: bool = True,
        network_volume_id: str = "",
    ) -> PodRecord:
        """Rent a pod: on-demand, or spot (`bid_per_gpu` defaults to the current minimum bid); with
        `network_volume_id`, that network volume mounted at `volume_mount_path` (the pod then runs in its data
        center). Retried only while RunPod surely did not act on it; raises `NoCapacity`, or `CreateUncertain` when
        the pod may exist."""
        if spot and bid_per_gpu is None:
            offers = [g for g in await self.gpu_types(gpu_count, gpu_type_id) if g.id == gpu_type_id]
            if not offers or offers[0].spot_price_hr is None:
                raise NoCapacity(f"no spot offer for {gpu_type_id}")
            bid_per_gpu = offers[0].spot_price_hr
        spec: dict[str, Any] = {
            "name": name,
            "imageName": image,
            "gpuTypeId": gpu_type_id,
            "gpuCount": gpu_count,
            "cloudType": cloud_type,
            "volumeInGb": volume_gb,
            "containerDiskInGb": container_disk_gb,
            "volumeMountPath": volume_mount_path,
            "ports": ports,
            "dockerArgs": docker_args,
            "minVcpuCount": min_vcpu_count,
            "minMemoryInGb": min_memory_gb,
            "startSsh": start_ssh,
            "supportPublicIp": support_public_ip,
            "env": [{"key": k, "value": v} for k, v in (env or {}).items()],
        }
        if spot:
            spec["bidPerGpu"] = bid_per_gpu
        if network_volume_id:
            spec["networkVolumeId"] = network_volume_id
        query, field = (_M_SPOT, "podRentInterruptable") if spot else (_M_ON_DEMAND, "podFindAndDeployOnDemand")
        try:
            data = await self._call(query, {"input": spec}, retry_if=lambda e: e.retryable and not e.maybe_applied)
        except RunPodError as exc:
            if exc.maybe_applied:
                raise CreateUncertain(f"creating pod {name!r} may have succeeded: {exc.message}", name=name) from exc
            raise
        if data.get(field) is None:
            raise RunPodError(f"RunPod returned no pod for {name!r}")
        return _pod(data[field])

    async def get_pod(self, pod_id: str) -> PodRecord | None:
        """The pod, or None when RunPod does not know it (never created, or terminated)."""
        data = await self._call(_Q_POD, {"podId": pod_id})
        return None if data.get("pod") is None else _pod(data["pod"])

    async def list_pods(self) -> list[PodRecord]:
        """Every pod of the account that is not terminated."""
        data = await self._call(_Q_PODS)
        return [_pod(p) for p in (data.get("myself") or {}).get("pods") or []]

    async def find_by_name(self, name: str) -> PodRecord | None:
        """The live pod named exactly `name`, or None: how a caller resolves `CreateUncertain`. RunPod does not
        force unique names, so give each pod a unique one; with duplicates the first listed is returned."""
        return next((p for p in await self.list_pods() if p.name == name), None)

    async def stop_pod(self, pod_id: str) -> PodRecord:
        """Stop a pod: its GPU is released and billing stops (RunPod still bills a volume's storage)."""
        return _pod((await self._call(_M_STOP, {"podId": pod_id}))["podStop"])

    async def resume_pod(self, pod_id: str, gpu_count: int) -> PodRecord:
        """Start a stopped pod again (`NoCapacity` when its machine has no free GPU now)."""
        return _pod((await self._call(_M_RESUME, {"podId": pod_id, "gpuCount": gpu_count}))["podResume"])

    async def terminate_pod(self, pod_id: str) -> None:
        """Terminate a pod: billing ends and it is gone. Idempotent: a pod RunPod no longer knows counts as
        terminated (a retry after a lost reply answers not-found)."""
        try:
            await self._call(_M_TERMINATE, {"podId": pod_id})
        except RunPodError as exc:
            if exc.retryable or isinstance(exc, AuthError) or await self.get_pod(pod_id) is not None:
                raise


def _retry_after(r: httpx.Response) -> float | None:
    try:
        return float(r.headers["Retry-After"])
    except (KeyError, ValueError):
        return None
