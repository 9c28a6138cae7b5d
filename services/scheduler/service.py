"""Scheduler lifecycle: publish model configs, record live nodes, write each node's assignment."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from typing import Any

import msgspec
from nats.aio.msg import Msg

from coderai.contracts import (
    GGUF_FAMILIES,
    Assignment,
    BusError,
    Heartbeat,
    ModelConfig,
    ModelUnloaded,
    encode,
    model_key,
)
from coderai.contracts.admin import NodeInfo, NodesReply, NodesRequest, PlaceReply, PlaceRequest
from coderai.contracts.pods import LIVE_POD, AcquireRequest, EscalateReply, EscalateRequest, PodInfo
from coderai.contracts.stages import StagePlan, StagePlanRequest
from coderai.contracts.store import StoreChunk, StoreFetch, StoreList, StoreListing, check_store_path
from coderai.contracts.subjects import (
    CMD_BROKER_ACQUIRE,
    CMD_SCHEDULER_ESCALATE,
    CMD_SCHEDULER_NODES,
    CMD_SCHEDULER_PLACE,
    CMD_SCHEDULER_STAGES,
    CMD_STORE_FETCH,
    CMD_STORE_LIST,
    EVT_MODEL_UNLOADED,
    HEARTBEAT,
)
from coderai.contracts.topology import ASSIGNMENTS, MODELS, NODE_TTL_S, NODES, PODS, WORK
from coderai.contracts.training import FineTuneJob
from coderai.runtime.bus import Bus
from coderai.runtime.claims import believed
from coderai.runtime.kv import RevisionCache, list_keys, put_if_changed, read_all, read_key
from coderai.runtime.leader import Leader, singleton
from coderai.runtime.members import requester
from coderai.runtime.mirror import KVMirror
from coderai.scheduler import stages, store_scope
from coderai.models_file import load_models
from coderai.runtime.gguf_meta import block_count
from coderai.scheduler.placement import Plan
from coderai.scheduler.state import (
    Event,
    LayersRead,
    ModelSet,
    ModelsLoaded,
    NodeGone,
    NodeRevoked,
    NodeSeen,
    Planned,
    State,
    apply,
    heard,
    joined,
    live,
    silent,
)
from coderai.scheduler.residency import Residency, engines, placed
from coderai.scheduler.live_models import LiveModels
from coderai.scheduler.settings import SchedulerSettings
from coderai.scheduler.store import StoreFiles
from coderai.runtime.tls import ca_text
from coderai.scheduler import registry_sync
from coderai.scheduler.membership import Membership
from coderai.scheduler.training import Training

log = logging.getLogger("coderai.scheduler")


class Scheduler:
    state = State()  # what it knows (`state.py`): changed only by `apply`, read through the properties below

    def __init__(self, settings: SchedulerSettings, leader: Leader | None = None) -> None:
        self.state = State()
        self.settings = settings
        self.leader = leader  # the lease this scheduler runs under (runtime/leader.singleton); None: unfenced
        if settings.models_file:
            self.apply(ModelsLoaded(tuple(load_models(settings.models_file))))
        self.residency = Residency()  # on-demand loads, idle unloads, evictions
        self._passes = (0, 0)  # assignment passes (started, finished): a demand waits for the pass after it
        self._passed = asyncio.Event()
        self.bus: Bus | None = None
        self.membership: Membership | None = None  # with a member registry (the head's): joins, revocations, rights
        self.training: Training | None = None
        self._dirty = asyncio.Event()
        self._given_at: dict[str, dict[str, float]] = {}  # node id -> model -> when it was last given the node
        self._faults: set[tuple[str, str, str]] = set()  # (node, engine id, model) claims already logged
        self.store = StoreFiles(os.path.join(os.path.expanduser(settings.data_dir), "models"))

    @property
    def connected_bus(self) -> Bus:
        """The bus `start` connected (heartbeats, commands and passes come only after)."""
        if self.bus is None:
            raise RuntimeError("the scheduler is not started: no bus yet")
        return self.bus

    async def start(self, stack: contextlib.AsyncExitStack, stop: asyncio.Event) -> None:
        self.bus = await Bus.connect_as(self.settings, "scheduler", on_reconnect=self._on_reconnect)
        stack.push_async_callback(self.bus.close)
        self.kv_models = await self.bus.kv(MODELS)
        self.kv_nodes = await self.bus.kv(NODES)
        await self.bus.ensure_stream(WORK)  # workers (which may not create streams) pull fan-out parts from it
        self.assignments = KVMirror(self.bus, ASSIGNMENTS, Assignment)
        self.kv_assign = await self.assignments.bind()
        self.assignments.start()
        stack.callback(self.assignments.stop)
        try:  # placement is sticky: start from what the nodes were given before
            await asyncio.wait_for(self.assignments.synced.wait(), 10)
        except asyncio.TimeoutError:
            log.warning("assignments not synced within 10 s")
        self.node_records = RevisionCache(self.kv_nodes)
        if self.settings.models_file:
            await self._publish_models()
        else:
            self.apply(ModelsLoaded(tuple(await self._read_models())))
        task = asyncio.create_task(self._assign_loop())
        stack.callback(task.cancel)
        sub = await self.bus.listen(HEARTBEAT, self._on_heartbeat)
        stack.push_async_callback(sub.unsubscribe)
        for subject, handler in (
            (CMD_SCHEDULER_NODES, self._list_nodes),
            (CMD_SCHEDULER_PLACE, self._place),
            (CMD_SCHEDULER_ESCALATE, self._escalate),
            (CMD_STORE_FETCH, self._store_fetch),
            (CMD_STORE_LIST, self._store_list),
            (CMD_SCHEDULER_STAGES, self._stages),
        ):
            cmd = await self.bus.serve(subject, handler, queue="scheduler")
            stack.push_async_callback(cmd.unsubscribe)
        self.live_models = LiveModels(self)  # models added, changed or removed while it runs (bus, models file)
        await self.live_models.start(stack)
        s = self.settings
        if s.members_file:
            self.membership = Membership(
                self.bus,
                s.cluster_token,
                s.members_file,
                s.nats_users_file,
                s.nats_pid_file,
                ca_pem=ca_text(s.nats_ca),
                on_revoke=self._forget_node,
            )
            await self.membership.start(stack)
        self.training = Training(self)  # fine-tuning jobs: rendezvous, state, the adapter into the store
        await self.training.start(stack)
        log.info("scheduler up with %d model(s): %s", len(self.models), ", ".join(m.name for m in self.models))

    def apply(self, event: Event) -> None:
        """The one way the scheduler's state changes (what to do about the change is the caller's)."""
        self.state = apply(self.state, event)

    @property
    def models(self) -> list[ModelConfig]:
        return self.state.models

    @models.setter
    def models(self, models: list[ModelConfig]) -> None:
        self.apply(ModelsLoaded(tuple(models)))

    @property
    def nodes(self) -> dict[str, Heartbeat]:
        return self.state.nodes

    @property
    def seen(self) -> dict[str, float]:
        return self.state.seen

    @property
    def unplaced(self) -> dict[str, str]:
        return self.state.unplaced

    @property
    def splits(self) -> dict[str, Any]:
        return self.state.splits

    @property
    def restaged(self) -> dict[str, ModelConfig]:
        return self.state.restaged

    @property
    def last_plan(self) -> Plan:
        return self.state.last_plan

    @property
    def fence(self) -> int:
        """The token that goes with what this scheduler writes and asks: its lease's, 0 when it runs without one."""
        return self.leader.token if self.leader else 0

    def _forget_node(self, node_id: str) -> None:
        """A revoked node is gone now, not when its heartbeats would have timed out; a heartbeat it sent before its
        login was removed, still on its way, does not bring it back (`_on_heartbeat`)."""
        self.apply(NodeRevoked(node_id, time.monotonic()))
        self._dirty.set()

    def _block_counts(self) -> dict[str, int]:
        """Blocks per llama model whose GGUF this head can read (for the layer map of a split), read once."""
        read: dict[str, int] = {}
        for m in self.models:
            if m.engine in GGUF_FAMILIES and m.name not in self.state.layers:
                gguf = m.param_str("base") or m.path  # a fine-tuned model's path is its adapter
                local = os.path.expanduser(gguf) if gguf else ""
                path = (
                    local
                    if local and os.path.isfile(local)
                    else str(self.store.root / m.store_path / m.store_file)
                    if m.store_path and gguf == m.path
                    else ""
                )
                read[m.name] = block_count(path) if path else 0
        if read:
            self.apply(LayersRead(read))
        return self.state.layers

    async def _on_reconnect(self) -> None:
        self.node_records.revs.clear()  # a restarted server may have another history
        if self.membership is not None:
            self.membership.made.clear()  # and another WORK stream: its consumers are made again at the next pass
        self.assignments.start()
        self._dirty.set()

    # --- operator commands ------------------------------------------------------------------------

    async def _list_nodes(self, _req: NodesRequest, _m: Msg) -> NodesReply:
        now = time.monotonic()
        assigned = self.assignments.values
        infos = [
            NodeInfo(
                heartbeat=hb,
                assigned=[m.name for m in assigned[n].models] if n in assigned else [],
                age_s=round(now - self.seen.get(n, now), 3),
            )
            for n, hb in sorted(self.nodes.items())
        ]
        return NodesReply(nodes=infos, unplaced=dict(self.unplaced), splits=dict(self.splits))

    async def _place(self, req: PlaceRequest, _m: Msg) -> PlaceReply:
        """Edit a model's `nodes` (and `replicas`, so an added node really gets a copy); lasts until the
        scheduler restarts from a models file, which stays the source of truth."""
        m = next((x for x in self.models if x.name == req.model), None)
        if m is None:
            raise BusError("not_found", f"no model {req.model!r}")
        holders = {n for n, a in self.assignments.values.items() if any(x.name == m.name for x in a.models)}
        if req.action == "place":
            nodes = sorted(set(m.nodes) | {req.node}) if m.nodes else [req.node]
            replicas = m.replicas + 1 if m.replicas and req.node not in holders else m.replicas
        else:
            base = m.nodes or [n for n, hb in self.nodes.items() if m.engine in hb.capabilities]
            nodes = sorted(set(base) - {req.node})
            if not nodes:
                raise BusError("bad_request", f"unplacing {req.node} would leave {m.name} on no node")
            replicas = m.replicas
        new = msgspec.structs.replace(m, nodes=nodes, replicas=replicas)
        self.apply(ModelSet(new))
        await put_if_changed(self.kv_models, model_key(m.name), encode(new))
        log.info("%s %s on %s: nodes=%s replicas=%d", req.action, m.name, req.node, nodes, replicas)
        self._dirty.set()
        return PlaceReply(model=new)

    async def _store_fetch(self, req: StoreFetch, m: Msg) -> StoreChunk:
        """A node lacks a model file: hand it a range of the file from this head's model store."""
        await self._may_read(m, req.path, folder=False)
        return await asyncio.to_thread(self.store.read, req)

    async def _store_list(self, req: StoreList, m: Msg) -> StoreListing:
        """A node lacks a model folder: the files in it, which it then fetches one by one."""
        await self._may_read(m, req.path, folder=True)
        return await asyncio.to_thread(self.store.listing, req)

    async def _may_read(self, m: Msg, path: str, folder: bool) -> None:
        """A service reads any store file; a node or pod only those of the models it holds and the jobs it trains
        (store_scope.py), judged from the mirrors and, when they say no, from the buckets themselves (a worker
        can see its new assignment a moment before this head's mirror does). Anything else is refused."""
        who = requester(getattr(m, "reply", "") or "")
        if who == "":
            return
        try:
            check_store_path(path.removesuffix("/") if folder else path)
        except ValueError as exc:
            raise BusError("bad_request", str(exc), param="path") from None
        if who is not None:
            if store_scope.may_read(path, folder, self._grants(who, self.assignments.values.get(who), None)):
                return
            if store_scope.may_read(path, folder, await self._fresh_grants(who, path)):
                return
        log.warning(
            "store read of %r refused to %s: not a file of a model or job it holds",
            path,
            f"node {who}" if who else "a request with no node inbox",
        )
        raise BusError(
            "forbidden",
            f"store path {path!r} is not a file of a model or fine-tuning job this node holds",
            param="path",
        )

    def _grants(
        self, node_id: str, assignment: Assignment | None, pod: PodInfo | None, jobs: tuple[FineTuneJob, ...] = ()
    ) -> list[str]:
        models = list(assignment.models) if assignment is not None else []
        if pod is not None and pod.state in LIVE_POD:
            models += [x for x in self.models if x.name == pod.model]
        live = tuple(j for j in self.training.jobs.values() if node_id in j.nodes) if self.training else ()
        return store_scope.grants(node_id, models, live + jobs)

    async def _fresh_grants(self, node_id: str, path: str) -> list[str]:
        """`_grants` from the buckets: the node's assignment, its pod record, and the job a `finetune/<job>/` path
        names."""
        assignment = await read_key(self.kv_assign, node_id, Assignment)
        pod = await read_key(await self.connected_bus.kv(PODS), node_id, PodInfo)
        job = None
        parts = path.split("/")
        if len(parts) > 2 and parts[0] == "finetune" and self.training is not None:
            job = await self.training.read_job(parts[1])
        return self._grants(node_id, assignment, pod, (job,) if job is not None else ())

    async def _stages(self, req: StagePlanRequest, _m: Msg) -> StagePlan:
        """Where each stage of one relayed video runs (coderai.scheduler.stages), from live heartbeats."""
        m = next((x for x in self.models if x.name == req.model), None)
        if m is None:
            raise BusError("not_found", f"no model {req.model!r}")
        try:
            out = stages.plan_stages(
                req,
                m,
                live(self.state, time.monotonic(), NODE_TTL_S),
                await asyncio.to_thread(stages.model_parts, m.path),
            )
        except stages.NoStagePlan as exc:
            raise BusError("no_engine", str(exc), retryable=True) from None
        log.info(
            "stages of %s: %s",
            req.job_id,
            ", ".join(
                f"{s.kind}{f' {s.start}..{s.end}' if s.kind == 'denoise' else ''} on {s.node}" for s in out.stages
            ),
        )
        return out

    async def _escalate(self, req: EscalateRequest, _m: Msg) -> EscalateReply:
        """The gateway found no engine, or only busy ones: load the model on demand (evicting idle ones for it) or,
        when no node can make room, rent a pod if the model's policy allows it now."""
        m = next((x for x in self.models if x.name == req.model), None)
        if m is None:
            raise BusError("not_found", f"no model {req.model!r}")
        if req.reason == "no_engine" and await self._load_on_demand(m):
            return EscalateReply(action="loading")
        room = self.residency.no_room.get(m.name)
        why = escalation_refused(m, req.reason, m.name in self.unplaced or room is not None)
        if why:
            if room:
                why = f"{m.name!r} cannot be loaded now: {room}; {why}"
            return EscalateReply(action="refused", code="no_engine", why=why)
        try:
            reply = await self.connected_bus.request(
                CMD_BROKER_ACQUIRE, AcquireRequest(model=m.name, reason=req.reason, fence=self.fence), timeout=15.0
            )
        except BusError as exc:
            code = "over_budget" if exc.code == "over_budget" else "no_engine"
            return EscalateReply(action="refused", code=code, why=exc.message)
        pod = reply.pod
        return EscalateReply(action="ready" if pod.state == "ready" else "acquiring", pod=pod.name)

    def _live(self) -> dict[str, Heartbeat]:
        """The owned nodes heard from within the TTL (a pod brings its own models)."""
        return live(self.state, time.monotonic(), NODE_TTL_S, pods=False)

    async def _load_on_demand(self, m: ModelConfig) -> bool:
        """Whether a copy of `m` is on its way to an engine: already assigned and loading, placed now by the pass
        after this demand (which may evict idle models for it), or to be placed once copies in use go idle."""
        if not self._coming(m.name):
            self.residency.ask(m.name)
            await self._replan()
        return self._coming(m.name) or m.name in self.residency.waiting

    def _coming(self, name: str) -> bool:
        """A live node is assigned `name` and its engine is loading, ready, or not reported yet."""
        up = self._live()
        if not placed(self.last_plan, name, up):
            return False
        status = engines(up)
        holders = [
            n for n, a in self.last_plan.assignments.items() if n in up and any(x.name == name for x in a.models)
        ]
        return any((s := status.get((name, n))) is None or s.state in ("loading", "ready") for n in holders)

    async def _replan(self, timeout_s: float = 10.0) -> None:
        """Wait for an assignment pass that starts after now (bounded)."""
        target = self._passes[0] + 1
        self._dirty.set()
        deadline = time.monotonic() + timeout_s
        while self._passes[1] < target and time.monotonic() < deadline:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._passed.wait(), max(0.01, deadline - time.monotonic()))

    async def _publish_models(self) -> None:
        want = {model_key(m.name): m for m in self.models}
        for key, m in want.items():
            await put_if_changed(self.kv_models, key, encode(m))
        for key in await list_keys(self.kv_models):
            if key not in want:
                await self.kv_models.delete(key)

    async def _read_models(self) -> list[ModelConfig]:
        return list((await read_all(self.kv_models, ModelConfig)).values())

    async def _given(self, hb: Heartbeat, now: float) -> frozenset[str]:
        """The models node `hb` may claim engines for: its assignment's (a pod's: its lease's), and those taken from
        it within the last NODE_TTL_S (a copy being unloaded is still reported for a while)."""
        given = self._given_at.setdefault(hb.node_id, {})
        assignment = self.assignments.values.get(hb.node_id)
        planned = self.last_plan.assignments.get(hb.node_id)
        for a in (assignment, planned):
            given.update((x.name, now) for x in (a.models if a is not None else ()))
        if hb.pod:
            pod = await read_key(await self.connected_bus.kv(PODS), hb.node_id, PodInfo)
            if pod is not None and pod.state in LIVE_POD:
                given[pod.model] = now
        for name in [n for n, t in given.items() if now - t > NODE_TTL_S]:
            del given[name]
        return frozenset(given)

    async def _on_heartbeat(self, hb: Heartbeat, m: Msg) -> None:
        now = time.monotonic()
        if not heard(self.state, hb, now, NODE_TTL_S):
            return  # sent before its revocation: a re-admitted node is heard again a heartbeat timeout later
        hb, refused = believed(hb, await self._given(hb, now))
        for e, why in refused:  # a node fault: logged once per claim, however many heartbeats repeat it
            if (claim := (hb.node_id, e.engine_id, e.model)) not in self._faults:
                if len(self._faults) >= 10_000:
                    self._faults.clear()
                self._faults.add(claim)
                log.warning("node fault: node %s claims %s; ignored", hb.node_id, why)
        new = joined(self.nodes.get(hb.node_id), hb)
        self.apply(NodeSeen(hb, now))
        if new:
            log.info("node %s joined (%s)", hb.node_id, hb.host)
            self._dirty.set()
        elif self.residency.waiting:
            self._dirty.set()  # a model asked for waits for room: this node's copies may be idle now
        elif hb.node_id in self.assignments.values and self.residency.expired(
            self.models, {hb.node_id: hb}, {hb.node_id: self.assignments.values[hb.node_id]}
        ):
            self._dirty.set()  # a copy here went idle past its keep-alive: unloaded within a heartbeat
        try:
            await self.node_records.put(hb.node_id, m.data if not refused else encode(hb))
        except Exception as exc:  # refreshed on the next heartbeat
            log.warning("could not record node %s: %s", hb.node_id, exc)

    async def _assign_loop(self) -> None:
        """Write assignments when membership changes; also forget nodes whose heartbeats stopped."""
        while True:
            try:
                await asyncio.wait_for(self._dirty.wait(), NODE_TTL_S / 2)
            except asyncio.TimeoutError:
                pass
            for node_id in silent(self.state, time.monotonic(), NODE_TTL_S):
                log.info("node %s left (no heartbeat for %.0fs)", node_id, NODE_TTL_S)
                self.apply(NodeGone(node_id))
                self._dirty.set()  # copies it held may need a new home
            if not self._dirty.is_set():
                continue
            if not self.assignments.current.is_set():
                # placement is sticky: a pass planned from a view of the assignments being rebuilt (a new leader
                # that has not read them whole, a reconnect) would move copies that are serving
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self.assignments.current.wait(), NODE_TTL_S / 2)
                continue
            self._dirty.clear()
            self._passes = (self._passes[0] + 1, self._passes[1])
            try:
                if self.leader is not None and not self.leader.held:  # stopped soon (singleton); write nothing now
                    raise BusError("unavailable", "the scheduler's lease lapsed")
                owned = {n: hb for n, hb in self.nodes.items() if not hb.pod}  # a pod brings its own models
                before = dict(self.assignments.values)
                result = self.residency.plan(self.models, owned, before, layers=self._block_counts())
                for name, why in result.unplaced.items():
                    if self.unplaced.get(name) != why:
                        log.warning("model %s: %s", name, why)
                for name, (node, split) in result.splits.items():
                    if name not in self.splits or self.splits[name] != split:
                        log.info(
                            "model %s split (%s) served by %s over %s",
                            name,
                            split.mode,
                            node,
                            ", ".join(f"{d.node_id} {d.share:.0%}" for d in split.devices),
                        )
                        if split.warning:
                            log.warning("model %s: %s", name, split.warning)
                turned = {
                    n
                    for n in set(result.restaged) | set(self.restaged)
                    if result.restaged.get(n) != self.restaged.get(n)
                }
                for m in self.models:  # what the gateway reads: a video model relayed by stages says so
                    if m.name in turned:
                        want = result.restaged.get(m.name, m)
                        await put_if_changed(self.kv_models, model_key(m.name), encode(want))
                        log.info(
                            "model %s %s",
                            m.name,
                            "fits no node whole: relayed stage by stage over several"
                            if want is not m
                            else "fits a node whole again: no stage relay",
                        )
                self.apply(Planned(result))
                await self._unloaded(before, result, owned)
                fence = self.fence
                for node_id, assignment in result.assignments.items():
                    assignment = msgspec.structs.replace(assignment, fence=fence)
                    if self.membership is not None:  # its rights follow what it holds, before it is told
                        await self.membership.grant_work(node_id, assignment.models)
                    if await put_if_changed(self.kv_assign, node_id, encode(assignment)):
                        log.info("assigned %s -> %s", node_id, [m.name for m in assignment.models])
            except Exception as exc:  # retried: the bus may be reconnecting
                log.warning("writing assignments failed (%s); retrying", exc)
                self._dirty.set()
                await asyncio.sleep(0.5)
            self._passes = (self._passes[0], self._passes[0])
            passed, self._passed = self._passed, asyncio.Event()
            passed.set()

    async def _unloaded(self, before: dict[str, Assignment], result: Plan, live: dict[str, Heartbeat]) -> None:
        """`ModelUnloaded` for each copy a live node loses in this pass, with why (idle, evicted, removed, moved)."""
        served = {m.name for m in self.models}
        for node_id, old in before.items():
            if node_id not in live:
                continue
            now = {x.name for x in result.assignments.get(node_id, Assignment(node_id=node_id)).models}
            for x in old.models:
                if x.name in now:
                    continue
                reason = self.residency.gone.pop((x.name, node_id), None) or (
                    "moved" if x.name in served else "removed"
                )
                log.info("unloading %s from %s (%s)", x.name, node_id, reason)
                with contextlib.suppress(BusError):
                    await self.connected_bus.publish(
                        EVT_MODEL_UNLOADED, ModelUnloaded(node_id=node_id, model=x.name, reason=reason, ts=time.time())
                    )


def escalation_refused(m: ModelConfig, reason: str, unplaced: bool) -> str:
    """Why `m` may not burst to a pod for `reason` now ("" when it may)."""
    burst = m.pod.burst
    if burst == "always" or (burst == "when_busy" and reason == "busy"):
        return ""
    if burst in ("when_no_fit", "always") and reason == "no_engine":
        return (
            "" if unplaced or burst == "always" else f"model {m.name!r} fits on a node of its own (burst=when_no_fit)"
        )
    return f"model {m.name!r} does not burst to rented pods for this (burst={burst}, {reason})"


def make(settings: SchedulerSettings):
    """The scheduler runs on every head and acts on one: the holder of the `scheduler` lease. On every head, with
    a member registry, its nats-server's users follow the cluster's registry (standbys included)."""
    lead = singleton("scheduler", settings, lambda leader: Scheduler(settings, leader).start)
    if not settings.members_file:
        return lead

    async def start(stack: contextlib.AsyncExitStack, stop: asyncio.Event) -> None:
        await registry_sync.follow(settings, stack)
        await lead(stack, stop)

    return start
