"""Metrics lifecycle: consume `request.completed` from EVENTS (durable), follow heartbeats, fan-out parts and model
loads and unloads, serve /metrics."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

import hmac
import secrets
import threading
from socketserver import ThreadingMixIn
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import make_wsgi_app

import time

from nats.aio.msg import Msg
from coderai.accounts.keys import KeyStore
from coderai.accounts.limits import period_id
from coderai.contracts import Heartbeat, RequestCompleted, decode, why_malformed
from coderai.contracts.subjects import (
    EVT_MODEL_LOADED,
    EVT_MODEL_UNLOADED,
    EVT_PART_DONE,
    EVT_REQUEST_COMPLETED,
    HEARTBEAT,
)
from coderai.contracts.topology import EVENTS, LEADERS, MODELS, NODE_TTL_S, PODS
from coderai.accounts import usage
from coderai.metrics.prom import Series
from coderai.metrics.settings import MetricsSettings
from coderai.runtime.bus import Bus
from coderai.runtime.kv import read_all
from coderai.runtime.leader import Leader, leaders
from coderai.runtime.lifecycle import stop_task
from coderai.runtime.node_id import stable_node_id

log = logging.getLogger("coderai.metrics")
BATCH = 1000  # events per fetch


class Metrics:
    def __init__(self, settings: MetricsSettings) -> None:
        self.settings = settings
        self.series = Series()
        self.redis: Any = None
        self.applied = 0  # the last EVENTS sequence counted (Redis keeps it across restarts: usage.record_new)
        self._stored_up_to = 0  # the usage mark this process last saw Redis store (a lower one: Redis lost usage)
        self._mark_name = ""
        self._live: dict[str, tuple[float, Heartbeat]] = {}
        self._pod_kvs: tuple[Any, Any] | None = None
        self._leaders_kv: Any = None
        self.leader: Leader | None = None
        self._consumer: asyncio.Task | None = None

    async def start(self, stack: contextlib.AsyncExitStack, stop: asyncio.Event) -> None:
        s = self.settings
        server = serve_metrics(s.host, s.port, self.series.registry, s.scrape_token)
        stack.callback(server.shutdown)
        log.info("serving Prometheus metrics on http://%s:%d/metrics", s.host, s.port)
        if s.redis_url:
            from coderai.runtime import redis_client

            # one connection, not a pool that grows with chance overlaps of the census and the consumer: the
            # service's open files stay what they were after start (the soak's fd target, docs/reliability.md)
            self.redis = redis_client.connect(s.redis_url, blocking=True, max_connections=1, timeout=None)
            stack.push_async_callback(self.redis.aclose)
        self.bus = await Bus.connect_as(s, "metrics")
        stack.push_async_callback(self.bus.close)
        await self.bus.ensure_stream(EVENTS)
        hb = await self.bus.listen(HEARTBEAT, self._on_heartbeat)
        stack.push_async_callback(hb.unsubscribe)
        for subject, handler in (
            (EVT_PART_DONE, self._on_part),
            (EVT_MODEL_LOADED, self._on_loaded),
            (EVT_MODEL_UNLOADED, self._on_unloaded),
        ):
            sub = await self.bus.listen(subject, handler)  # best effort, like heartbeats: no usage rides on them
            stack.push_async_callback(sub.unsubscribe)
        # one head counts usage, under the lease named after its consumer ("metrics"): consumers sharing the durable
        # consumer would each ack past the others' unrecorded batches (it acks cumulatively) and move Redis' mark
        # past them, losing their usage. Every head serves /metrics, heartbeats and the census.
        self.leader = Leader(self.bus, s.consumer, stable_node_id(s.data_dir, s.node_id), on_change=self._on_lease)
        await self.leader.try_once()
        self.leader.start()
        stack.push_async_callback(self.leader.stop)  # after the consumer has stopped: a step-down hands over
        stack.push_async_callback(self._on_lease, False)  # its pull subscription gone before the bus drains
        census = asyncio.create_task(self._census_loop())
        stack.callback(census.cancel)

    async def _on_lease(self, held: bool) -> None:
        """Count usage while this head holds the lease; stop at once when it is lost or the service stops."""
        if held and self._consumer is None:
            self._consumer = asyncio.create_task(self._consume(), name="usage-consumer")
        elif not held and self._consumer is not None:
            task, self._consumer = self._consumer, None
            await stop_task(task)
            log.info("usage counting stopped on this head")

    async def _on_heartbeat(self, hb: Heartbeat, _m: Msg) -> None:
        self.series.on_heartbeat(hb)
        self._live[hb.node_id] = (time.monotonic(), hb)

    async def _on_part(self, e, _m) -> None:
        self.series.on_part(e)

    async def _on_loaded(self, e, _m) -> None:
        self.series.on_loaded(e)

    async def _on_unloaded(self, e, _m) -> None:
        self.series.on_unloaded(e)

    async def _census_loop(self) -> None:
        """Every few seconds: nodes and engines up (from heartbeats), and each Redis key's remaining budget."""
        while True:
            now = time.monotonic()
            self._live = {n: v for n, v in self._live.items() if now - v[0] <= NODE_TTL_S}
            self.series.census({n: v[1] for n, v in self._live.items()})
            try:
                self._leaders_kv = self._leaders_kv or await self.bus.kv(LEADERS)
                self.series.on_leaders(await leaders(self._leaders_kv))
            except Exception as exc:  # retried on the next round
                log.debug("leaders not read: %s", exc)
            if self.redis is not None:
                try:
                    await self._budgets()
                    await self._pods()
                except Exception as exc:  # retried on the next round
                    log.debug("budgets not read: %s", exc)
            await asyncio.sleep(5)

    async def _pods(self) -> None:
        """Rented pods by state (from `coderai_pods`), and each bursting model's pod spend and budget left."""
        from coderai.accounts.pod_money import PodMoney
        from coderai.contracts import ModelConfig
        from coderai.contracts.pods import PodInfo

        counts: dict[tuple[str, str], int] = {}
        if self._pod_kvs is None:  # bound once, not every census round
            self._pod_kvs = (await self.bus.kv(PODS), await self.bus.kv(MODELS))
        pods_kv, models_kv = self._pod_kvs
        for pod in (await read_all(pods_kv, PodInfo)).values():
            counts[(pod.model, pod.state)] = counts.get((pod.model, pod.state), 0) + 1
        for model in (await read_all(models_kv, ModelConfig)).values():
            if model.pod.burst != "never":
                money, period = PodMoney(self.redis, prefix=self.settings.pod_ledger_prefix), model.pod.period
                spent = await money.spend(model.name, period)
                self.series.pod_spend.labels(model.name, period).set(spent)
                if model.pod.budget_usd:
                    left = model.pod.budget_usd - spent - await money.reserved(model.name, period)
                    self.series.pod_budget_left.labels(model.name, period).set(max(0.0, left))
        self.series.on_pods(counts)

    async def _budgets(self) -> None:
        for key in await KeyStore(self.redis).list():
            if key.budget_usd and not key.revoked:
                pid, _ = period_id(key.budget_period, time.time())
                spent = float(await self.redis.get(f"coderai:spend:{key.name}:{pid}") or 0)
                self.series.budget_left.labels(key.name, key.budget_period).set(max(0.0, key.budget_usd - spent))

    async def _subscribe(self, start_seq: int = 0) -> Any:
        """A durable pull consumer acking cumulatively: one ack per batch, not per event. `start_seq` > 0: made
        anew from that stream sequence (what Redis has counted, plus one), whatever the old one had acked."""
        from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy
        from nats.js.errors import NotFoundError

        cfg = ConsumerConfig(ack_policy=AckPolicy.ALL, max_ack_pending=20_000, ack_wait=30)
        js, name = self.bus.js, self.settings.consumer
        if start_seq:
            with contextlib.suppress(NotFoundError):
                await js.delete_consumer(EVENTS.name, name)
            cfg.deliver_policy, cfg.opt_start_seq = DeliverPolicy.BY_START_SEQUENCE, start_seq
        try:
            return await js.pull_subscribe(EVT_REQUEST_COMPLETED(), durable=name, stream=EVENTS.name, config=cfg)
        except Exception as exc:  # a consumer made by an older release with per-message acks
            log.info("recreating consumer %s (%s)", name, exc)
            await js.delete_consumer(EVENTS.name, name)
            return await js.pull_subscribe(EVT_REQUEST_COMPLETED(), durable=name, stream=EVENTS.name, config=cfg)

    async def _take(self, events: list[tuple[int, RequestCompleted]], mark: str) -> bool:
        """A batch's usage to Redis, then to Prometheus what Redis took and this process had not counted yet (a
        batch delivered again is counted by neither; usage counted again into an emptied Redis is not counted
        again by Prometheus, whose counters never lost it). False: given up, nothing counted (`_record`)."""
        fresh = [e for seq, e in events if seq > self.applied]
        if self.redis is not None and events:
            recorded = await self._record(events, mark)
            if recorded is None:
                return False
            taken = {id(e) for e in recorded}
            fresh = [e for e in fresh if id(e) in taken]
        for e in fresh:
            self.series.on_request(e)
        return True

    async def _record(self, events: list, mark: str) -> list[RequestCompleted] | None:
        """Usage of this batch to Redis, tried again until Redis takes it. Not moving on matters: the consumer
        acks cumulatively, so acking a later batch would ack this one too, and its usage would be lost. A head
        that lost the lease gives the batch up (None): the next leader reads it again from Redis' mark."""
        wait, unsure = 0.25, False
        writer, token = secrets.token_hex(8), self.leader.token if self.leader is not None else 0
        top = max((seq for seq, _e in events), default=0)
        while True:
            try:
                fresh = await usage.record_new(self.redis, events, mark, stored_up_to=self._stored_up_to, writer=writer)
                self._stored_up_to = max(self._stored_up_to, top)
                if unsure and not fresh and events:
                    # an attempt that failed may have been stored with its answer lost (Redis killed after EXEC):
                    # Prometheus counts the batch then, or it would miss it. But this head's next consumer (after
                    # the lease was lost and won again while this batch was held) may have stored it instead, and
                    # counted it: Redis keeps who stored each batch, so it is counted once (the soak saw it twice)
                    return [e for _seq, e in events] if await usage.stored_by(self.redis, mark, top) == writer else []
                return fresh
            except usage.MarkLost:
                raise
            except Exception as exc:  # Redis down or restarting: hold the batch, try again
                unsure = True
                if self.leader is not None and (not self.leader.held or self.leader.token != token):
                    log.warning(
                        "usage of a batch not recorded (%s); this head no longer leads, so the next leader counts it",
                        exc,
                    )
                    return None
                log.warning("usage not recorded (%s); trying again in %.1fs", exc, wait)
                await asyncio.sleep(wait)
                wait = min(wait * 2, 5.0)

    async def _check_mark(self, mark: str) -> None:
        """MarkLost if Redis' mark is behind what this process saw it store: a replica promoted before the last
        batches reached it, or an emptied Redis. One GET a second, only while no events come."""
        if self.redis is None or not self._stored_up_to:
            return
        try:
            stored = int(await self.redis.get(mark) or 0)
        except Exception:  # Redis down: the next batch's write waits for it
            return
        if stored < self._stored_up_to:
            raise usage.MarkLost(mark)

    async def _mark(self) -> str:
        """The Redis key holding the last EVENTS sequence whose usage is recorded; named after the stream's
        creation time, so a stream made again (its sequences starting over) starts a new mark."""
        info = await self.bus.js.stream_info(EVENTS.name)
        made = int(info.created.timestamp()) if info.created else 0
        return f"coderai:usage:applied:{self.settings.consumer}:{made}"

    async def _consume(self) -> None:
        """Pull events in batches: usage to Redis first, then Prometheus, then one ack for the batch. If Redis
        fails the batch is held and tried again until it is taken (nothing later is acked meanwhile); if the ack
        is lost (NATS restarting) the batch comes again, and the stream sequence Redis records with the usage
        keeps it from being counted twice.

        The lease's first subscription starts where Redis' mark says usage was counted up to, not where the
        consumer's acks stand: a former leader may have fetched a batch it never recorded, and a cumulative ack
        of a later batch would otherwise ack it too, unrecorded. A Redis that lost the mark (replaced, or emptied)
        lost the usage with it: the consumer then starts again from the stream's first event, and usage is
        counted again from what EVENTS still holds (7 days)."""
        resume = self.redis is not None
        while True:
            sub = None
            try:
                mark = await self._mark()
                if mark != self._mark_name:  # another EVENTS stream (made anew): its sequences start over
                    self._mark_name, self._stored_up_to, self.applied = mark, 0, 0
                start = int(await self.redis.get(mark) or 0) + 1 if resume else 0
                sub = await self._subscribe(start)
                if resume:
                    self.applied, resume = max(self.applied, start - 1), False
                    log.info("counting usage from EVENTS sequence %d", start)
                while True:
                    try:
                        msgs = await sub.fetch(batch=BATCH, timeout=1.0)
                    except asyncio.TimeoutError:  # idle: is what Redis counted still there? (the next batch
                        await self._check_mark(mark)  # would tell, but an idle cluster may send none for hours)
                        continue
                    if not msgs:  # nats-py may end a wait with nothing in hand (a stray status message)
                        continue
                    events = []
                    for m in msgs:
                        try:
                            events.append((m.metadata.sequence.stream, decode(m.data, RequestCompleted)))
                        except Exception as exc:  # a malformed event is dropped, not retried forever
                            log.warning("dropping malformed event: %s", why_malformed(exc))
                    # a lost lease or a stop cancels this task: the batch's usage and its Prometheus counts are
                    # taken whole or not at all, so Redis and Prometheus keep agreeing
                    if not await asyncio.shield(self._take(events, mark)):
                        # given up: this head stopped leading while Redis refused the batch. The lease is lost for
                        # good (its change cancels this task) or was renewed late and is held again; either way the
                        # batch is not counted, acked or taken as applied, and whoever leads starts from Redis' mark.
                        # Taking it as applied made Prometheus skip it when it came again: the soak's full disk
                        # (leases not renewed, Redis refusing writes) left Prometheus one short of Redis
                        while self.leader is not None and not self.leader.held:
                            await asyncio.sleep(0.5)
                        resume = True
                        break
                    self.applied = max([self.applied, *(seq for seq, _e in events)])
                    await msgs[-1].ack()
                    if len(msgs) < BATCH:  # caught up: a fetch, a pipeline and an ack per event would cost the
                        await asyncio.sleep(self.settings.batch_linger_s)  # hot path CPU on a small box
            except asyncio.CancelledError:
                raise
            except usage.MarkLost:
                log.warning(
                    "Redis has lost usage it had counted (a new or emptied Redis, or a replica promoted before the "
                    "last batches reached it): counting again from the EVENTS sequence Redis still holds"
                )
                resume, self._stored_up_to = True, 0
            except Exception as exc:  # the bus may be reconnecting; resubscribe
                log.warning("event consumer stopped (%s); restarting", exc)
                await asyncio.sleep(0.5)
            finally:
                if sub is not None:  # a pull subscription left behind holds the connection's drain open
                    with contextlib.suppress(Exception):
                        await sub.unsubscribe()


class _Server(ThreadingMixIn, WSGIServer):
    daemon_threads = True


class _Quiet(WSGIRequestHandler):
    def log_message(self, *args: object) -> None:  # scrapes every 15 s would flood the log
        pass


def serve_metrics(host: str, port: int, registry, token: str):
    """Prometheus exposition on a thread; with a token, anything without `Bearer <token>` gets 401."""
    app = make_wsgi_app(registry)

    def guarded(environ, start_response):
        if token:
            given = environ.get("HTTP_AUTHORIZATION", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {token}".encode()):
                start_response("401 Unauthorized", [("Content-Type", "text/plain")])
                return [b"a scrape token is required\n"]
        return app(environ, start_response)

    server = make_server(host, port, guarded, server_class=_Server, handler_class=_Quiet)
    threading.Thread(target=server.serve_forever, name="metrics-http", daemon=True).start()
    return server


def make(settings: MetricsSettings):
    return Metrics(settings).start
