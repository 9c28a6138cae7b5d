"""A model served by hosts started on demand: the `host` family. Its jobs are relayed, as the `remote` family's
are, to OpenAI-compatible servers; here those servers are the hosts of a pool the worker starts when a request
needs one and stops when idle (engines/host_pool.py).

Params: `pool`: the name of a pool in the worker's `<data_dir>/host_pools.toml` (engines/host_pools_file.py),
where the operator declares its hosts and the commands that start and stop them; `served_model`, `api_key_secret`,
`timeout_s`, `max_answer_mb`, `concurrency` as for `remote`. The commands are never params: a model's params are
set through the admin API and travel over the bus, and what runs on a node is its operator's to say.

A request goes to the least busy up host (one started if none is up); one that fails before the first token (it
died) is taken out and the request goes to another, started if need be. Past the first token a failure is the
request's. No host up in time is a retryable `no_engine` (503).
"""

from __future__ import annotations

import threading
from typing import Any

from coderai.contracts import ChatJob, Choice, CompletionJob, ModelConfig, Usage
from coderai.engine_worker.engines.base import CancelFlag, Engine, EngineLoadError, EngineLost
from coderai.engine_worker.engines.host_pool import Attempt, HostPool, NoHost, open_pool, release_pool
from coderai.engine_worker.engines.host_pools_file import POOL_NAME, PoolsError, pools_path, read_pools
from coderai.engine_worker.engines.openai_client import Emit, OpenAIClient, PromptCounters
from coderai.engine_worker.engines.remote import (
    NotStarted,
    relay_clients,
    relay_counted,
    relay_once,
    worker_data_dir,
)


class HostPoolEngine(Engine):
    """Jobs relayed to the hosts of a pool, started on demand, failing over before the first token."""

    family = "host"
    blocking = True

    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config)
        self.max_concurrency = config.param_int("concurrency") or 64
        self.counters = PromptCounters()
        self.pool: HostPool | None = None
        self.clients: list[OpenAIClient] = []
        self._lock = threading.Lock()
        self._closed = False

    def load(self) -> None:
        cfg = self.config
        name = cfg.param_str("pool") or ""
        if not POOL_NAME.match(name):
            raise EngineLoadError(
                "a host model needs params.pool: the name of a pool in the worker's <data_dir>/host_pools.toml"
            )
        path = pools_path(worker_data_dir())
        try:
            pools = read_pools(path)
        except PoolsError as exc:
            raise EngineLoadError(str(exc)) from None
        decl = pools.get(name)
        if decl is None:
            raise EngineLoadError(f"no pool {name!r} in {path} (it declares {', '.join(sorted(pools)) or 'none'})")
        self.clients = relay_clients(cfg, [host.url for host in decl.hosts], "host", self.counters)
        with self._lock:
            if self._closed:  # closed from another thread while it loaded (a load aborted)
                return
            self.pool = pool = open_pool(name, decl)
        pool.survey()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            pool, self.pool = self.pool, None
        if pool is not None:
            release_pool(pool)
        for c in self.clients:
            c.close()

    def stats(self) -> dict[str, Any]:
        return self.counters.stats()

    def _relay(self, op: str, job: Any, cancel: CancelFlag, emit: Emit | None) -> tuple[list[Choice], Usage]:
        pool = self.pool
        if pool is None:
            raise EngineLost(f"{self.config.name} is not loaded")
        attempt = Attempt()
        failures: list[str] = []
        while not cancel:
            unhook = cancel.on_set(pool.wake)
            try:
                h = pool.acquire(attempt, lambda: bool(cancel))
            except NoHost as exc:
                raise EngineLost("; ".join([str(exc), *failures])) from None
            finally:
                unhook()
            try:
                return relay_once(self.clients[h.index], f"host {h.url}", op, job, cancel, emit)
            except NotStarted as failed:  # the host's failure: another host
                pool.failed(h, failed.cause)
                attempt.failed.add(h)
                failures.append(str(failed))
            finally:
                pool.release(h)
        raise EngineLost("cancelled before a host took the request")

    def chat(self, job: ChatJob, cancel: CancelFlag, emit: Emit | None) -> tuple[list[Choice], Usage]:
        return relay_counted(self._relay, "chat", job, cancel, emit)

    def complete(self, job: CompletionJob, cancel: CancelFlag, emit: Emit | None) -> tuple[list[Choice], Usage]:
        return relay_counted(self._relay, "complete", job, cancel, emit)
