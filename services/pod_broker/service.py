"""Pod-broker: rents RunPod pods for models that escalate, watches them, reaps them, and books every second.

It owns `coderai_pods` (one `PodInfo` per pod, by name). `acquire` (from the scheduler) picks the cheapest GPU
type that fits under the caps, reserves the pod's first stretch of money in Redis (one Lua script checks every
cap), creates the pod with an environment that makes its worker join this bus as a node with just that model,
and waits for its heartbeat. A reconcile loop marks pods ready, extends their reservations as they run (a cap
that says no stops the pod), reaps idle and crashed ones, terminates pods that never boot, keeps warm floors,
and terminates orphans: pods named for this deployment that nothing tracks. A terminated pod is billed from
creation to termination into the ledger (`accounts/pod_money.py`), journalled first to `coderai_pod_ledger`: each
round first books back what Redis lacks of it (all of it, if Redis was emptied or replaced), and a running pod
whose reservation Redis lost is reserved again from its creation, under the same caps.

A spot pod RunPod takes back (it stops it: EXITED) is `preempted`, not crashed: booked to its last heartbeat, since
RunPod stopped billing it then, and replaced only as any ended pod is, by a warm floor or the next request. While
RunPod's API fails (the client's `outage`), renting is refused at once, so a request falls back to a busy engine or
gets its 503 without waiting out RunPod's retries; local serving never waits on RunPod.

A model whose policy names a RunPod serverless endpoint escalates to a relay to that endpoint instead of a pod, its
requests billed one by one (`serverless.py`).

Run one broker per cluster: the reconcile loop is not shared between replicas.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any, Literal

import msgspec
from nats.aio.msg import Msg

from coderai.contracts import BusError, ModelConfig, encode
from coderai.contracts.events import PodEvent
from coderai.contracts.nodes import Heartbeat
from coderai.contracts.pods import (
    AcquireReply,
    AcquireRequest,
    BrokerStatus,
    BrokerStatusRequest,
    LeaseReply,
    LeaseRequest,
    PodInfo,
)
from coderai.contracts.admin import PodUserRequest, RevokeRequest
from coderai.runtime.tls import ca_text
from coderai.contracts.subjects import (
    CMD_BROKER_ACQUIRE,
    CMD_BROKER_LEASE,
    CMD_BROKER_STATUS,
    CMD_SCHEDULER_POD_USER,
    CMD_SCHEDULER_REVOKE,
    EVT_POD,
    HEARTBEAT,
)
from coderai.contracts.topology import MODELS, NODE_TTL_S, PODS
from coderai.pod_broker import choosing
from coderai.pod_broker.heard import Heard
from coderai.pod_broker.pod_images import PodImages, check_trust_settings
from coderai.pod_broker.serverless import Serverless
from coderai.pod_broker.settings import BrokerSettings
from coderai.runtime.bus import Bus
from coderai.runtime.kv import read_all
from coderai.runtime.leader import Fence, singleton
from coderai.runtime.mirror import KVMirror

log = logging.getLogger("coderai.pod_broker")

LIVE = ("creating", "booting", "ready")
MB = 1024 * 1024
PodWhat = Literal["created", "ready", "billed", "stopped"]  # PodEvent.what
DOWN_RETRY_S = 30.0  # while RunPod's API fails, renting is refused at once; tried again this long after a failure


class Broker:
    def __init__(self, settings: BrokerSettings, api: Any = None, money: Any = None) -> None:
        self.settings = settings
        self.fence = Fence()  # the newest scheduler token seen on acquire requests
        self.api = api
        self.money = money
        self.pods: dict[str, PodInfo] = {}
        self.heard = Heard()  # what the pods' workers said (heard.py)
        self.leases: dict[str, tuple[int, float]] = {}
        self._unfilled: dict[str, str] = {}  # model -> why its warm floor could not be filled (said once)
        self.images = PodImages(settings)  # which image a pod runs, its signature checked (pod_images.py)
        self._locks: dict[str, asyncio.Lock] = {}
        self._last_orphan_scan = 0.0
        self.redis: Any = None
        self.serverless = Serverless(self)  # models whose policy names a serverless endpoint (serverless.py)

    async def start(self, stack: contextlib.AsyncExitStack, stop: asyncio.Event) -> None:
        s = self.settings
        self.bus = await Bus.connect_as(s, "pod-broker")
        stack.push_async_callback(self.bus.close)
        self.kv = await self.bus.kv(PODS)
        self.models = KVMirror(self.bus, MODELS, ModelConfig)
        await self.models.bind()
        self.models.start()
        stack.callback(self.models.stop)
        await self._load_pods()
        if self.money is None and s.redis_url:
            from coderai.accounts.pod_money import PodJournal, PodMoney
            from coderai.runtime import redis_client

            self.redis = redis_client.connect(s.redis_url)
            stack.push_async_callback(self.redis.aclose)
            self.money = PodMoney(self.redis, prefix=s.pod_ledger_prefix, journal=PodJournal(self.bus))
        if self.api is None and s.runpod_api_key:
            from coderai.pod_broker.runpod_api import RunPodClient

            self.api = RunPodClient(api_key=s.runpod_api_key, base_url=s.runpod_api_base)
            stack.push_async_callback(self.api.aclose)
        await self.serverless.start(stack)
        for subject, handler in (
            (CMD_BROKER_STATUS, self._status),
            (CMD_BROKER_ACQUIRE, self._acquire),
            (CMD_BROKER_LEASE, self._lease),
        ):
            sub = await self.bus.serve(subject, handler, queue="pod-broker")
            stack.push_async_callback(sub.unsubscribe)
        hb = await self.bus.listen(HEARTBEAT, self._on_heartbeat)
        stack.push_async_callback(hb.unsubscribe)
        if not self.configured:
            log.info("pods are off: %s", self._why_off())
        elif not s.pod_image_key:
            log.info("pod images are not checked for a signature (CODERAI_POD_BROKER_POD_IMAGE_KEY, docs/deploy.md)")
        task = asyncio.create_task(self._reconcile_loop())
        stack.callback(task.cancel)

    @property
    def configured(self) -> bool:
        s = self.settings
        return self.api is not None and self.money is not None and bool(s.pod_nats_url) and s.max_hourly_usd > 0

    def _why_off(self) -> str:
        s = self.settings
        return "; ".join(
            w
            for w, ok in (
                ("no RunPod API key (CODERAI_POD_BROKER_RUNPOD_API_KEY)", self.api is not None),
                ("no Redis for the ledger (CODERAI_POD_BROKER_REDIS_URL)", self.money is not None),
                ("no NATS URL for pods (CODERAI_POD_BROKER_POD_NATS_URL)", bool(s.pod_nats_url)),
                ("no global hourly cap (CODERAI_POD_BROKER_MAX_HOURLY_USD)", s.max_hourly_usd > 0),
            )
            if not ok
        )

    # --- state --------------------------------------------------------------------------------------

    async def _load_pods(self) -> None:
        """Pods tracked before a restart are tracked again (their money lives in Redis)."""
        for info in (await read_all(self.kv, PodInfo)).values():
            self.pods[info.name] = info

    async def _save(self, info: PodInfo) -> PodInfo:
        self.pods[info.name] = info
        await self.kv.put(info.name, encode(info))
        return info

    async def _event(self, what: PodWhat, p: PodInfo, **kw: Any) -> None:
        evt = PodEvent(
            what=what,
            name=p.name,
            model=p.model,
            pod_id=p.pod_id,
            gpu_type=p.gpu_type,
            hourly_usd=p.hourly_usd,
            ts=time.time(),
            **kw,
        )
        with contextlib.suppress(Exception):
            await self.bus.publish(EVT_POD, evt, what=what)

    def _model(self, name: str) -> ModelConfig:
        for m in self.models.values.values():
            if m.name == name:
                return m
        raise BusError("not_found", f"no model {name!r}")

    def _live(self, model: str) -> list[PodInfo]:
        return [p for p in self.pods.values() if p.model == model and p.state in LIVE]

    # --- commands -----------------------------------------------------------------------------------

    async def _status(self, _req: BrokerStatusRequest, _m: Msg) -> BrokerStatus:
        now = time.time()
        pods = [self._with_live_cost(p, now) for p in sorted(self.pods.values(), key=lambda p: p.created_at)]
        spent = await self.money.ledger_total_usd() if self.money is not None else 0.0
        return BrokerStatus(
            configured=self.configured,
            pods=pods,
            spent_usd=spent,
            why="" if self.configured else self._why_off(),
            outage=self._outage(),
        )

    def _outage(self) -> str:
        down = self.api.outage if self.api is not None else None
        if down is None:
            return ""
        since = time.strftime("%H:%M:%S UTC", time.gmtime(down.since))
        return f"RunPod's API has been failing since {since} ({down.error}); no pod is rented until it answers"

    @staticmethod
    def _with_live_cost(p: PodInfo, now: float) -> PodInfo:
        if p.state in LIVE and p.created_at and not p.serverless:  # a relay's cost is its requests
            return msgspec.structs.replace(p, cost_usd=round(p.hourly_usd * (now - p.created_at) / 3600, 6))
        return p

    async def _lease(self, req: LeaseRequest, _m: Msg) -> LeaseReply:
        self._model(req.model)
        until = time.time() + req.ttl_s
        self.leases[req.model] = (max(0, req.pods), until)
        log.info(
            "warm floor for %s: %d pod(s) until %s", req.model, req.pods, time.strftime("%H:%M:%S", time.gmtime(until))
        )
        return LeaseReply(model=req.model, pods=req.pods, until=until)

    async def _acquire(self, req: AcquireRequest, _m: Msg) -> AcquireReply:
        if not self.fence.admits(req.fence):
            raise BusError(
                "stale_leader",
                f"refused: from a former scheduler leader (token {req.fence}, newest {self.fence.newest})",
            )
        return AcquireReply(pod=await self.acquire(req.model, req.reason))

    async def acquire(self, model: str, reason: str = "") -> PodInfo:
        """A pod for `model`: one already on its way, or a new one within `max_pods` and the money caps."""
        m = self._model(model)
        async with self._locks.setdefault(model, asyncio.Lock()):
            live = self._live(model)
            pending = [p for p in live if p.state != "ready"]
            if pending:
                return pending[0]
            if live and (reason != "busy" or len(live) >= m.pod.max_pods):
                return live[0]
            if len(live) >= m.pod.max_pods:
                raise BusError("no_engine", f"model {model!r} has its {m.pod.max_pods} pod(s) already")
            return await self._create(m)

    async def _create(self, m: ModelConfig) -> PodInfo:
        from coderai.accounts.pod_money import OverBudget
        from coderai.pod_broker.runpod_api import NoCapacity, RunPodError

        if m.pod.serverless_endpoint:
            return await self.serverless.create(m)
        if not self.configured:
            raise BusError("no_engine", f"cannot rent a pod for {m.name!r}: {self._why_off()}")
        down = self.api.outage
        if down is not None and time.time() - down.last < DOWN_RETRY_S:
            raise BusError("no_engine", f"cannot rent a pod for {m.name!r}: {self._outage()}", retryable=True)
        s = self.settings
        image = await self.images.for_model(m)
        try:
            offers = [
                # an unpriced type (None) is 0: never a candidate; no spot price, no spot
                choosing.Offer(g.id, g.name, g.memory_gb, g.price_hr or 0.0, g.spot_price_hr or 0.0)
                for g in await self.api.gpu_types()
            ]
        except RunPodError as exc:
            raise BusError("no_engine", f"RunPod: {exc}", retryable=True) from None
        options = choosing.candidates(offers, m, m.memory_mb * MB, s.max_hourly_usd)
        if not options:
            raise BusError("no_engine", f"no RunPod GPU type fits {m.name!r} under its hourly cap")
        name = choosing.pod_name(s.deployment, m.name)
        tried: list[str] = []
        for offer in options:
            rate = choosing.pod_rate(offer, m.pod)
            amount = rate * (s.boot_timeout_s + m.pod.idle_timeout_s) / 3600
            now = time.time()
            try:
                reservation = await self.money.reserve(m.name, name, rate, amount, self._caps(m), now)
            except OverBudget as exc:
                raise BusError("over_budget", str(exc)) from None
            info = await self._save(
                PodInfo(
                    name=name,
                    model=m.name,
                    state="creating",
                    gpu_type=offer.id,
                    gpu_count=m.pod.gpu_count,
                    spot=m.pod.spot,
                    hourly_usd=rate,
                    created_at=now,
                    reserved_usd=reservation.amount_usd,
                )
            )
            t0 = time.time()
            try:
                rec = await self._create_once(m, name, offer, image)
            except NoCapacity:
                tried.append(offer.id)
                await self._forget(info, reservation)
                continue
            except RunPodError as exc:
                await self._forget(info, reservation)
                raise BusError("no_engine", f"RunPod: {exc}", retryable=True) from None
            # RunPod starts billing somewhere inside the create call: its midpoint errs by half its latency at most
            started = (t0 + time.time()) / 2
            await self.money.open_pod(name, offer.id, started)
            info = await self._save(msgspec.structs.replace(info, pod_id=rec.id, state="booting", created_at=started))
            log.info("rented %s (%s x%d, $%.4f/h) for %s", name, offer.id, m.pod.gpu_count, rate, m.name)
            await self._event("created", info)
            return info
        raise BusError("no_engine", f"no capacity on RunPod for {m.name!r} (tried {', '.join(tried)})", True)

    async def _create_once(self, m: ModelConfig, name: str, offer: choosing.Offer, image: str) -> Any:
        """Create the pod; after an error that may or may not have reached RunPod, look it up by name (never two
        pods, never an untracked one) and create again only when it is surely not there."""
        from coderai.pod_broker.runpod_api import NoCapacity, RunPodError

        s = self.settings
        # the pod's own NATS user, from the head's membership; it ends with the pod (end()) or after its ttl
        user = await self.bus.request(
            CMD_SCHEDULER_POD_USER, PodUserRequest(pod_id=name, ttl_s=s.pod_credentials_ttl_s, models=[m]), timeout=10.0
        )
        for attempt in range(3):
            try:
                return await self.api.create_pod(
                    name=name,
                    image=image,
                    gpu_type_id=offer.id,
                    gpu_count=m.pod.gpu_count,
                    env=choosing.pod_env(
                        name, m, s.pod_nats_url, user.user, user.password, ca_text(s.nats_ca), hf_token=s.hf_token
                    ),
                    spot=m.pod.spot,
                    network_volume_id=m.pod.volume,
                )
            except NoCapacity:
                raise
            except RunPodError as exc:
                rec = await self._find(name)
                if rec is not None:
                    return rec
                if not exc.retryable or attempt == 2:
                    raise
                log.warning("creating %s failed (%s); it is not there, trying again", name, exc)
                await asyncio.sleep(0.5 * 2**attempt)
        raise AssertionError("unreachable")

    async def _find(self, name: str) -> Any:
        with contextlib.suppress(Exception):
            return await self.api.find_by_name(name)
        return None

    async def _forget(self, info: PodInfo, _reservation: Any) -> None:
        await self.money.release(info.name)
        self.pods.pop(info.name, None)
        with contextlib.suppress(Exception):
            await self.kv.delete(info.name)

    def _caps(self, m: ModelConfig) -> Any:
        from coderai.accounts.pod_money import Caps

        s = self.settings
        # 0 in a models file or setting means "no such cap" (None to PodMoney); the global hourly cap is always
        # set, since pods are off without it
        return Caps(
            budget_usd=m.pod.budget_usd or None,
            period=m.pod.period,
            max_hourly_usd=m.pod.max_hourly_usd or None,
            global_budget_usd=s.global_budget_usd or None,
            global_period=s.global_period,
            global_max_hourly_usd=s.max_hourly_usd,
        )

    # --- watching -----------------------------------------------------------------------------------

    async def _on_heartbeat(self, hb: Heartbeat, _m: Msg) -> None:
        if hb.pod:
            p = self.pods.get(hb.node_id)
            self.heard.note(hb, live=p is not None and p.state in LIVE)

    async def _reconcile_loop(self) -> None:
        while True:
            try:
                await self.reconcile()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # retried on the next round
                log.warning("reconcile failed: %s", exc)
            await asyncio.sleep(self.settings.reconcile_s)

    async def reconcile(self) -> None:
        """One round: the ledger restored where Redis lacks it, readiness, boot timeouts, crashes, idle reaping,
        reservations, floors, orphans."""
        if self.money is not None:
            await self.money.restore()
        now = time.time()
        for p in list(self.pods.values()):
            if p.state not in LIVE or not p.pod_id:
                continue
            hb = self.heard.recent(p.name, NODE_TTL_S)
            if p.state == "booting":
                if hb is not None and any(e.model == p.model and e.state == "ready" for e in hb.engines):
                    p = await self._save(msgspec.structs.replace(p, state="ready", ready_at=now, last_busy_at=now))
                    log.info("pod %s is ready for %s after %.1fs", p.name, p.model, now - p.created_at)
                    await self._event("ready", p)
                elif now - p.created_at > self.settings.boot_timeout_s:
                    await self.end(p, "failed", f"never became ready within {self.settings.boot_timeout_s:.0f}s")
                    continue
            elif p.state == "ready":
                if hb is None:
                    await self._lost(p)
                    continue
                if hb.in_flight > 0:
                    p = await self._save(msgspec.structs.replace(p, last_busy_at=now))
                if await self._idle(p, now):
                    await self.end(p, "terminated", "idle")
                    continue
            if not p.serverless:  # a relay's requests reserve their own money
                await self._keep_reserved(p, now)
        await self._floors()
        if now - self._last_orphan_scan >= self.settings.orphan_scan_s:
            self._last_orphan_scan = now
            await self.reap_orphans()

    async def _lost(self, p: PodInfo) -> None:
        """A ready pod's worker stopped heartbeating. A spot pod RunPod shows stopped was preempted: RunPod took its
        GPU back and stopped billing it, so it is booked to when it stopped as heard (`Heard.stopped_at`), not to
        now. Anything else crashed. Either way it is terminated (a stopped pod would keep billing its volume) and
        nothing replaces it here: this round's floors, or the next request's escalation, rent another if the policy
        still asks for one."""
        if p.spot and await self._stopped_at_runpod(p):
            last = self.heard.stopped_at(p.name)
            log.warning(
                "spot pod %s of %s was preempted by RunPod; another is rented only for a warm floor or a request",
                p.name,
                p.model,
            )
            await self.end(p, "preempted", "preempted: RunPod took the spot pod's GPU back", billed_until=last)
        else:
            await self.end(p, "failed", "its worker stopped heartbeating (crashed?)")

    async def _stopped_at_runpod(self, p: PodInfo) -> bool:
        """RunPod stopped the pod (desiredStatus EXITED): only RunPod or its user stop one, a dead container does not
        (RunPod restarts it). Unknown while RunPod's API fails: then it counts as a crash."""
        from coderai.pod_broker.runpod_api import RunPodError

        with contextlib.suppress(RunPodError):
            rec = await self.api.get_pod(p.pod_id)
            return rec is not None and rec.status == "EXITED"
        return False

    async def _idle(self, p: PodInfo, now: float) -> bool:
        try:
            m = self._model(p.model)
        except BusError:
            return True  # its model is gone from the models file
        if now - max(p.last_busy_at, p.ready_at) < m.pod.idle_timeout_s:
            return False
        ready = [x for x in self._live(p.model) if x.state == "ready"]
        return len(ready) > self._floor(m, now)

    def _floor(self, m: ModelConfig, now: float) -> int:
        lease = self.leases.get(m.name)
        return max(m.pod.min_pods, lease[0] if lease and lease[1] > now else 0)

    async def _keep_reserved(self, p: PodInfo, now: float) -> None:
        """Keep the pod's reservation ahead of its cost; a cap that refuses more stops the pod. A reservation Redis
        lost (emptied or replaced) is made again at once, from the pod's creation to `reserve_ahead_s` from now, so
        its rate and what it will cost count against the caps again."""
        from coderai.accounts.pod_money import OverBudget

        cost = p.hourly_usd * (now - p.created_at) / 3600
        ahead = p.hourly_usd * self.settings.reserve_ahead_s / 3600
        try:
            held = await self.money.reservation(p.name)
            if held is not None and cost + ahead / 2 <= p.reserved_usd:
                return
            m = self._model(p.model)
            if held is None:
                held = await self.money.reserve(
                    p.model, p.name, p.hourly_usd, cost + ahead, self._caps(m), p.created_at
                )
                await self.money.open_pod(p.name, p.gpu_type, p.created_at)
            else:
                held = await self.money.extend(held, ahead, now, self._caps(m))
        except (OverBudget, BusError) as exc:
            await self.end(p, "terminated", f"budget: {exc}")
            return
        await self._save(msgspec.structs.replace(p, reserved_usd=held.amount_usd))

    async def _floors(self) -> None:
        now = time.time()
        for m in list(self.models.values.values()):
            want = self._floor(m, now)
            if want and len(self._live(m.name)) < want and (self.configured or m.pod.serverless_endpoint):
                try:
                    async with self._locks.setdefault(m.name, asyncio.Lock()):
                        if len(self._live(m.name)) < want:
                            await self._create(m)
                    self._unfilled.pop(m.name, None)
                except BusError as exc:  # tried again next round; said once per reason, not every round
                    if self._unfilled.get(m.name) != exc.message:
                        self._unfilled[m.name] = exc.message
                        log.warning("warm floor for %s not filled: %s", m.name, exc.message)

    async def end(self, p: PodInfo, state: str, reason: str, billed_until: float | None = None) -> PodInfo:
        """Terminate the pod (retried) and bill it from creation to now, boot included, or to `billed_until` when
        RunPod stopped billing it before (a preempted spot pod)."""
        from coderai.pod_broker.runpod_api import RunPodError

        if p.serverless:
            return await self.serverless.end(p, state, reason)

        p = await self._save(msgspec.structs.replace(p, state="stopping"))
        self.heard.forget(p.name)
        t0 = time.time()
        try:
            await self.api.terminate_pod(p.pod_id)
        except RunPodError as exc:
            log.warning("terminating %s failed (%s); the orphan reaper retries", p.name, exc)
        end = (t0 + time.time()) / 2  # billing stops somewhere inside the call, as it started inside the create
        if billed_until is not None:
            end = max(p.created_at, min(end, billed_until))
        with contextlib.suppress(BusError):  # its credentials end with it (else with their ttl)
            await self.bus.request(CMD_SCHEDULER_REVOKE, RevokeRequest(node_id=p.name, forget=True), timeout=5.0)
        entry = await self.money.book(p.name, p.model, p.gpu_type, p.hourly_usd, p.created_at, end, end)
        usd = entry.usd if entry is not None else p.cost_usd  # None: booked already (a retried end)
        p = await self._save(
            msgspec.structs.replace(
                p,
                state=state,
                ended_at=end,
                cost_usd=usd,
                error="" if state == "terminated" else reason,
            )
        )
        log.info("pod %s %s (%s): %.0fs, $%.6f", p.name, state, reason, end - p.created_at, usd)
        await self._event("stopped", p, reason=reason)
        await self._event("billed", p, seconds=end - p.created_at, usd=usd)
        return p

    async def reap_orphans(self) -> list[str]:
        """Terminate (and bill) pods named for this deployment that no live record tracks. A tracked spot pod RunPod
        stopped while it booted was preempted: ended here, billed until it stopped running as far as it was
        heard (`Heard.stopped_at`), else until now (it never heartbeated)."""
        prefix = choosing.name_prefix(self.settings.deployment)
        if self.api is None:
            return []
        try:
            listed = await self.api.list_pods()
        except Exception as exc:  # the next scan retries
            log.warning("listing pods failed: %s", exc)
            return []
        reaped = []
        for rec in listed:
            tracked = self.pods.get(rec.name)
            if tracked is not None and tracked.state == "booting" and tracked.spot and rec.status == "EXITED":
                await self.end(
                    tracked,
                    "preempted",
                    "preempted while booting: RunPod took the spot pod's GPU back",
                    billed_until=self.heard.stopped_at(tracked.name),
                )
                continue
            if not rec.name.startswith(prefix) or rec.status == "TERMINATED":
                continue
            if tracked is not None and tracked.state in LIVE + ("stopping",):
                continue
            log.warning("terminating orphan pod %s (%s)", rec.name, rec.id)
            if tracked is not None:  # billed already; its terminate had failed
                with contextlib.suppress(Exception):
                    await self.api.terminate_pod(rec.id)
            else:  # nobody knew of it: bill what it ran, as far as RunPod says (no runtime: stopped, or booting)
                now = time.time()
                await self.end(
                    PodInfo(
                        name=rec.name,
                        model="",
                        state="ready",
                        pod_id=rec.id,
                        spot=rec.spot,
                        gpu_type=rec.gpu_type_id or "",
                        hourly_usd=rec.cost_per_hr,
                        created_at=now - (rec.uptime_s or 0),
                    ),
                    "terminated",
                    "orphan",
                )
            reaped.append(rec.name)
        return reaped


def make(settings: BrokerSettings):
    """The broker runs on every head and acts on one: the holder of the `pod-broker` lease (acquire, reap,
    reconcile: renting twice what one head rents is money). A pod image key that cannot be used is a SettingsError
    here, at start: every pod would be refused."""
    check_trust_settings(settings)
    return singleton("pod-broker", settings, lambda _leader: Broker(settings).start)
