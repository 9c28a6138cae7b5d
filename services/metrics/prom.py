"""Prometheus series and how one event changes them. Pure: no I/O beyond the registry."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from coderai.contracts import Heartbeat, ModelLoaded, ModelUnloaded, PartDone, RequestCompleted
from coderai.contracts.nodes import EVICTED_MAX
from coderai.contracts.leaders import LeaderInfo

BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
LOAD_BUCKETS = (0.5, 1, 2.5, 5, 10, 20, 30, 60, 120, 300, 600, 1200)  # a tiny GGUF to a large model over a slow disk


class Series:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "coderai_requests", "API requests finished", ["key", "model", "kind", "status", "engine"], registry=r
        )
        self.seconds = Histogram(
            "coderai_request_seconds", "API request duration", ["model", "kind", "status"], buckets=BUCKETS, registry=r
        )
        self.ttft = Histogram(
            "coderai_ttft_seconds", "time to the first token or part", ["model", "kind"], buckets=BUCKETS, registry=r
        )
        self.tokens = Counter("coderai_tokens", "tokens processed", ["key", "model", "type"], registry=r)
        self.in_flight = Gauge(
            "coderai_engine_in_flight", "jobs running or queued per engine", ["node", "engine", "model"], registry=r
        )
        self.served = Gauge(
            "coderai_engine_served",
            "jobs an engine has finished since it loaded",
            ["node", "engine", "model"],
            registry=r,
        )
        self.spend = Counter(
            "coderai_spend_usd", "what requests cost at the models' prices", ["key", "model"], registry=r
        )
        self.nodes_up = Gauge("coderai_nodes_up", "nodes heard from within the heartbeat TTL", registry=r)
        self.engines_up = Gauge(
            "coderai_engines_up", "engines ready to serve (loaded copies), by model", ["model"], registry=r
        )
        self.budget_left = Gauge(
            "coderai_key_budget_remaining_usd", "what a key may still spend this period", ["key", "period"], registry=r
        )
        self.route = Counter("coderai_route_decisions", "router decisions by reason", ["reason"], registry=r)
        self.prompt_tokens = Gauge(
            "coderai_engine_prompt_tokens",
            "prompt tokens an engine received since it loaded",
            ["node", "engine", "model"],
            registry=r,
        )
        self.cached_tokens = Gauge(
            "coderai_engine_cached_prompt_tokens",
            "prompt tokens served from the engine's prefix cache",
            ["node", "engine", "model"],
            registry=r,
        )
        self.prefix_hits = Gauge(
            "coderai_engine_prefix_hits",
            "requests that reused a cached prefix",
            ["node", "engine", "model"],
            registry=r,
        )
        self.cache_bytes = Gauge(
            "coderai_engine_prompt_cache_bytes",
            "memory held by the engine's prompt cache",
            ["node", "engine", "model"],
            registry=r,
        )
        self.cache_evicted = Counter(
            "coderai_engine_cache_evicted_keys",
            "conversations the engine's KV cache dropped, as its KV events said (vLLM): the router forgets them there",
            ["node", "engine", "model"],
            registry=r,
        )
        self.parts_sent = Counter(
            "coderai_fanout_parts_sent", "parts fan-out requests were split into", ["model", "kind"], registry=r
        )
        self.parts = Counter(
            "coderai_fanout_parts",
            "fan-out parts a worker finished (ok), handed back (retry) or failed",
            ["model", "kind", "node", "status"],
            registry=r,
        )
        self.redelivered = Counter(
            "coderai_fanout_redelivered",
            "fan-out parts run again after their worker died or failed",
            ["model", "kind"],
            registry=r,
        )
        self.pods = Gauge("coderai_pods", "rented pods by model and state", ["model", "state"], registry=r)
        # `coderai_spend_usd` already counts request prices by key; pods' money is its own family
        self.pod_spend = Gauge(
            "coderai_pod_spend_usd", "what rented pods cost, booked, this period", ["model", "period"], registry=r
        )
        self.pod_budget_left = Gauge(
            "coderai_budget_remaining_usd",
            "a model's pod budget left this period (spent and reserved taken off)",
            ["model", "period"],
            registry=r,
        )
        self._pod_labels: set[tuple[str, str]] = set()
        self.leader = Gauge(
            "coderai_leader",
            "1 for the head that holds a singleton's lease (0 for one that held it before)",
            ["role", "holder"],
            registry=r,
        )
        self.leader_token = Gauge(
            "coderai_leader_token",
            "the fencing token of a singleton's lease (0: nobody holds it)",
            ["role"],
            registry=r,
        )
        self._leader_labels: set[tuple[str, str]] = set()
        self.mem_free = Gauge("coderai_node_memory_free_bytes", "free RAM per node", ["node"], registry=r)
        self.hot = Gauge(
            "coderai_node_hot",
            "sensors of a node (its GPUs, or the machine) over the worker's temperature limit: its engines there "
            "take no new work until they cool (0: none)",
            ["node"],
            registry=r,
        )
        self.gpu_free = Gauge(
            "coderai_node_gpu_memory_free_bytes", "free memory per GPU of a node", ["node", "gpu"], registry=r
        )
        self.loads = Counter(
            "coderai_model_loads", "copies of a model a node finished loading", ["model", "node"], registry=r
        )
        self.load_seconds = Histogram(
            "coderai_model_load_seconds", "how long a copy took to load", ["model"], buckets=LOAD_BUCKETS, registry=r
        )
        self.unloads = Counter(
            "coderai_model_unloads",
            "copies the scheduler took off a node, by why (evicted: room for another)",
            ["model", "node", "reason"],
            registry=r,
        )
        self.idle = Gauge(
            "coderai_engine_idle_seconds",
            "seconds since an engine's last job ended (0 while one runs)",
            ["node", "engine", "model"],
            registry=r,
        )
        self.engine_memory = Gauge(
            "coderai_engine_memory_bytes",
            "memory an engine's copy was placed for (the scheduler's estimate)",
            ["node", "engine", "model"],
            registry=r,
        )
        self._engines: dict[str, set[tuple[str, str, str]]] = {}
        self._models_seen: set[str] = set()

    def on_request(self, e: RequestCompleted) -> None:
        self.requests.labels(e.key_name, e.model, e.op, e.status, e.engine_id).inc()
        self.seconds.labels(e.model, e.op, e.status).observe(e.duration_s)
        if e.ttft_s is not None and e.status == "ok":
            self.ttft.labels(e.model, e.op).observe(e.ttft_s)
        if e.route_reason:
            self.route.labels(e.route_reason).inc()
        if e.parts:
            self.parts_sent.labels(e.model, e.op).inc(e.parts)
        if e.cost_usd:
            self.spend.labels(e.key_name, e.model).inc(e.cost_usd)
        if e.prompt_tokens:
            self.tokens.labels(e.key_name, e.model, "prompt").inc(e.prompt_tokens)
        if e.completion_tokens:
            self.tokens.labels(e.key_name, e.model, "completion").inc(e.completion_tokens)

    def on_part(self, e: PartDone) -> None:
        """Per-worker share (parts by node), and parts that needed another delivery."""
        self.parts.labels(e.model, e.op, e.node_id, e.status).inc()
        if e.deliveries > 1 and e.status != "retry":
            self.redelivered.labels(e.model, e.op).inc()

    def on_loaded(self, e: ModelLoaded) -> None:
        self.loads.labels(e.model, e.node_id).inc()
        self.load_seconds.labels(e.model).observe(e.load_s)

    def on_unloaded(self, e: ModelUnloaded) -> None:
        self.unloads.labels(e.model, e.node_id, e.reason).inc()

    def on_pods(self, counts: dict[tuple[str, str], int]) -> None:
        """Pods per (model, state) from `coderai_pods`; states no pod is in any more drop to 0."""
        for labels in self._pod_labels - set(counts):
            self.pods.labels(*labels).set(0)
        for labels, n in counts.items():
            self.pods.labels(*labels).set(n)
        self._pod_labels |= set(counts)

    def on_leaders(self, infos: list[LeaderInfo]) -> None:
        """Who holds each singleton's lease; a former holder drops to 0."""
        now = {(i.role, i.holder) for i in infos if i.holder}
        for labels in self._leader_labels - now:
            self.leader.labels(*labels).set(0)
        for labels in now:
            self.leader.labels(*labels).set(1)
        for i in infos:
            self.leader_token.labels(i.role).set(i.token if i.holder else 0)
        self._leader_labels |= now

    def census(self, heartbeats: dict[str, Heartbeat]) -> None:
        """Nodes and ready engines per model, from the live nodes' last heartbeats."""
        self.nodes_up.set(len(heartbeats))
        per_model: dict[str, int] = {}
        for hb in heartbeats.values():
            for e in hb.engines:
                if e.state == "ready":
                    per_model[e.model] = per_model.get(e.model, 0) + 1
        for model in list(self._models_seen - set(per_model)):
            self.engines_up.labels(model).set(0)
        for model, n in per_model.items():
            self.engines_up.labels(model).set(n)
        self._models_seen |= set(per_model)

    def on_heartbeat(self, hb: Heartbeat) -> None:
        self.mem_free.labels(hb.node_id).set(hb.mem_free)
        self.hot.labels(hb.node_id).set(len(hb.hot))
        for i, gpu in enumerate(hb.gpu_memory):
            self.gpu_free.labels(hb.node_id, str(i)).set(gpu.free)
        now = {(hb.node_id, e.engine_id, e.model) for e in hb.engines}
        per_engine = (
            self.in_flight,
            self.served,
            self.prompt_tokens,
            self.cached_tokens,
            self.prefix_hits,
            self.cache_bytes,
            self.idle,
            self.engine_memory,
        )
        for gone in self._engines.get(hb.node_id, set()) - now:
            for g in (*per_engine, self.cache_evicted):
                g.remove(*gone)
        self._engines[hb.node_id] = now
        for e in hb.engines:
            labels = (hb.node_id, e.engine_id, e.model)
            if e.evicted:  # each key named once, in the heartbeat after its blocks went
                self.cache_evicted.labels(*labels).inc(min(len(e.evicted), EVICTED_MAX))
            for g, v in zip(
                per_engine,
                (
                    e.in_flight,
                    e.served,
                    e.prompt_tokens,
                    e.cached_tokens,
                    e.prefix_hits,
                    e.cache_bytes,
                    e.idle_s,
                    e.memory,
                ),
            ):
                g.labels(*labels).set(v)
