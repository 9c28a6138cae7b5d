"""Engine-worker lifecycle: heartbeat, watch this node's assignment, converge the loaded engines on it."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import time
from pathlib import Path

import msgspec

from coderai import engine_params
from coderai.catalog import ModelStore
from coderai.contracts import Assignment, ModelConfig, ModelLoaded, decode, why_malformed
from coderai.contracts.admin import DrainRequest, NodeLogs, NodeLogsRequest, NodeState
from coderai.contracts.subjects import CMD_NODE_DRAIN, CMD_NODE_LOGS, EVT_MODEL_LOADED, HEARTBEAT
from coderai.contracts.topology import ASSIGNMENTS
from coderai.engine_worker.engines import available_families
from coderai.engine_worker.fetch import stored_files
from coderai.engine_worker.host import EngineHost
from coderai.engine_worker.node import GpuProbe, addresses, build_heartbeat, memory
from coderai.engine_worker.rpc import RpcService, cluster_address, gate_address
from coderai.engine_worker.settings import WorkerSettings
from coderai.engine_worker.thermal import Thermal, thermal_for
from coderai.engine_worker.training import TrainingHost, training_capabilities
from coderai.contracts import BusError
from coderai.runtime.joining import JoinRefused, join, remember_head, saved_url
from coderai.runtime.bus import DEFAULT_NATS_URL, Bus
from coderai.runtime.members import node_inbox
from coderai.runtime.tls import ca_text, client_context
from coderai.runtime.cluster import check_token as check_cluster_token
from coderai.runtime.cluster import fingerprint, user_of
from coderai.runtime.discovery import Announcement, Announcer, find_head
from coderai.runtime.embedded import find_llama_server
from coderai.runtime.kv import KeyWatch
from coderai.runtime.leader import Fence
from coderai.runtime.logging import add_secret, ring

LEAVE_TIMEOUT_S = 2.0  # how long a stopping worker tries to say so before it lets the heartbeat timeout say it

log = logging.getLogger("coderai.engine_worker")


def weights_store(s: WorkerSettings) -> ModelStore:
    """Where weights fetched by a model's source go: `weights_dir` (a pod's network volume) when this node can
    write there, else its data dir, saying why (a volume RunPod did not attach, or one this user may not write):
    the pod still serves, and the next one fetches again."""
    if s.weights_dir:
        root = Path(os.path.expanduser(s.weights_dir))
        try:
            root.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            log.warning("cannot keep weights in %s (%s); keeping them in the data dir", root, exc)
        else:
            if os.access(root, os.W_OK | os.X_OK):
                return ModelStore(s.data_dir, root=root)
            log.warning("cannot keep weights in %s (not writable by this user); keeping them in the data dir", root)
    return ModelStore(s.data_dir)


class Worker:
    def __init__(self, settings: WorkerSettings, node_id: str) -> None:
        self.settings = settings
        self.node_id = node_id
        self.fence = Fence()  # the newest scheduler token seen on this node's assignments
        # `train` in an explicit family list offers fine-tuning; it is a capability, not an engine family
        self.families = [f for f in settings.families or available_families() if f not in ("train", "qlora")]
        self.train_caps = training_capabilities() if not settings.families or "train" in settings.families else []
        self.bus: Bus | None = None
        self.hosts: dict[str, EngineHost] = {}
        self._seq = 0
        self._converge_lock = asyncio.Lock()
        self._to_load: asyncio.Queue[EngineHost] = asyncio.Queue()  # hosts waiting for the loader, in order
        self._loader: asyncio.Task | None = None
        self._loading: EngineHost | None = None  # the host being loaded now, and its task
        self._load_task: asyncio.Task | None = None
        self._watch_task: asyncio.Task | None = None
        self.draining = False
        self.leaving = False  # stopping: every heartbeat from now on says so (`_leave`)
        self.models_dir = Path(os.path.expanduser(settings.data_dir)) / "models"  # files fetched from the head
        self.addrs: list[str] = []  # this node's addresses, the one it reaches the bus from first
        # NVIDIA GPUs and their memory, for placement; without them, the Vulkan devices a Vulkan llama-server lists
        self.gpu = GpuProbe(find_llama_server())
        # the scheduler pins copies to GPUs by NVML's index, which counts in PCI bus order; CUDA's own default
        # (fastest first) may not, so engines in this process and its children count as NVML does
        os.environ.setdefault("CUDA_DEVICE_ORDER", "PCI_BUS_ID")
        self.rpc: RpcService | None = None
        self.stored: list[str] = []  # model files fetched from the head's store (fetch.stored_files), for placement
        self.weights = weights_store(settings)
        self.thermal: Thermal | None = None  # a GPU (or this machine) too hot for new work pauses engines (start)
        add_secret(os.environ.get("HF_TOKEN", ""))  # the pull reads it from the environment; no log line shows it

    @property
    def _bus(self) -> Bus:
        """The bus `start` connected (assignments, loads and their events come only after)."""
        if self.bus is None:
            raise RuntimeError("the worker is not started: no bus yet")
        return self.bus

    async def start(self, stack: contextlib.AsyncExitStack, stop: asyncio.Event) -> None:
        s = self.settings
        self.bus = await self._connect()
        self._note_head()
        stack.push_async_callback(self.bus.close)
        reached = self.bus.nc.connected_url  # the server this node reached
        if reached is None:
            raise RuntimeError("the bus connection was lost as soon as it was made")
        bus_url = reached.geturl()
        self.addrs = addresses(cluster_address(bus_url))
        if s.rpc:
            self.rpc = RpcService(gate_address(s.rpc_bind, bus_url, s.rpc_allow_any), s.rpc_port, s.rpc_threads)
            await self.rpc.start()
            stack.push_async_callback(self.rpc.close)
        fp = s.announce_fingerprint or (fingerprint(s.cluster_token) if s.cluster_token else "")
        if fp and s.mdns:
            announcer = Announcer(
                Announcement(
                    node_id=self.node_id,
                    name=socket.gethostname(),
                    fp=fp,
                    nats_port=s.announce_nats_port,
                    caps=tuple(self.families),
                ),
                s.mdns_interfaces,
            )
            await announcer.start()
            stack.push_async_callback(announcer.close)
        stack.push_async_callback(self._unload_all)
        for subject, handler in ((CMD_NODE_LOGS, self._logs), (CMD_NODE_DRAIN, self._drain)):
            sub = await self.bus.serve(subject, handler, subject_str=subject(node_id=self.node_id))
            stack.push_async_callback(sub.unsubscribe)
        if self.train_caps:  # fine-tuning ranks run as child processes (engine_worker/training.py)
            await TrainingHost(
                self.bus,
                self.node_id,
                Path(os.path.expanduser(s.data_dir)),
                train_addr=s.train_addr,
                mdns_interfaces=s.mdns_interfaces,
            ).start(stack)
        self.stored = await asyncio.to_thread(stored_files, self.models_dir)
        hb = asyncio.create_task(self._heartbeat_loop())
        stack.callback(hb.cancel)
        stack.push_async_callback(self._leave, hb)
        self.thermal = await asyncio.to_thread(thermal_for, s.thermal_file, s.thermal_limit_c, s.thermal_resume_c)
        if self.thermal is not None:
            watch = asyncio.create_task(self.thermal.run(s.thermal_poll_s, self.hold), name="thermal")
            stack.callback(watch.cancel)
        if s.models_json:  # a rented pod: its models came with it, nobody reassigns them
            fixed = decode(s.models_json, list[ModelConfig])
            self._watch_task = asyncio.create_task(self.converge(Assignment(node_id=self.node_id, models=fixed)))
        else:
            self._restart_watch()
        stack.callback(lambda: self._watch_task and self._watch_task.cancel())
        log.info("worker %s up with engine families %s", self.node_id, self.families)

    async def _connect(self) -> Bus:
        """The bus as this node: with the credentials in the URL (a pod, this box's own worker), else with those
        saved at the last join, else joining with the cluster token (again, when the saved ones are refused)."""
        s = self.settings
        url = s.nats_url
        if not url and s.cluster_token and s.mdns:
            url = await self._discover()
        url = url or DEFAULT_NATS_URL
        kw = dict(on_reconnect=self._on_reconnect, inbox_prefix=node_inbox(self.node_id))
        name = f"worker:{self.node_id}"
        if user_of(url)[0] or not s.cluster_token:
            ca = ca_text(s.nats_ca)
            return await Bus.connect(url, name, tls=client_context(ca) if ca else None, **kw)
        check_cluster_token(s.cluster_token)
        saved, ca = saved_url(s.data_dir, url, self.node_id)
        if saved:
            try:  # the CA pinned at the join: a server whose certificate it did not sign is refused
                return await Bus.connect(
                    saved, name, connect_timeout_s=10, tls=client_context(ca) if ca else None, **kw
                )
            except BusError as exc:
                # kept: the join proves them when the head still holds them (it was only unreachable), and a
                # successful join replaces them
                log.warning(
                    "the head refused this node's saved credentials, or is not the head they were made "
                    "with (%s); joining again",
                    exc.message,
                )
        try:
            joined, ca = await join(url, s.cluster_token, self.node_id, s.data_dir)
        except JoinRefused as exc:
            raise BusError("forbidden", str(exc), retryable=False) from None
        # Bus.connect retries a refused login until its deadline: the head's reload of nats-server may lag the welcome
        return await Bus.connect(joined, name, connect_timeout_s=30, tls=client_context(ca) if ca else None, **kw)

    async def _logs(self, req: NodeLogsRequest, _m) -> NodeLogs:
        return NodeLogs(node_id=self.node_id, lines=ring.tail(req.lines))

    async def _drain(self, req: DrainRequest, _m) -> NodeState:
        """Drain or undrain every engine (those a hot card holds stay paused until it cools); new models loaded
        while draining start drained too."""
        self.draining = req.drain
        log.info("node %s", "draining: taking no new work" if req.drain else "taking work again")
        await self.hold()
        return NodeState(
            node_id=self.node_id, draining=self.draining, in_flight=sum(h.in_flight for h in self.hosts.values())
        )

    def held(self, host: EngineHost) -> bool:
        """Whether `host` may take no new work now: the node drains, or a card it runs on (or the machine) is hot."""
        return self.draining or (self.thermal is not None and self.thermal.holds(list(host.config.devices)))

    async def hold(self) -> None:
        """Pause the engines held (`held`), resume the others (paused by a drain or the heat that ended), and say so
        in a heartbeat; engines in flight finish either way."""
        for h in list(self.hosts.values()):
            await (h.pause() if self.held(h) else h.resume())
        await self.publish_heartbeat()

    async def _discover(self) -> str:
        """Browse mDNS until a head with our token's fingerprint shows up (a stranger's cluster never matches)."""
        s = self.settings
        fp = fingerprint(s.cluster_token)
        log.info(
            "looking for the head of cluster %s by mDNS on %s",
            fp[:8],
            ", ".join(s.mdns_interfaces) or "every interface",
        )
        while True:
            try:
                host, port, head = await find_head(fp, s.mdns_interfaces, s.discover_timeout_s)
            except asyncio.TimeoutError:
                log.warning("no head with this cluster token's fingerprint (%s) yet; still looking", fp[:8])
                continue
            log.info("found head %s at nats://%s:%d", head, host, port)
            return f"nats://{host}:{port}"

    # --- heartbeats -------------------------------------------------------------------------------

    async def publish_heartbeat(self) -> None:
        if self.bus is None or not self.bus.connected:
            return
        self._seq += 1
        engines = [h.status() for h in self.hosts.values()]
        if self.leaving:  # said before the engines are paused (`_leave`): the word goes out first
            engines = [msgspec.structs.replace(e, state="draining") if e.state == "ready" else e for e in engines]
        hb = build_heartbeat(
            self.node_id,
            self._seq,
            self.families + self.train_caps,
            engines,
            pod=self.settings.pod,
            addrs=self.addrs,
            rpc=self.rpc.info(*memory()) if self.rpc is not None else None,
            gpu=self.gpu,
            mem_budget=self.settings.memory_budget_mb << 20,
            stored=self.stored,
        )
        if self.thermal is not None and self.thermal.hot:
            hb = msgspec.structs.replace(hb, hot=self.thermal.hot_temps())
        if self.leaving:
            hb = msgspec.structs.replace(hb, leaving=True)
        await self.bus.publish(HEARTBEAT, hb, node_id=self.node_id)

    async def _leave(self, beating: asyncio.Task) -> None:
        """The worker is stopping (SIGTERM: its operator, `docker compose down`, RunPod taking a spot pod back):
        from now on its heartbeats say it is leaving, the first one at once with every engine draining, so the
        routers stop sending it work now rather than a heartbeat timeout later, and the pod broker bills a
        preempted pod to this moment. Jobs in flight go on until the engines close."""
        beating.cancel()
        self.draining = self.leaving = True
        try:
            await asyncio.wait_for(self.publish_heartbeat(), LEAVE_TIMEOUT_S)
        except Exception as exc:  # the bus is away: the heartbeat timeout says it instead
            log.info("could not say this node is leaving: %s", exc)
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.hold(), LEAVE_TIMEOUT_S)

    async def _heartbeat_loop(self) -> None:
        while True:
            try:
                if self.rpc is not None:
                    await self.rpc.tend()
                await self.publish_heartbeat()
            except Exception as exc:  # a missed heartbeat is retried on the next tick
                log.warning("heartbeat failed: %s", exc)
            await asyncio.sleep(self.settings.heartbeat_s)

    # --- assignment -------------------------------------------------------------------------------

    def _restart_watch(self) -> None:
        if self._watch_task is not None:
            self._watch_task.cancel()
        self._watch_task = asyncio.create_task(self._watch_assignment())

    def _note_head(self) -> None:
        """The head this node's saved login reached, kept in its list of heads (joining.remember_head)."""
        s, bus = self.settings, self.bus
        if bus is None or not s.cluster_token or user_of(s.nats_url)[0]:
            return
        where = bus.nc.connected_url
        if where is not None and where.hostname and where.port:
            host = f"[{where.hostname}]" if ":" in where.hostname else where.hostname
            remember_head(s.data_dir, self.node_id, f"nats://{host}:{where.port}")

    async def _on_reconnect(self) -> None:
        self._note_head()
        if self.settings.models_json:
            await self.publish_heartbeat()
            return
        # nats-py re-sends plain subscriptions itself (doing it again would deliver every job twice), but a
        # restarted server may have lost the watch's ephemeral consumer: start the watch afresh.
        self._restart_watch()
        await self.publish_heartbeat()

    async def _watch_assignment(self) -> None:
        """Follow this node's key in `coderai_assignments`; every value is converged on in order."""
        while True:
            watch = None
            try:
                watch = await KeyWatch(self.bus, ASSIGNMENTS.name, self.node_id).start()
                while True:
                    value = await watch.next()
                    if not value:
                        await self.converge(Assignment(node_id=self.node_id))
                        continue
                    try:
                        assignment = decode(value, Assignment)
                    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
                        log.error("ignoring malformed assignment: %s", why_malformed(exc))
                        continue
                    if not self.fence.admits(assignment.fence):  # a scheduler that led once and woke up late
                        log.warning(
                            "ignoring an assignment from a former leader (token %d, newest %d)",
                            assignment.fence,
                            self.fence.newest,
                        )
                        continue
                    await self.converge(assignment)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # the watch is restarted; the bus may be reconnecting
                log.warning("assignment watch ended (%s); restarting", exc or type(exc).__name__)
                await asyncio.sleep(0.5)
            finally:
                if watch is not None:
                    await watch.stop()

    def _trusted(self, m: ModelConfig) -> ModelConfig:
        """`m` without what chooses a program or its environment, unless this node's own settings allow it."""
        if self.settings.bus_exec or not (engine_params.EXEC_PARAMS & set(m.params)):
            return m
        dropped = sorted(engine_params.EXEC_PARAMS & set(m.params))
        log.warning(
            "ignoring %s of %s from the bus (CODERAI_WORKER_BUS_EXEC=true on this node honours them)",
            ", ".join(dropped),
            m.name,
        )
        return msgspec.structs.replace(
            m, params={k: v for k, v in m.params.items() if k not in engine_params.EXEC_PARAMS}
        )

    async def converge(self, assignment: Assignment) -> None:
        """Unload what is no longer wanted (or changed), at once even while it is still loading (its load is
        cancelled and its server stopped); then queue what is missing for the loader, which loads one at a time.
        A load never holds this up: a model whose server never becomes healthy blocks neither its own removal nor
        the next assignment."""
        assignment = msgspec.structs.replace(assignment, models=[self._trusted(m) for m in assignment.models])
        async with self._converge_lock:
            if self.rpc is not None and self.rpc.gate is not None:
                await self.rpc.admit(assignment.rpc_peers)
            wanted: dict[str, ModelConfig] = {m.name: m for m in assignment.models if m.engine in self.families}
            for m in assignment.models:
                if m.engine not in self.families:
                    log.error("assigned %s needs engine family %s, which this worker lacks", m.name, m.engine)
            going: list[EngineHost] = []
            for name, host in list(self.hosts.items()):
                if wanted.get(name) != host.config:
                    del self.hosts[name]
                    if host is self._loading:
                        log.info("cancelling the load of %s", name)
                        await self._cancel_load(host)
                    elif host.state == "loading":  # queued, not started: nothing to free
                        log.info("dropping the queued load of %s", name)
                        await host.let_go()
                    else:
                        going.append(host)
            new = [self._host(cfg) for name, cfg in wanted.items() if name not in self.hosts]
            if going:  # what is unloaded no longer shows while it drains
                await self.publish_heartbeat()
            for host in going:
                # reloaded with another config (a deliberate replace): the jobs that come meanwhile wait for the
                # new copy, those running finish (bounded) before the old one is freed
                successor = self.hosts.get(host.config.name)
                log.info("%s %s", "reloading" if successor is not None else "unloading", host.config.name)
                await host.unload(self.settings.drain_timeout_s, successor=successor)
            for host in new:
                self._to_load.put_nowait(host)
            if self._loader is None or self._loader.done():
                self._loader = asyncio.create_task(self._load_in_turn(), name="model-loader")
        await self.publish_heartbeat()

    def _host(self, cfg: ModelConfig) -> EngineHost:
        host = self.hosts[cfg.name] = EngineHost(
            self._bus,
            self.node_id,
            cfg,
            self.settings.keepalive_s,
            models_dir=self.models_dir,
            weights=self.weights,
            share_cache=self.settings.share_cache,
        )
        return host

    async def _load_in_turn(self) -> None:
        """Load the queued models one at a time (two loads at once could need the memory of both), skipping any
        removed before its turn."""
        while True:
            host = await self._to_load.get()
            if self.hosts.get(host.config.name) is not host:
                continue
            self._loading = host
            self._load_task = asyncio.create_task(self._load(host), name=f"load-{host.config.name}")
            try:
                await asyncio.wait({self._load_task})  # a cancelled load ends its task, not this loop
            finally:
                self._loading, task = None, self._load_task
                self._load_task = None
                await host.let_go()  # however its load ended: jobs handed over to it stop waiting
            if self.hosts.get(host.config.name) is not host:  # removed while it loaded: free what it holds
                await host.unload(0)
            elif task is not None and task.cancelled():
                host.state, host.error = "failed", "its load was cancelled"

    async def _load(self, host: EngineHost) -> None:
        name = host.config.name
        await self.publish_heartbeat()
        loaded = await host.load()
        if host.config.store_path or host.config.source:  # it may have fetched files
            self.stored = await asyncio.to_thread(stored_files, self.models_dir)
        if loaded and self.hosts.get(name) is host:
            if self.held(host):  # the node drains, or its card is hot: it starts paused
                await host.pause()
            evt = ModelLoaded(
                node_id=self.node_id, engine_id=host.engine_id, model=name, load_s=host.load_s, ts=time.time()
            )
            await self._bus.publish(EVT_MODEL_LOADED, evt, node_id=self.node_id)
        await self.publish_heartbeat()

    async def _cancel_load(self, host: EngineHost) -> None:
        """Stop `host`'s load now: its task cancelled (a fetch of its files stops), its server stopped (the thread
        waiting for the server to be healthy sees it end)."""
        if self._load_task is not None:
            self._load_task.cancel()
        await host.abort_load()

    async def _unload_all(self) -> None:
        if self._loader is not None:
            self._loader.cancel()
        if self._loading is not None:
            await self._cancel_load(self._loading)
        for host in list(self.hosts.values()):
            await host.unload(self.settings.drain_timeout_s)
        self.hosts.clear()
        with contextlib.suppress(Exception):
            await self.publish_heartbeat()
