"""Escalation to RunPod serverless endpoints: a model whose pod policy names `serverless_endpoint` escalates to that
endpoint instead of a rented pod.

The broker checks the endpoint's `/health`, checks that one request's price fits under the model's caps, and starts
a relay: an engine worker on this machine (a child of the broker, dying with it) holding the model as a `remote`
engine pointed at the broker's loopback proxy (`serverless_proxy.py`), which adds the RunPod key and forwards to
the endpoint's OpenAI route. The relay joins the bus like a pod (a NATS user of its own, made by the head for it
and ended with it) under a record in `coderai_pods` with `serverless` set, so the scheduler, the router and the
reconcile loop treat it as one: ready on its heartbeat, reaped after the policy's `idle_timeout_s`.

Money (https://docs.runpod.io/serverless/pricing: flex workers bill by the second, partial seconds rounded up): each
request reserves `serverless_usd_per_request + serverless_usd_per_s x serverless_max_s` under the same caps as a
pod (its worker rate, `usd_per_s x 3600`, counts against the hourly caps while it runs), and books
`serverless_usd_per_request + serverless_usd_per_s x its seconds, rounded up` to the ledger, one entry per request
(its wall time at the proxy: cold start and queue included, so never less than RunPod's execution time for it). When
the next request would not fit, the relay ends at once, so later requests escalate again and get the same
`over_budget` refusal a pod gets. The RunPod key stays in the broker: the relay holds only its own proxy token.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import math
import os
import secrets
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec

from coderai.contracts import BusError, ModelConfig
from coderai.contracts.admin import PodUserRequest, RevokeRequest
from coderai.contracts.models import PodPolicy
from coderai.contracts.pods import PodInfo
from coderai.contracts.subjects import CMD_SCHEDULER_POD_USER, CMD_SCHEDULER_REVOKE
from coderai.pod_broker import choosing
from coderai.pod_broker.serverless_proxy import Proxy, Route
from coderai.runtime.cluster import with_user
from coderai.runtime.embedded import die_with_parent
from coderai.runtime.tls import ca_text

if TYPE_CHECKING:
    from coderai.pod_broker.service import Broker

log = logging.getLogger("coderai.pod_broker.serverless")

SECRET = "runpod-relay"  # the file in the relay's secrets dir holding its proxy token
MAX_ANSWER_MB = 16  # the relay's remote engine cuts an answer past this; the proxy past it and 1 MB more
LIVE = ("creating", "booting", "ready")
# what the relay worker inherits of the broker's environment: nothing that may hold a secret
INHERITED = ("PATH", "HOME", "LANG", "LC_ALL", "TMPDIR", "PYTHONPATH", "VIRTUAL_ENV", "CODERAI_LOG_LEVEL")


@dataclass(frozen=True)
class Ticket:
    """One request's reservation."""

    rid: str
    model: ModelConfig


def price(policy: PodPolicy, seconds: float) -> float:
    """What a request of `seconds` costs: its worker seconds rounded up (at most `serverless_max_s`'s), plus the
    price per request."""
    secs = min(math.ceil(max(0.0, seconds)), math.ceil(policy.serverless_max_s))
    return policy.serverless_usd_per_request + policy.serverless_usd_per_s * secs


def rate_hr(policy: PodPolicy) -> float:
    return round(policy.serverless_usd_per_s * 3600, 6)


def relay_config(m: ModelConfig, url: str) -> ModelConfig:
    """`m` as its relay node holds it: a `remote` engine reaching the proxy at `url` with the token in SECRET."""
    p = m.pod
    return msgspec.structs.replace(
        m,
        engine="remote",
        path="-",
        store_path="",
        store_file="",
        source="",
        params={
            "service_url": url,
            "served_model": p.serverless_model or m.name,
            "api_key_secret": SECRET,
            "timeout_s": p.serverless_max_s + 30,
            "max_answer_mb": MAX_ANSWER_MB,
        },
        ops=[op for op in m.serves() if op in ("chat", "complete")],
        nodes=[],
        pin="",
        rpc_nodes=[],
        shards=None,
        devices=[],
        pod=PodPolicy(),
    )


class Serverless:
    """The broker's serverless relays and their money."""

    def __init__(self, broker: Broker) -> None:
        self.b = broker
        self.proxy: Proxy | None = None
        self.procs: dict[str, asyncio.subprocess.Process] = {}
        self.inflight: dict[str, int] = {}  # relay name -> its requests reserved and not yet settled
        self._tasks: set[asyncio.Task] = set()
        self._seq = itertools.count()

    async def start(self, stack: contextlib.AsyncExitStack) -> None:
        s = self.b.settings
        if s.runpod_api_key:
            self.proxy = Proxy(s.runpod_serverless_base, s.runpod_api_key, self)
            await self.proxy.start()
            stack.push_async_callback(self.close)
        # a relay is a child of the broker: those of a broker before this one died with it
        for p in list(self.b.pods.values()):
            if p.serverless and p.state in LIVE:
                await self.end(p, "terminated", "its broker restarted")

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        for name in list(self.procs):
            await self._stop(name)
        if self.proxy is not None:
            await self.proxy.close()

    def _why_off(self) -> str:
        b, s = self.b, self.b.settings
        return "; ".join(
            w
            for w, ok in (
                ("no RunPod API key (CODERAI_POD_BROKER_RUNPOD_API_KEY)", self.proxy is not None),
                ("no Redis for the ledger (CODERAI_POD_BROKER_REDIS_URL)", b.money is not None),
                ("no global hourly cap (CODERAI_POD_BROKER_MAX_HOURLY_USD)", s.max_hourly_usd > 0),
            )
            if not ok
        )

    # --- relays -------------------------------------------------------------------------------------------

    async def create(self, m: ModelConfig) -> PodInfo:
        """A relay for `m` to its endpoint, after its `/health` and a check that one request fits the caps."""
        why = self._why_off()
        if why or self.proxy is None:
            raise BusError("no_engine", f"cannot use RunPod serverless for {m.name!r}: {why}")
        s, p = self.b.settings, m.pod
        await self.proxy.health(p.serverless_endpoint)
        await self._fits(m)
        name = choosing.pod_name(s.deployment, m.name)
        token = secrets.token_urlsafe(32)
        route = Route(
            name=name,
            model=m.name,
            token=token,
            endpoint=p.serverless_endpoint,
            served_model=p.serverless_model or m.name,
            max_s=p.serverless_max_s,
            max_bytes=(MAX_ANSWER_MB + 1) << 20,
        )
        cfg = relay_config(m, f"{self.proxy.url}/{name}")
        user = await self.b.bus.request(
            CMD_SCHEDULER_POD_USER,
            PodUserRequest(pod_id=name, ttl_s=s.pod_credentials_ttl_s, models=[cfg]),
            timeout=10.0,
        )
        info = await self.b._save(
            PodInfo(
                name=name,
                model=m.name,
                state="booting",
                pod_id=f"serverless:{p.serverless_endpoint}",
                gpu_type="serverless",
                hourly_usd=rate_hr(p),
                created_at=time.time(),
                serverless=p.serverless_endpoint,
            )
        )
        self.proxy.routes[name] = route
        try:
            self.procs[name] = await self._launch(name, cfg, token, user.user, user.password)
        except OSError as exc:
            await self.end(info, "failed", f"its relay could not start ({exc.strerror})")
            raise BusError("no_engine", f"the serverless relay for {m.name!r} could not start", True) from None
        log.info("relaying %s to RunPod serverless endpoint %s as %s", m.name, p.serverless_endpoint, name)
        await self.b._event("created", info)
        return info

    def _dir(self, name: str) -> Path:
        return Path(os.path.expanduser(self.b.settings.data_dir)) / "serverless" / name

    async def _launch(
        self, name: str, cfg: ModelConfig, token: str, user: str, password: str
    ) -> asyncio.subprocess.Process:
        s = self.b.settings
        home = self._dir(name)
        (home / "secrets").mkdir(parents=True, exist_ok=True, mode=0o700)
        secret = home / "secrets" / SECRET
        fd = os.open(secret, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as fh:
            fh.write(token)
        env = {k: v for k in INHERITED if (v := os.environ.get(k)) is not None} | {
            "CODERAI_NATS_URL": with_user(s.nats_url or "nats://127.0.0.1:4222", user, password),
            "CODERAI_NODE_ID": name,
            "CODERAI_WORKER_POD": name,
            "CODERAI_WORKER_MODELS_JSON": json.dumps([msgspec.to_builtins(cfg)]),
            "CODERAI_WORKER_MDNS": "false",
            "CODERAI_WORKER_FAMILIES": "remote",
            "CODERAI_DATA_DIR": str(home),
            "CODERAI_LOG_FORMAT": "json",
        }
        if ca := ca_text(s.nats_ca):
            env["CODERAI_NATS_CA"] = ca
        with open(home / "worker.log", "ab") as out:
            return await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                "coderai.engine_worker",
                env=env,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=out,
                stderr=out,
                start_new_session=True,
                preexec_fn=die_with_parent(),
            )

    async def _stop(self, name: str) -> None:
        proc = self.procs.pop(name, None)
        if proc is None or proc.returncode is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            proc.terminate()
        try:
            await asyncio.wait_for(proc.wait(), 10.0)
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()

    async def end(self, p: PodInfo, state: str, reason: str) -> PodInfo:
        """End the relay: its record first (the router stops routing to it at once), then, once the requests it
        relays now are answered, its worker, its NATS user and its files. No pod to terminate, nothing left to bill:
        its requests were booked one by one."""
        p = await self.b._save(
            msgspec.structs.replace(p, state=state, ended_at=time.time(), error="" if state == "terminated" else reason)
        )
        log.info("serverless relay %s %s (%s): $%.6f in requests", p.name, state, reason, p.cost_usd)
        await self.b._event("stopped", p, reason=reason)
        task = asyncio.create_task(self._teardown(p.name))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return p

    async def _teardown(self, name: str) -> None:
        route = self.proxy.routes.get(name) if self.proxy is not None else None
        deadline = time.monotonic() + (route.max_s + 30 if route is not None else 0)
        while self.inflight.get(name, 0) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if self.proxy is not None:
            self.proxy.routes.pop(name, None)
        self.inflight.pop(name, None)
        await self._stop(name)
        with contextlib.suppress(BusError):  # its credentials end with it (else with their ttl)
            await self.b.bus.request(CMD_SCHEDULER_REVOKE, RevokeRequest(node_id=name, forget=True), timeout=5.0)
        shutil.rmtree(self._dir(name) / "secrets", ignore_errors=True)  # its worker.log stays, for the operator

    # --- money (the proxy's Meter) ------------------------------------------------------------------------

    def _amount(self, m: ModelConfig) -> float:
        return price(m.pod, m.pod.serverless_max_s)

    async def _fits(self, m: ModelConfig) -> None:
        """BusError `over_budget` unless one more request's reservation fits the caps now (reserved, then
        released)."""
        from coderai.accounts.pod_money import OverBudget

        probe = f"probe-{secrets.token_hex(6)}"
        try:
            await self.b.money.reserve(m.name, probe, rate_hr(m.pod), self._amount(m), self.b._caps(m), time.time())
        except OverBudget as exc:
            raise BusError("over_budget", str(exc)) from None
        await self.b.money.release(probe)

    async def reserve(self, route: Route) -> Ticket:
        from coderai.accounts.pod_money import OverBudget

        m = self.b._model(route.model)
        rid = f"{route.name}-r{next(self._seq)}-{secrets.token_hex(3)}"
        try:
            await self.b.money.reserve(m.name, rid, rate_hr(m.pod), self._amount(m), self.b._caps(m), time.time())
        except OverBudget as exc:
            await self._spent(route, str(exc))
            raise BusError("over_budget", str(exc)) from None
        self.inflight[route.name] = self.inflight.get(route.name, 0) + 1
        return Ticket(rid, m)

    async def settle(self, route: Route, ticket: Ticket, start: float, end: float, sent: bool) -> None:
        try:
            await self._settle(route, ticket, start, end, sent)
        finally:
            self.inflight[route.name] = max(0, self.inflight.get(route.name, 0) - 1)

    async def _settle(self, route: Route, ticket: Ticket, start: float, end: float, sent: bool) -> None:
        m, money = ticket.model, self.b.money
        if not sent:
            await money.release(ticket.rid)
            return
        usd = price(m.pod, end - start)
        entry = await money.book(
            ticket.rid, m.name, f"serverless:{route.endpoint}", rate_hr(m.pod), start, end, time.time(), usd=usd
        )
        info = self.b.pods.get(route.name)
        if entry is None or info is None:
            return
        busy = max(info.last_busy_at, end) if info.state == "ready" else info.last_busy_at
        info = await self.b._save(
            msgspec.structs.replace(info, cost_usd=round(info.cost_usd + entry.usd, 6), last_busy_at=busy)
        )
        await self.b._event("billed", msgspec.structs.replace(info, pod_id=ticket.rid), seconds=end - start, usd=usd)
        try:
            await self._fits(m)
        except BusError as exc:
            await self._spent(route, exc.message)

    async def _spent(self, route: Route, why: str) -> None:
        """A cap refuses the next request: the relay ends now, so the next one escalates and is refused there."""
        info = self.b.pods.get(route.name)
        if info is not None and info.state in LIVE:
            log.info("serverless relay %s ends: %s", route.name, why)
            await self.end(info, "terminated", f"budget: {why}")
